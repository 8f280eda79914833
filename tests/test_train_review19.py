"""Training review 19: a first SIGTERM (a scheduler's time limit, `timeout`, a pod's end) stops a
single-process run after the step in flight at a checkpoint, exit 143, as a first ctrl-C does;
a second stop request aborts at once; an ignored SIGTERM stays ignored; DDP is left alone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_crash_resume import ENV, TRAIN, cli
from test_train_review5 import config
from test_train_review6 import quiet_train
from test_train_review9 import _children

from draftsmith.models.eagle3 import load_drafter
from draftsmith.train import TrainConfig, train
from draftsmith.train.checkpoint import checkpoint_dir, list_checkpoints
from draftsmith.train.loop import Interrupt, Trainer
from draftsmith.train.report import read_log

NOTE = ("draftsmith train: SIGTERM: stopping after this step with a checkpoint (a second "
        "SIGTERM aborts at once)")
STOPPED = re.compile(r"draftsmith train: terminated \(SIGTERM\) at step (\d+) of (\d+): "
                     r"checkpoint written to (\S+); the same command with --resume continues")
# test_crash_resume's run, long enough (10 ms a step) that a SIGTERM after its step 1 lands
# well before its end, with no checkpoint before it: what a SIGTERM used to lose
RUN = {**TRAIN, "max_steps": 40, "save_every": 100}


def train_cli(root: Path, out: str, *more: object, **over: object) -> list[object]:
    """`over`: RUN's settings replaced (the CLI refuses an option given twice)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**RUN, **over}.items()]
    return ["train", "--data", root / "data", "--target", root / "target", "--out", root / out,
            "--device", "cpu", "--no-progress", *flags, *more]


