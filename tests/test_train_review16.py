"""Training review 16: multi-rank training across hosts: each host's copy of the shards
hashed and a mismatch named by its rank; a loader error on one rank inside the loop stops
every rank with its error instead of leaving the others in a collective."""

from __future__ import annotations

import os
import shutil
import socket
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_train_review3 import config
from test_train_review7 import run_rank, two_ranks
from test_train_review14 import corrupt

from draftsmith.data.shards import read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.train import TrainConfig


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def _rank_env(rank: int, world: int, port: int, hosts: bool, local_world: bool = True) -> None:
    """torchrun's environment for `rank`; `hosts`: every rank alone on a host of its own (named
    host0, host1); not `local_world`: a launcher that sets no LOCAL_WORLD_SIZE (a SLURM
    script's RANK, WORLD_SIZE and LOCAL_RANK)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK="0" if hosts else str(rank),
                      LOCAL_WORLD_SIZE="1" if hosts else str(world))
    if not local_world:
        del os.environ["LOCAL_WORLD_SIZE"]
    if hosts:
        socket.gethostname = lambda: f"host{rank}"


def _other_host_copy(rank: int, world: int, port: int, cfg: TrainConfig, copy: str,
                     local_world: bool, dump: str) -> None:
    """Rank 1 on a second host, reading its own copy of the dataset (`copy`)."""
    _rank_env(rank, world, port, hosts=True, local_world=local_world)
    run_rank(replace(cfg, data=copy) if rank == 1 else cfg, dump, rank)


@pytest.mark.parametrize("local_world", [True, False])
def test_a_shard_corrupted_on_another_hosts_copy_stops_every_rank_naming_that_rank(
        root, tmp_path, local_world):
    """Each host hashes its own copy, split over its own ranks: without LOCAL_WORLD_SIZE the
    split was over every rank, so host1 hashed every other shard of its copy only."""
    copy = tmp_path / "data"
    shutil.copytree(root / "data", copy)
    shard = read_manifest(copy)["shards"][1]["file"]
    corrupt(copy / shard)
    cfg = config(root, str(tmp_path / "out"), max_steps=2, batch_size=1)
    said = two_ranks(_other_host_copy, (cfg, str(copy), local_world, str(tmp_path)), tmp_path,
                     30)
    assert said[0] == said[1], said
    assert said[0].startswith(f"rank 1 (host host1): {copy / shard}: sha256 "), said
    assert "\n" not in said[0]
    assert not (tmp_path / "out").exists()


def _loader_fails_on_rank_1(rank: int, world: int, port: int, cfg: TrainConfig,
                            dump: str) -> None:
    from draftsmith.train import loop

    _rank_env(rank, world, port, hosts=False)
    if rank == 1:  # its second batch unreadable (a worker's error, a shard gone bad)
        real = loop.batches

        def failing(*args, **kwargs):
            it = real(*args, **kwargs)

            class Failing:
                n = 0

                def __next__(self):
                    self.n += 1
                    if self.n == 2:
                        raise DraftsmithError("shard-00001.safetensors: shard read came back "
                                              "short")
                    return next(it)

                def close(self) -> None:
                    it.close()

            return Failing()

        loop.batches = failing  # type: ignore[assignment]
    run_rank(cfg, dump, rank)


def test_a_loader_error_on_one_rank_inside_the_loop_stops_every_rank_with_its_error(root,
                                                                                    tmp_path):
    cfg = config(root, str(tmp_path / "out"), max_steps=4, batch_size=1, log_every=10)
    said = two_ranks(_loader_fails_on_rank_1, (cfg, str(tmp_path)), tmp_path, 30)
    assert said[0] == said[1] == (f"rank 1 (host {socket.gethostname()}): "
                                  "shard-00001.safetensors: shard read came back short"), said


def _own_filesystem(rank: int, world: int, port: int, cfg: TrainConfig, dump: str) -> None:
    """Rank 1 on a second host: its copy of each shard another file (inode) than rank 0's;
    the shards it hashed written to dump/hashed{rank}.txt."""
    from draftsmith.train import reader

    _rank_env(rank, world, port, hosts=True)
    real_stamp, real_hash = reader._stamp, reader.sha256_fd
    hashed: list[str] = []

    def hashing(fd: int, path: Path) -> str:
        hashed.append(Path(path).name)
        return real_hash(fd, path)

    reader.sha256_fd = hashing  # type: ignore[assignment]
    if rank == 1:
        reader._stamp = lambda fd: (0, real_stamp(fd)[1] + 10**9, *real_stamp(fd)[2:])
    run_rank(cfg, dump, rank)
    Path(dump, f"hashed{rank}.txt").write_text(" ".join(sorted(hashed)))


def test_a_resume_on_several_hosts_hashes_no_hosts_unchanged_copy_again(root, tmp_path):
    """Checkpoints kept rank 0's stamps only: at a resume every other host hashed its whole
    copy again while rank 0's waited in a collective (a timeout on a large dataset)."""
    files = " ".join(sorted(s["file"] for s in read_manifest(root / "data")["shards"]))
    cfg = config(root, str(tmp_path / "out"), max_steps=4, batch_size=1, time_limit=0.0)
    said = two_ranks(_own_filesystem, (cfg, str(tmp_path)), tmp_path, 30)
    assert said == ["finished", "finished"]
    assert [(tmp_path / f"hashed{r}.txt").read_text() for r in range(2)] == [files, files]
    said = two_ranks(_own_filesystem, (replace(cfg, resume=True, time_limit=None), str(tmp_path)),
                     tmp_path, 30)
    assert said == ["finished", "finished"]
    assert [(tmp_path / f"hashed{r}.txt").read_text() for r in range(2)] == ["", ""]


