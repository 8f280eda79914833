"""Training internals: online states of a partly windowed target, the --out lock where the file
system has no flock, old checkpoints that cannot be removed, RNG states of other hosts, and the
shard reader against odd shards."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.batches import TokenSource, collate, pack, run_target


def test_online_states_of_a_target_windowing_some_layers_past_the_window(tmp_path):
    """run_target passed the window to one mask for every layer: the model refused the packed
    forward once a row outran the window (mid-run). Each document now gets what it gets alone,
    full-attention layers seeing past the window."""
    from draftsmith.models.config import ModelConfig
    from draftsmith.models.llama import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=4,
                      window_layers=[3, 4, 5])
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * 0.2)
    seqs = [([1, 5, 9, 30, 44, 7, 12, 13], [0, 0, 1, 1, 1, 1, 1, 1]),
            ([3, 8, 8, 20, 21, 22], [0, 1, 1, 1, 1, 1]), ([4, 4, 60], [0, 1, 1])]
    src = TokenSource(seqs)
    rows = pack([0, 1, 2], src.lengths(), 14)
    assert rows == [[(0, 8), (1, 6)], [(2, 3)]]
    batch = run_target(model, collate(src, rows, multiple=4, cap=14), (0, 3, 5))
    assert batch.aux.shape[:2] == (2, 14) and batch.aux.dtype == torch.bfloat16
    with torch.no_grad():
        for r, row in enumerate(rows):
            at = 0
            for i, n in row:
                fo = model(torch.tensor([seqs[i][0]]), torch.arange(n)[None], aux_ids=(0, 3, 5),
                           want_logits=False)
                for got, want in ((batch.aux, fo.aux), (batch.hidden, fo.hidden)):
                    assert torch.allclose(got[r, at : at + n].float(), want[0], atol=1e-5,
                                          rtol=2**-8)
                at += n
    assert not batch.hidden[1, 3:].any()  # padding stays zero


def test_documents_are_grouped_within_the_packed_batchs_size():
    from draftsmith.train.batches import _groups, _spans

    doc = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, 3, 3]])
    spans = _spans(doc)
    assert spans == [(0, 0, 3), (0, 3, 2), (1, 0, 4), (1, 4, 2)]
    groups = _groups(spans, 8)
    assert groups == [[(1, 0, 4), (0, 0, 3)], [(0, 3, 2), (1, 4, 2)]]
    assert all(len(g) * g[0][2] <= 8 for g in groups)


def no_flock(monkeypatch):
    def refuse(fd, op):
        raise OSError(9, "Bad file descriptor")  # NFS: no exclusive flock on a folder

    monkeypatch.setattr(ckpt.fcntl, "flock", refuse)


def test_out_without_flock_is_held_by_a_lock_file(tmp_path, monkeypatch):
    """Where flock failed (NFS), the lock was skipped: two runs wrote into one --out."""
    no_flock(monkeypatch)
    first = ckpt.lock_out(tmp_path)
    held = json.loads((tmp_path / ckpt.LOCK_FILE).read_text())
    assert held["pid"] > 0 and held["host"] == socket.gethostname()
    with pytest.raises(DraftsmithError, match="another `draftsmith train` .* is writing into "
                       "it, says .*draftsmith-train.lock"):
        ckpt.lock_out(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.LOCK_FILE]  # no tmp names left
    first.release()
    assert not (tmp_path / ckpt.LOCK_FILE).exists()
    ckpt.lock_out(tmp_path).release()


def test_a_lock_file_of_a_dead_run_on_this_host_is_taken_over(tmp_path, monkeypatch):
    no_flock(monkeypatch)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = {"host": socket.gethostname(), "pid": int(child.stdout), "started": 1,
            "since": "then"}
    (tmp_path / ckpt.LOCK_FILE).write_text(json.dumps(dead))
    lock = ckpt.lock_out(tmp_path)
    assert json.loads((tmp_path / ckpt.LOCK_FILE).read_text()) == lock.holder
    lock.release()
    # a pid in use again, by another process than the one that took the lock
    reused = dict(dead, pid=lock.holder["pid"], started=lock.holder["started"] + 1)
    (tmp_path / ckpt.LOCK_FILE).write_text(json.dumps(reused))
    ckpt.lock_out(tmp_path).release()
    assert not (tmp_path / ckpt.LOCK_FILE).exists()


def test_a_lock_file_of_another_host_is_refused_naming_it(tmp_path, monkeypatch):
    no_flock(monkeypatch)
    other = {"host": "node-7", "pid": 4242, "started": 1, "since": "2026-01-01 10:00:00"}
    (tmp_path / ckpt.LOCK_FILE).write_text(json.dumps(other))
    with pytest.raises(DraftsmithError, match="host node-7, pid 4242.*delete that file"):
        ckpt.lock_out(tmp_path)
    assert json.loads((tmp_path / ckpt.LOCK_FILE).read_text()) == other


def test_a_held_flock_is_refused_and_released(tmp_path):
    lock = ckpt.lock_out(tmp_path)
    assert lock.fd in ckpt.FLOCKS
    with pytest.raises(DraftsmithError, match="another `draftsmith train` is writing"):
        ckpt.lock_out(tmp_path)
    lock.release()
    assert ckpt.FLOCKS == []
    ckpt.lock_out(tmp_path).release()


def tiny_drafter() -> Eagle3Drafter:
    cfg = Eagle3Config(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                       head_dim=8, target_hidden_size=16, vocab_size=40, draft_vocab_size=40,
                       aux_layer_ids=[0, 1, 2])
    return Eagle3Drafter(cfg)


def test_an_old_checkpoint_that_cannot_go_is_a_warning(tmp_path, monkeypatch):
    """A permission error removing an older checkpoint was a traceback on rank 0 alone (the
    other ranks left waiting); now a warning naming it, and the run goes on."""
    drafter, state = tiny_drafter(), {"step": 1}
    ckpt.save_checkpoint(tmp_path, 1, drafter, state, {}, keep_last=1)
    real = ckpt.shutil.rmtree

    def refuse(path, *a, **k):
        if str(path).endswith("step-00000001"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(ckpt.shutil, "rmtree", refuse)
    with pytest.warns(UserWarning, match=r"could not remove older checkpoint\(s\) .*"
                      r"step-00000001 \(Permission denied\)"):
        final = ckpt.save_checkpoint(tmp_path, 2, drafter, {"step": 2}, {}, keep_last=1)
    # the folder left is no checkpoint a --resume would take
    assert ckpt.list_checkpoints(tmp_path) == [final]


def test_cuda_rng_states_of_a_host_with_more_gpus_restore_what_is_here(monkeypatch):
    """A checkpoint of an 8-GPU host resumed on one GPU: set_rng_state_all was an IndexError."""
    import torch.cuda.random as cuda_random

    got = []

    def set_state(state, device=0):
        if device >= 1:
            raise IndexError("tuple index out of range")
        got.append((device, state))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(cuda_random, "set_rng_state", set_state)
    state = {"torch": torch.get_rng_state(), "python": __import__("random").getstate(),
             "cuda": [torch.tensor([k]) for k in range(8)]}
    ckpt.set_rng_state(state)
    assert got == [(0, state["cuda"][0])]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    from test_train_helpers import tiny_target, write_dataset

    root = tmp_path_factory.mktemp("reader")
    target = tiny_target(root / "t")
    return target, write_dataset(root / "d", target, n=8, per_shard=4)


def test_reads_that_come_back_short_are_continued(small_data, monkeypatch):
    """One pread a slice: a read the kernel cut short (2 GiB on Linux, less on network file
    systems) was called a truncated shard."""
    from draftsmith.data.shards import Dataset
    from draftsmith.train import reader as rd

    ds = Dataset(small_data[1])
    want = [ds[i] for i in range(len(ds))]
    real_pread, real_preadv = rd.os.pread, rd.os.preadv
    monkeypatch.setattr(rd.os, "pread", lambda fd, n, at: real_pread(fd, min(n, 4096), at))

    def preadv(fd, bufs, at):
        return real_preadv(fd, [memoryview(bufs[0])[:4096]], at)

    monkeypatch.setattr(rd.os, "preadv", preadv)
    reader = rd.ShardReader(ds)
    for i, w in enumerate(want):
        got = reader[i]
        assert all(torch.equal(got[k], w[k]) for k in w), i
    assert want[0]["aux"].numel() * 2 > 4096  # the slices did need several reads


@pytest.mark.parametrize("change", ["drop", "rows"])
def test_a_shard_without_a_tensor_or_of_other_rows_is_named_at_open(small_data, tmp_path,
                                                                     change):
    """A shard lacking loss_mask was a KeyError traceback in a loader worker (the first batch
    reading it); one whose hidden rows fall short, a "truncated" shard there."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from draftsmith.train.sources import open_offline

    target, data = small_data
    copy = shutil.copytree(data, tmp_path / "d")
    shard = copy / "shard-00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(shard)
    if change == "drop":
        del tensors["loss_mask"]
    else:
        tensors["hidden"] = tensors["hidden"][:-1].clone()
    save_file(tensors, shard, metadata=meta)
    n = tensors["input_ids"].numel()
    said = "no loss_mask tensor" if change == "drop" else rf"tensors of \[{n - 1}, {n}\] tokens"
    with pytest.raises(DraftsmithError, match=f"shard-00001.safetensors: holds {said}"):
        open_offline(copy, target, None)


