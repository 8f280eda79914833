"""Training review 5: loader workers under a low open-file limit, a shard rewritten mid-run,
--resume with the data folder spelled otherwise, progress off a terminal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
from test_train_review3 import config as review3_config

from draftsmith.errors import DraftsmithError
from draftsmith.train import TrainConfig, train
from draftsmith.train.loop import Trainer


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def config(root, out, **over) -> TrainConfig:
    """test_train_review3's run, six steps logged every other one."""
    return review3_config(root, out, **{"max_steps": 6, "log_every": 2, **over})


def quiet_train(cfg: TrainConfig) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)


# Two loader workers reading 30 steps ahead under a soft open-file limit 20 above what the
# process holds, then under a hard limit as low.
LOW_LIMIT = """
import os, resource, sys
from draftsmith.data.shards import Dataset
from draftsmith.errors import DraftsmithError
from draftsmith.train.batches import Plan, batches
from draftsmith.train.reader import ShardReader

ds = Dataset(sys.argv[1])
plan = Plan(ds.lengths(), 2, 48, 1, 0, 0)
for hard in (False, True):
    limit = len(os.listdir("/proc/self/fd")) + 20
    now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit if hard else now_hard))
    try:
        print("read", sum(1 for _ in batches(plan, ShardReader(ds), 0, 30, workers=2)))
    except DraftsmithError as e:
        print("error:", e)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_loader_workers_under_a_low_open_file_limit_read_or_refuse_in_one_line(root):
    """The batches of workers arrive as shared-memory descriptors: under a soft limit a few
    dozen above what was open, reading ahead failed mid-run with torch's 'Too many open files'
    tracebacks and an EOFError. The soft limit is now raised to the hard one; where the hard
    one is too low too, one error names `ulimit -n` and --loader-workers."""
    r = subprocess.run([sys.executable, "-c", LOW_LIMIT, str(root / "data")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0] == "read 30", r.stdout + r.stderr[-2000:]
    assert lines[1].startswith("error: --loader-workers 2: reading ahead they may hold"), lines
    assert "`ulimit -n" in lines[1] and "--loader-workers (0" in lines[1]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_rewritten_during_training_stops_the_run_naming_it(root, tmp_path, monkeypatch,
                                                                  workers):
    """A `data make` rerun replacing a shard while training read the folder: the run read the
    new file where it had not opened the old one yet, training on samples it never planned
    (another layout under the manifest it had read). Now the first read of the replaced
    file stops the run with one line naming it, in a loader worker too."""
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    real = Trainer.train_step

    def replaced_first(self):
        if self.step == 0:  # as a rerun writes: a new file renamed over the old one
            shutil.copy(data / "shard-00000.safetensors", data / "new.tmp")
            os.replace(data / "new.tmp", data / "shard-00002.safetensors")
        real(self)

    monkeypatch.setattr(Trainer, "train_step", replaced_first)
    with pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, f"rewritten-{workers}", data=str(data), loader_workers=workers,
                           max_steps=12))
    said = str(e.value)
    assert "\n" not in said, said
    assert said.startswith(f"{data / 'shard-00002.safetensors'}: the shard changed on disk")
    assert "--resume" in said


def test_an_unchanged_dataset_trains_with_workers_as_without(root):
    """The open-time check passes files that stayed: the same drafter with and without workers
    reading the shards (each worker opens every shard again)."""
    import torch

    from draftsmith.models.eagle3 import load_drafter

    quiet_train(config(root, "plain"))
    quiet_train(config(root, "workers", loader_workers=2))
    a, b = (load_drafter(root / x).state_dict() for x in ("plain", "workers"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_takes_the_data_folder_however_it_is_spelled(root, monkeypatch):
    """`--data data` resumed as `--data data/` (a shell's completion) or as an absolute path
    was refused: 'data was ... in that run'. The same folder now resumes; another is refused."""
    monkeypatch.chdir(root)
    quiet_train(config(root, "spelled", data="data", time_limit=0.0))
    quiet_train(config(root, "spelled", data=f"{root / 'data'}/", resume=True, time_limit=0.0))
    quiet_train(config(root, "spelled", data="./data/", resume=True))
    assert (root / "spelled" / "draftsmith.json").is_file()
    other = root / "other_data"
    shutil.copytree(root / "data", other)
    with pytest.raises(DraftsmithError, match="data was './data/' in that run"):
        quiet_train(config(root, "spelled", data=str(other), resume=True))


def test_progress_off_a_terminal_is_one_line_per_logged_step(root, capfd):
    """Off a terminal (a log file, a pipe) the bar wrote carriage-return redraws into one
    endless line, warnings landing mid-line; now each logged step is a line of its own."""
    quiet_train(config(root, "lines", progress=True))
    err = capfd.readouterr().err
    assert "\r" not in err
    steps = [x for x in err.splitlines() if x.startswith("draftsmith train: step ")]
    assert [x.split(":")[1] for x in steps] == [" step 2/6", " step 4/6", " step 6/6"]
    assert "loss " in steps[0] and "accept " in steps[0]


def test_the_demo_keeps_a_drafter_whose_data_path_is_spelled_otherwise(tmp_path, monkeypatch):
    """The demo compared the recorded data path as a string: `runs/demo` then an absolute
    `--out` retrained a drafter whose every setting was the same."""
    from dataclasses import asdict

    from draftsmith.demo import stale_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "data").mkdir(parents=True)
    before = TrainConfig(out="d/drafter", data="d/data", lr=3e-4)
    (tmp_path / "d" / "draftsmith.json").write_text(json.dumps(
        {"training": {"config": asdict(before)}}, default=str))
    again = TrainConfig(out=str(tmp_path / "d" / "drafter"), data=str(tmp_path / "d" / "data"),
                        lr=3e-4)
    assert stale_settings(tmp_path / "d", again) == []
    assert stale_settings(tmp_path / "d", TrainConfig(out="x", data="other", lr=3e-4)) == [
        "data"]