def same_run(a: Path, b: Path) -> None:
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
    rows = [[{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_log(x)]
            for x in (a, b)]
    assert rows[0] == rows[1] and len(rows[0]) == RUN["max_steps"]


@pytest.fixture(scope="module")
def trained(train_root) -> Path:
    """test_crash_resume's layout (data/, target/) and its uninterrupted run in `whole`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(TrainConfig(out=str(train_root / "whole"), data=str(train_root / "data"),
                          target=str(train_root / "target"), progress=False, **RUN))
    return train_root


def terminated(args: list[object], group: bool, timeout: float = 180) -> tuple[int, str]:
    """`python -m draftsmith ARGS` sent SIGTERM once it logs step 1 (to its whole process group,
    loader workers too, as `timeout` and SLURM send it, where `group`): its code and stderr."""
    p = subprocess.Popen([sys.executable, "-m", "draftsmith", *map(str, args)], env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    lines: list[str] = []
    try:
        for line in p.stderr:
            lines.append(line)
            if line.startswith("draftsmith train: step 1/"):
                (os.killpg if group else os.kill)(p.pid, signal.SIGTERM)
        return p.wait(), "".join(lines)
    finally:
        timer.cancel()
        p.kill()
        p.wait()
        p.stderr.close()


@pytest.mark.slow  # two runs started as processes: > 5 s on 2 cores
@pytest.mark.parametrize("group, workers", [(False, 0), (True, 2)])
def test_a_sigterm_stops_at_a_checkpoint_exits_143_and_resume_equals_the_straight_run(
        trained, group, workers):
    """SIGTERM killed the run at once, losing up to --save-every steps; now the step in flight
    ends, a checkpoint is written at it, one line names it and --resume, the exit code is 143,
    and --resume ends with the uninterrupted run's weights and log rows, bit for bit."""
    out = trained / f"term-{workers}"
    code, err = terminated(train_cli(trained, out.name, loader_workers=workers), group)
    assert code == 143 and "Traceback" not in err, err[-3000:]
    assert err.count(NOTE) == 1, err[-3000:]  # said by the trainer, not its loader workers
    ((step, total, where),) = STOPPED.findall(err)
    step = int(step)
    assert 1 <= step < int(total) == RUN["max_steps"] and where == str(checkpoint_dir(out, step))
    assert list_checkpoints(out) == [checkpoint_dir(out, step)]
    r = cli(*train_cli(trained, out.name, "--resume"))
    assert r.returncode == 0, r.stderr[-2000:]
    same_run(trained / "whole", out)


class Killed(Exception):
    """What the SIGTERM handler before the run's does here (the default would end pytest)."""


@pytest.fixture()
def sigterm_raises():
    def kill(signum, frame):
        raise Killed

    before = signal.signal(signal.SIGTERM, kill)
    yield kill
    signal.signal(signal.SIGTERM, before)


def signals_after(monkeypatch, step: int, *sigs: signal.Signals) -> list[int]:
    """Trainer.train_step spied on: after step `step` completes, `sigs` are raised in turn."""
    calls, real = [], Trainer.train_step

    def spy(self):
        real(self)
        calls.append(1)
        if len(calls) == step:
            for sig in sigs:
                signal.raise_signal(sig)

    monkeypatch.setattr(Trainer, "train_step", spy)
    return calls


def test_a_first_sigterm_in_process_is_a_system_exit_143_with_handlers_put_back(
        train_root, monkeypatch, capfd, sigterm_raises):
    before = signal.getsignal(signal.SIGINT)
    signals_after(monkeypatch, 3, signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        quiet_train(config(train_root, "once"))
    assert e.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises
    assert signal.getsignal(signal.SIGINT) is before
    assert [p.name for p in list_checkpoints(train_root / "once")] == ["step-00000003"]
    err = capfd.readouterr().err
    assert NOTE in err and STOPPED.findall(err) == [
        ("3", "6", str(checkpoint_dir(train_root / "once", 3)))]


def test_loader_workers_outlive_a_groups_sigterm(train_root, monkeypatch, sigterm_raises):
    """`timeout` and SLURM signal the whole process group: a loader worker that died of it
    (torch's worker loop sets a SIGTERM handler that dies unless its parent sent it) failed
    the step before the checkpoint ("DataLoader worker ... is killed by signal: Terminated")."""
    real = Trainer.train_step

    def spy(self):
        real(self)
        if self.step == 1:  # the step in flight is the second
            # from another process: torch's worker handler exits quietly on its parent's
            subprocess.run(["kill", "-TERM", *map(str, _children())], check=True)
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.3)  # a dead worker's SIGCHLD lands in the step

    monkeypatch.setattr(Trainer, "train_step", spy)
    with pytest.raises(SystemExit) as e:
        quiet_train(config(train_root, "workers", loader_workers=2))
    assert e.value.code == 143
    assert [p.name for p in list_checkpoints(train_root / "workers")] == ["step-00000002"]


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_sigterm_or_a_ctrl_c_after_one_aborts_at_once(train_root, monkeypatch, capfd,
                                                               sigterm_raises, second):
    """After a first SIGTERM the handlers before the run's are back: a second SIGTERM runs the
    process's own (the default ends it at once), a ctrl-C aborts as a second ctrl-C does."""
    out = f"twice-{second.name}"
    signals_after(monkeypatch, 2, signal.SIGTERM, second)
    with pytest.raises(Killed if second == signal.SIGTERM else KeyboardInterrupt):
        quiet_train(config(train_root, out))
    assert list_checkpoints(train_root / out) == []
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises
    if second == signal.SIGINT:
        assert ("draftsmith train: aborted after 1 of 6 steps: no checkpoint written yet; the "
                "same command starts over") in capfd.readouterr().err


def test_an_ignored_sigterm_stays_ignored(train_root, monkeypatch):
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        calls = signals_after(monkeypatch, 2, signal.SIGTERM)
        quiet_train(config(train_root, "ignored"))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
    assert len(calls) == 6 and (train_root / "ignored" / "draftsmith.json").is_file()


def test_under_ddp_or_off_the_main_thread_sigterm_is_left_as_it_is(sigterm_raises):
    """Under torchrun a SIGTERM is torchrun ending the workers after one failed: a checkpoint
    would need collectives that cannot complete, so the run still ends at once there."""
    with Interrupt(False):
        assert signal.getsignal(signal.SIGTERM) is sigterm_raises
    seen = []
    worker = threading.Thread(target=lambda: seen.append(Interrupt(True).__enter__().active))
    worker.start()
    worker.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) is sigterm_raises