def test_an_unforeseen_error_on_one_rank_is_shared_not_a_hang(monkeypatch):
    """Only a DraftsmithError was shared: another (an OSError rank 0 alone met) left the other
    ranks waiting at their next collective. Rank 1 of 2 here, then rank 0 hearing of it."""
    from draftsmith.train import dist as tdist

    gathered = []

    def gather(said, mine):
        gathered.append(mine)
        said[:] = [None, mine] if mine is not None else [None, "rank 1 failed (OSError: gone)"]

    monkeypatch.setattr(tdist.dist, "all_gather_object", gather)
    monkeypatch.setattr(tdist.dist, "get_rank", lambda: 1)
    with pytest.raises(OSError, match="gone"), tdist.shared_failure(2):
        raise OSError("gone")
    assert gathered == ["rank 1 failed (OSError: gone); its log says more"]
    rank_0 = tdist.shared_failure(2)  # its own block goes well
    with pytest.raises(DraftsmithError, match=r"rank 1 failed \(OSError: gone\)"), rank_0:
        pass


def test_a_profile_that_cannot_be_written_is_a_warning(tmp_path):
    """An --out it could not write into (here a file) was a traceback ending the run."""
    from draftsmith.train.profile import StepProfiler

    (tmp_path / "file").write_text("")
    prof = StepProfiler(tmp_path / "file", torch.device("cpu"), steps=1, warmup=0)
    prof.begin()
    prof.mark("batch")
    with pytest.warns(UserWarning, match="profile.json and profile.txt not written"):
        prof.end()
    assert prof.done


