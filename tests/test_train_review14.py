"""Training review 14: the rows an epoch drops across ranks, a rank failing before the loop
under DDP, shards checked against their manifest's sha256 at start and on --resume."""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from test_train_review3 import config
from test_train_review6 import quiet_train
from test_train_review7 import run_rank, two_ranks

from draftsmith.data.shards import read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.train import TrainConfig
from draftsmith.train.batches import Plan, pack


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def epoch_rows(plan_of, world: int, e: int) -> list[list[int]]:
    """Each rank's samples of epoch `e`."""
    out = []
    for r in range(world):
        plan = plan_of(r)
        first = sum(plan.steps_per_epoch(k) for k in range(e))
        out.append([i for s in range(first, first + plan.steps_per_epoch(e))
                    for row in plan.rows(s)[2] for i, _ in row])
    return out


def test_an_epoch_under_ddp_drops_less_than_one_step_of_rows():
    """Each rank packed its own share and every rank stopped at the fewest rows: 8 ranks of 4
    rows dropped 7.9%, 6.6% and 10.9% of the tokens in three epochs; now the epoch is packed
    once and dealt out, dropping fewer rows than one step of all ranks (3.2%, 0.4%, 1.2%)."""
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(6.3, 0.8)) + 20 for _ in range(2000)]
    world, b, max_len = 8, 4, 2048
    total = sum(min(n, max_len) for n in lengths)
    for e in range(3):
        ranks = epoch_rows(lambda r: Plan(lengths, b, max_len, world, r, 0), world, e)
        flat = [i for r in ranks for i in r]
        assert len(flat) == len(set(flat))
        g = torch.Generator().manual_seed(e)  # the plan's order of seed 0
        perm = torch.randperm(len(lengths), generator=g).tolist()
        dropped = [i for i in perm if i not in set(flat)]
        assert dropped == perm[len(perm) - len(dropped):]  # the permutation's tail
        share = sum(min(lengths[i], max_len) for i in dropped) / total
        assert len(pack(dropped, lengths, max_len)) < world * b, (e, share)
        assert share < 0.035, (e, share)
    # every rank takes the same steps (DDP would wait at the extra ones)
    assert len({Plan(lengths, b, max_len, world, r, 0).steps_per_epoch(1)
                for r in range(world)}) == 1


def test_the_dropped_samples_differ_by_epoch_and_one_process_keeps_its_order():
    rng = random.Random(1)
    lengths = [rng.randrange(10, 200) for _ in range(301)]
    dropped = []
    for e in range(3):
        flat = {i for r in epoch_rows(lambda r: Plan(lengths, 3, 256, 4, r, 5), 4, e) for i in r}
        dropped.append(set(range(len(lengths))) - flat)
    assert dropped[0] != dropped[1] != dropped[2]
    # one process: the order packs as before (a resumed single-process run is unchanged)
    one = Plan(lengths, 3, 256, 1, 0, 5)
    g = torch.Generator().manual_seed(5 * 100_003)
    want = pack(torch.randperm(len(lengths), generator=g).tolist(), lengths, 256)
    assert [one.rows(s)[2] for s in range(one.steps_per_epoch(0))] == \
        [want[s * 3:(s + 1) * 3] for s in range(len(want) // 3)]


def test_a_ddp_checkpoint_of_the_per_rank_packing_resumes_in_its_order():
    """A checkpoint written before this packing (2 ranks, no `packing` recorded) goes on in the
    order it began: the new order would train some samples twice in that epoch."""
    from draftsmith.train.loop import packing_of

    lengths = [20 + (i * 37) % 90 for i in range(80)]
    assert packing_of({"world": 2}) == "per_rank" and packing_of(None) == "global"
    assert packing_of({"world": 1}) == "global"
    assert packing_of({"world": 2, "packing": "global"}) == "global"
    old = Plan(lengths, 2, 128, 2, 1, 3, packing="per_rank")
    g = torch.Generator().manual_seed(3 * 100_003)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    assert old.rows(0)[2] == pack(perm[1::2], lengths, 128)[:2]


def _init_fails_on_rank_1(rank: int, world: int, port: int, cfg: TrainConfig, dump: str) -> None:
    from draftsmith.train import loop

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if rank == 1:  # this rank's copy of the data unreadable (another node's disk)
        def unreadable(*args, **kwargs):
            raise DraftsmithError("shard-00000.safetensors: cannot open the shard (I/O error)")

        loop.open_offline = unreadable  # type: ignore[assignment]
    run_rank(cfg, dump, rank)


def test_a_rank_failing_before_the_loop_under_ddp_stops_every_rank_with_its_error(root,
                                                                                  tmp_path):
    """Rank 1 failing in Trainer.__init__ raised there alone: rank 0 went on into DDP's first
    broadcast and failed on the closed connection (or waited), never naming the cause."""
    cfg = config(root, "ddp-init", max_steps=2, batch_size=1)
    said = two_ranks(_init_fails_on_rank_1, (cfg, str(tmp_path)), tmp_path, 30)
    assert said[0] == said[1] == "shard-00000.safetensors: cannot open the shard (I/O error)", \
        said
    assert not (root / "ddp-init").exists()


def corrupt(path: Path) -> None:
    """The shard's last bytes (hidden states) changed in place: its size and header as they
    were."""
    raw = bytearray(path.read_bytes())
    raw[-64:] = bytes(255 - x for x in raw[-64:])
    path.write_bytes(bytes(raw))


def test_a_shard_corrupted_after_capture_is_refused_at_start_naming_it(root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    shard = data / read_manifest(data)["shards"][1]["file"]
    corrupt(shard)
    with pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, str(tmp_path / "out"), data=str(data)))
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"{shard}: sha256 ") and \
        "does not match the manifest's" in said, said
    assert not (tmp_path / "out").exists()
    # a shard past --max-samples is not trained on: not read, not refused
    quiet_train(config(root, str(tmp_path / "head"), data=str(data), max_samples=8,
                       max_steps=1))
    # --no-verify-shards: a dataset too large to read once more at every start is not hashed
    quiet_train(config(root, str(tmp_path / "unchecked"), data=str(data), max_steps=1,
                       verify_shards=False))