def test_a_resume_on_another_number_of_ranks_is_refused_first_with_the_fix(root, tmp_path,
                                                                           monkeypatch):
    """Refused only after the shards were hashed, the target loaded and the drafter built, and
    saying only that the data order would change: now before any of that, naming the ranks
    to resume on."""
    from test_train_review6 import quiet_train

    from draftsmith.train import loop
    from draftsmith.train.checkpoint import STATE, latest_checkpoint

    out = tmp_path / "out"
    quiet_train(config(root, str(out), time_limit=0.0))
    found = latest_checkpoint(out)
    state = torch.load(found / STATE, weights_only=False)
    torch.save({**state, "world": 2}, found / STATE)  # a run of 2 ranks
    shutil.copy(found / "rng-0.pt", found / "rng-1.pt")

    def loading(*args, **kwargs):
        raise AssertionError("the target loaded before the refusal")

    monkeypatch.setattr(loop, "resolve_target", loading)
    with pytest.raises(DraftsmithError, match=rf"^--resume from {found}: that run had 2 "
                       r"rank\(s\), this one has 1: the data order would change; resume on 2 "
                       r"ranks \(torchrun: --nnodes x --nproc-per-node = 2\) or train into another "
                       "--out$"):
        quiet_train(config(root, str(out), resume=True))


def test_a_ranks_share_of_the_hashing_is_among_the_ranks_of_its_host():
    from draftsmith.train.dist import DistCtx

    cpu = torch.device("cpu")
    hosts = ("a", "b", "a", "b", "b")
    assert [DistCtx(r, 5, cpu, hosts=hosts).host_part() for r in range(5)] == \
        [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert DistCtx(1, 2, cpu).host_part() == (0, 1)  # hosts unknown: every rank hashes all


def _group_then_setup(rank: int, world: int, port: int, dump: str) -> None:
    """A process group this rank already runs as the other rank, then training's setup."""
    import torch.distributed as dist

    from draftsmith.train.dist import setup

    _rank_env(rank, world, port, hosts=False)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    os.environ["RANK"] = str(1 - rank)
    try:
        setup("cpu")
        said = "joined"
    except DraftsmithError as e:
        said = str(e)
    dist.destroy_process_group()
    Path(dump, f"rank{rank}.txt").write_text(said)


def test_training_refuses_a_process_group_of_another_rank_already_running():
    """setup skipped start_group where a group was running, so its rank, world and backend
    went unchecked (collectives then hang or mix up ranks)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        said = two_ranks(_group_then_setup, (d,), Path(d), 20)
    assert said[0].startswith("this process already runs a process group as rank 0 of 2 "
                              "(gloo); rank 1 of 2 on cpu needs gloo"), said
