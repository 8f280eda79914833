"""Training review 7: --resume on re-captured data, the final drafter's durability, a rank-0
failure under DDP stopping every rank."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_drafter import random_drafter, tiny_cfg
from test_train_loop import _free_port
from test_train_review3 import config
from test_train_review6 import quiet_train

from draftsmith.data.shards import Dataset, Sample, ShardWriter
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import CONFIG_FILE, WEIGHTS_FILE, load_drafter, save_drafter
from draftsmith.train import TrainConfig
from draftsmith.train.checkpoint import STATE, latest_checkpoint
from draftsmith.train.loop import Trainer


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def recapture(src: Path, dst: Path, scale: float, shards: int | None = None) -> None:
    """`src`'s samples (of its first `shards` shards) written to `dst` as a capture again: the
    same ids, loss masks and lengths, the aux states scaled (a capture at another dtype or of
    other layers' states)."""
    ds = Dataset(src)
    samples = [Sample(ds.sample_id(i), *ds.tokens(i), ds[i]["aux"].float() * scale,
                      ds[i]["hidden"].float()) for i in range(len(ds))]
    header = {k: ds.manifest[k] for k in ("target", "aux_layer_ids", "aux_convention",
                                           "hidden_size", "vocab_size")}
    shutil.rmtree(dst, ignore_errors=True)
    writer = ShardWriter(dst, header, ("target", "aux_layer_ids"))
    for k, s in enumerate(ds.shards[:shards]):
        start = sum(int(x["samples"]) for x in ds.shards[:k])
        writer.write(k, samples[start : start + int(s["samples"])])
    writer.finish()


def test_resume_on_a_dataset_captured_again_with_other_states_is_refused(root, tmp_path):
    """The same tokens and lengths with other hidden states resumed silently: only counts and
    lengths were compared. The manifest's shard sha256s are compared now."""
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    quiet_train(config(root, "recaptured", data=str(data), time_limit=0.0))
    recapture(root / "data", data, 2.0)
    with pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, "recaptured", data=str(data), resume=True))
    said = str(e.value)
    assert "\n" not in said and "the data changed since that run: the same 24 samples in the " \
        "same lengths, but other contents" in said, said
    recapture(root / "data", data, 1.0)  # the capture it trained on, bytes and all
    quiet_train(config(root, "recaptured", data=str(data), resume=True))
    assert (root / "recaptured" / WEIGHTS_FILE).is_file()


def test_a_checkpoint_without_the_data_contents_resumes_and_says_so(root, capfd):
    quiet_train(config(root, "older-data", time_limit=0.0))
    path = latest_checkpoint(root / "older-data") / STATE
    state = torch.load(path, weights_only=False)
    del state["data"]["content"]
    torch.save(state, path)
    capfd.readouterr()
    quiet_train(config(root, "older-data", resume=True))
    said = [x for x in capfd.readouterr().err.splitlines() if "does not record the data" in x]
    assert len(said) == 1 and "only its sample count and lengths were compared" in said[0], said


def test_max_samples_of_a_grown_dataset_resumes_on_the_shards_it_used(root, tmp_path):
    """--max-samples 8 reads the first shard only: shards added since change nothing it
    trains on, so the run resumes (only the shards it reads are compared)."""
    data = tmp_path / "grown"
    recapture(root / "data", data, 1.0, shards=2)
    quiet_train(config(root, "head", data=str(data), max_samples=8, time_limit=0.0))
    recapture(root / "data", data, 1.0)  # grown to three shards
    quiet_train(config(root, "head", data=str(data), max_samples=8, resume=True))
    assert (root / "head" / WEIGHTS_FILE).is_file()


def test_online_resume_on_other_tokens_of_the_same_lengths_is_refused(root, tmp_path):
    import json

    def write(answer: str) -> Path:
        path = tmp_path / "convs.jsonl"
        rows = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answer}]
                for i in range(6)]
        path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
        return path

    over = dict(data=None, prompts=str(write("abcabcabc")), max_len=64, max_steps=3)
    quiet_train(config(root, "online-ids", time_limit=0.0, **over))
    write("xyzxyzxyz")  # one character a token: the same lengths
    with pytest.raises(DraftsmithError, match="same 6 samples in the same lengths, but other "
                       r"contents \(other token ids\)"):
        quiet_train(config(root, "online-ids", resume=True, **over))