def test_a_shard_changed_between_a_checkpoint_and_its_resume_is_refused(root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    out = str(tmp_path / "out")
    quiet_train(config(root, out, data=str(data), time_limit=0.0))
    shard = data / read_manifest(data)["shards"][2]["file"]
    corrupt(shard)
    with pytest.raises(DraftsmithError, match=rf"^{shard}: sha256 .* does not match the "
                       "manifest's"):
        quiet_train(config(root, out, data=str(data), resume=True))


def test_a_resume_hashes_only_the_shards_changed_on_disk_since_its_checkpoint(root, tmp_path,
                                                                             monkeypatch):
    from draftsmith.train import reader

    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    out = str(tmp_path / "out")
    hashed: list[str] = []
    real = reader.sha256_fd

    def counted(fd: int, path: Path) -> str:
        hashed.append(Path(path).name)
        return real(fd, path)

    monkeypatch.setattr(reader, "sha256_fd", counted)
    quiet_train(config(root, out, data=str(data), time_limit=0.0))
    files = [s["file"] for s in read_manifest(data)["shards"]]
    assert sorted(hashed) == sorted(files)  # the start hashes every shard once
    hashed.clear()
    shard = data / files[0]
    shard.write_bytes(shard.read_bytes())  # the same bytes written again: another mtime
    quiet_train(config(root, out, data=str(data), resume=True))
    assert hashed == [files[0]]


def test_a_check_of_more_than_a_gib_says_so_first(root):
    """Hashing reads the shards once: a long silent pause before the first step otherwise."""
    from draftsmith.data.shards import Dataset
    from draftsmith.train.reader import ShardReader

    ds = Dataset(root / "data")
    ds.shards = [{**s, "bytes": 1 << 29} for s in ds.shards]
    reader = ShardReader(ds)
    said: list[str] = []
    stamps = reader.check_hashes(len(ds), {}, (0, 1), said.append)
    assert said == [f"checking 3 shard(s) of {root / 'data'} (1.5 GiB) against the manifest's "
                    "sha256 (once a run: --resume checks only those changed on disk since)"]
    said.clear()
    assert reader.check_hashes(len(ds), stamps, (0, 1), said.append) == stamps and not said
    # split over a host's ranks: rank 1 of 2 hashes every other shard
    assert reader.check_hashes(len(ds), {}, (1, 2)) == stamps