@pytest.mark.parametrize("ids", [None, [0, 1, 9]])
def test_a_manifest_without_usable_aux_layer_ids_is_named(small_data, tmp_path, ids):
    """A manifest lacking aux_layer_ids (an external tool's) was a KeyError traceback; ids past
    the target's layers an error that named no dataset."""
    import shutil

    from draftsmith.train.sources import open_offline

    target, data = small_data
    copy = shutil.copytree(data, tmp_path / "d")
    m = json.loads((copy / "manifest.json").read_text())
    m.pop("aux_layer_ids")
    if ids is not None:
        m["aux_layer_ids"] = ids
    (copy / "manifest.json").write_text(json.dumps(m))
    said = "the manifest's aux_layer_ids is None" if ids is None else r"aux layer ids \[9\]"
    with pytest.raises(DraftsmithError, match=f"{copy}: {said}"):
        open_offline(copy, target, None)


def test_a_copied_checkpoint_folder_beside_them_is_not_one(tmp_path):
    """`step-00000001.bak` (a user's copy) made list_checkpoints a ValueError traceback."""
    ckpt.save_checkpoint(tmp_path, 1, tiny_drafter(), {"step": 1}, {}, keep_last=0)
    ckpt.shutil.copytree(ckpt.checkpoint_dir(tmp_path, 1), tmp_path / "checkpoints" / "step-1.bak")
    assert ckpt.list_checkpoints(tmp_path) == [ckpt.checkpoint_dir(tmp_path, 1)]