def test_save_drafter_syncs_each_file_before_its_rename_and_the_rename(tmp_path, monkeypatch):
    """A host crash after save_drafter (the final drafter, each checkpoint's model) could leave
    empty or torn files under their final names: nothing was fsynced."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b) -> None:
        events.append(("replace", str(b)))
        events.append(("from", str(a)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    folder = tmp_path / "d"
    save_drafter(random_drafter(tiny_cfg()), folder)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        at = events.index(("replace", str(folder / name)))
        tmp = events[at + 1][1]
        assert ("fsync", tmp) in events[:at], (name, events)
        assert events[at + 2] == ("fsync", str(folder)), (name, events)
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    load_drafter(folder)


def _failing_worker(rank: int, world: int, port: int, cfg: TrainConfig, dump: str,
                    where: str) -> None:
    from draftsmith.train import checkpoint

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if where == "out":  # a read-only parent: root may write anywhere, so mkdir is refused here
        real = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self == Path(cfg.out):
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *args, **kwargs)

        Path.mkdir = mkdir  # type: ignore[method-assign]
    else:  # a full disk while rank 0 writes a checkpoint's model

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        checkpoint.save_drafter = full  # type: ignore[assignment]
    run_rank(cfg, dump, rank)


def two_ranks(worker, args: tuple, dump: Path, limit_s: float) -> list[str]:
    """worker(rank, 2, port, *args) forked as two ranks; what each wrote (`run_rank`), once
    both ended within `limit_s` (one still running then is a hang: killed, and the test fails)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(2, _free_port(), *args), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=0.2) and time.monotonic() < deadline:
        pass
    hung = [p.pid for p in ctx.processes if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks hung: {hung}"
    return [(dump / f"rank{r}.txt").read_text() for r in range(2)]


def run_rank(cfg: TrainConfig, dump: str, rank: int) -> None:
    """Train as this rank, then write what it ended with to dump/rank{rank}.txt: "finished",
    the DraftsmithError's line, or another error's type and text."""
    from draftsmith.train.dist import setup as dist_setup

    ctx = dist_setup("cpu")
    try:
        Trainer(cfg, ctx).run()
        said = "finished"
    except Exception as e:  # noqa: BLE001 - any other error is a different line: compared
        said = str(e) if isinstance(e, DraftsmithError) else f"{type(e).__name__}: {e}"
    finally:
        ctx.close()
    Path(dump, f"rank{rank}.txt").write_text(said)


@pytest.mark.parametrize("where", ["out", "checkpoint"])
def test_a_rank_0_failure_under_ddp_stops_every_rank_with_its_error(root, tmp_path, where):
    """Rank 0 failing to make --out (or to write a checkpoint) raised there alone; the other
    rank waited at the next collective for good."""
    cfg = config(root, f"ddp-{where}", max_steps=2, batch_size=1, save_every=1)
    said = two_ranks(_failing_worker, (cfg, str(tmp_path), where), tmp_path, 40)
    assert said[0] == said[1] and "\n" not in said[0], said
    what = "cannot create the folder" if where == "out" else "No space left on device"
    assert what in said[0], said


def test_max_samples_counts_the_draft_vocab_without_reading_hidden_states(root, target,
                                                                         monkeypatch):
    """--max-samples read each counted sample whole, aux and hidden states and all (terabytes
    on a large target's dataset) to count its token ids; now ids and masks only."""
    from draftsmith.data.vocab import count_ids
    from draftsmith.train.reader import ShardReader
    from draftsmith.train.sources import open_offline

    def whole(self, i):
        raise AssertionError(f"sample {i} read with its states")

    monkeypatch.setattr(ShardReader, "__getitem__", whole)
    data = open_offline(root / "data", target, max_samples=11)
    ds = Dataset(root / "data")
    want = count_ids(((ids.tolist(), mask.tolist()) for ids, mask in map(ds.tokens, range(11))),
                     target.cfg.vocab_size)
    assert torch.equal(data.token_counts(target.cfg.vocab_size), want)
