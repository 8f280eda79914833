"""The target cache and the capture merge, reviewed: a DRAFTSMITH_CACHE that is a file, cannot
be written, is empty or names `~`; `data merge` into a folder a capture (or merge) holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import tiny_hf_model
from test_targets import _gguf_from_hf
from typer.testing import CliRunner

from draftsmith.data.capture import CaptureConfig, _Hold, capture
from draftsmith.data.cli import app
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import MANIFEST, Dataset
from draftsmith.errors import DraftsmithError
from draftsmith.targets import cache_dir, load_target


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    _gguf_from_hf(path, tiny_hf_model("llama"), "llama")
    return path


def test_a_cache_that_is_a_file_is_one_error_naming_it(gguf, tmp_path, monkeypatch):
    """DRAFTSMITH_CACHE at a file: a NotADirectoryError traceback from the conversion."""
    (cache := tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    with pytest.raises(DraftsmithError) as e:
        load_target(gguf)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"DRAFTSMITH_CACHE {cache}: is a file, not a folder" in msg
    assert "point DRAFTSMITH_CACHE at a folder you can write to" in msg
    assert cache.read_text() == "not a folder"


def read_only(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root: chmod does not keep it from writing
        folder.chmod(0o755)
        pytest.skip("chmod does not make a folder read-only for this user (root)")


@pytest.mark.parametrize("where", ["cache", "cache/targets"])
def test_a_read_only_cache_is_one_error_naming_it(gguf, tmp_path, monkeypatch, where):
    """A cache it cannot write to: a PermissionError traceback at the conversion."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    read_only(tmp_path / where)
    try:
        with pytest.raises(DraftsmithError) as e:
            load_target(gguf)
    finally:
        (tmp_path / where).chmod(0o755)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{gguf}: DRAFTSMITH_CACHE {cache}: cannot be written" in msg
    assert "point DRAFTSMITH_CACHE at a folder you can write to" in msg


def test_a_cache_refusing_writes_is_one_error_for_root_too(gguf, tmp_path, monkeypatch):
    """As a read-only mount refuses root, where chmod cannot: the scratch folder refused."""
    import tempfile

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied")

    cache = tmp_path / "cache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(DraftsmithError) as e:
        load_target(gguf)
    assert str(e.value) == (f"{gguf}: DRAFTSMITH_CACHE {cache}: cannot be written (Permission "
                            "denied); a GGUF is converted into it once: point DRAFTSMITH_CACHE "
                            "at a folder you can write to, or unset it for ~/.cache/draftsmith")


def test_a_cache_under_a_file_names_the_file(gguf, tmp_path, monkeypatch):
    (f := tmp_path / "f").write_text("")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(f / "cache"))
    with pytest.raises(DraftsmithError, match=f"cache: lies under the file {f};"):
        load_target(gguf)


def test_a_read_only_cache_holding_the_conversion_still_loads(gguf, tmp_path, monkeypatch):
    """What is converted is read from a read-only (shared) cache, nothing written."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    first = load_target(gguf)
    read_only(first.folder.parent)
    try:
        assert load_target(gguf).fingerprint == first.fingerprint
    finally:
        first.folder.parent.chmod(0o755)


def test_an_unset_cache_of_the_default_user_is_named_by_its_folder(gguf, tmp_path,
                                                                     monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    read_only(tmp_path / ".cache")
    try:
        with pytest.raises(DraftsmithError) as e:
            load_target(gguf)
    finally:
        (tmp_path / ".cache").chmod(0o755)
    cache = tmp_path / ".cache" / "draftsmith"
    assert f"the target cache {cache}: cannot be written" in str(e.value)
    assert "set DRAFTSMITH_CACHE to a folder you can write to" in str(e.value)


def test_an_empty_cache_variable_is_the_default_and_tilde_is_home(tmp_path, monkeypatch):
    """DRAFTSMITH_CACHE= (empty) put conversions in the working folder; a quoted "~/c" in a
    folder named `~` there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DRAFTSMITH_CACHE", "")
    assert cache_dir() == tmp_path / ".cache" / "draftsmith"
    monkeypatch.setenv("DRAFTSMITH_CACHE", "~/c")
    assert cache_dir() == tmp_path / "c"


def convs(n: int = 6) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"a{i}."}]) for i in range(n)]


@pytest.fixture
def ranks_done(target, model, tmp_path, monkeypatch) -> Path:
    """A two-rank capture, every rank finished, its merged manifest removed (as where the last
    rank died before merging)."""
    out = tmp_path / "d"
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = CaptureConfig(aux_layer_ids=[1], max_len=64, samples_per_shard=2)
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        capture(target, convs(), out, cfg, progress=False, model=model, log=lambda s: None)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    (out / MANIFEST).unlink()
    return out


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("holder", ["rank", "one process"])
def test_merge_into_a_folder_a_capture_holds_is_refused(ranks_done, holder):
    """`data merge` took no lock: it wrote the manifest while a rank (or a single-process
    --overwrite) removed or wrote the files it listed."""
    out = ranks_done
    before = listing(out)
    hold = _Hold(out / "rank-0", out) if holder == "rank" else _Hold(out)
    hold.take()
    try:
        r = CliRunner().invoke(app, ["merge", str(out)])
    finally:
        hold.release()
    assert isinstance(r.exception, DraftsmithError), r.output
    assert str(r.exception) == (f"{out}: a capture or another merge is writing into it; wait "
                                f"for it to end, then run `draftsmith data merge {out}` again")
    assert listing(out) == before
    r = CliRunner().invoke(app, ["merge", str(out)])
    assert r.exit_code == 0, r.output
    assert len(Dataset(out)) == 6


def test_a_merge_holds_the_folder_and_lets_go_on_error(ranks_done, monkeypatch):
    """While a merge runs a capture's rank is refused the folder; a failed merge lets it go."""
    import draftsmith.data.capture as C

    out, seen = ranks_done, []

    def merge_then_rank_starts(folder, ms):
        with pytest.raises(DraftsmithError, match="another `draftsmith data capture`"):
            _Hold(out / "rank-1", out).take()
        seen.append(True)
        raise DraftsmithError("stop")

    monkeypatch.setattr(C, "merge", merge_then_rank_starts)
    r = CliRunner().invoke(app, ["merge", str(out)])
    assert str(r.exception) == "stop" and seen == [True]
    with _Hold(out / "rank-1", out) as hold:
        hold.take()  # released with the failed merge
    assert not (out / MANIFEST).exists()
    assert json.loads((out / "rank-0" / MANIFEST).read_text())["complete"]


def test_merge_of_a_rank_whose_shard_is_gone_is_refused_naming_it(ranks_done):
    """Every rank's manifest complete, one listed shard deleted: the merge wrote a complete
    manifest listing the missing file (a training's traceback later)."""
    out = ranks_done
    (out / "rank-1" / "shard-00001.safetensors").unlink()
    r = CliRunner().invoke(app, ["merge", str(out)])
    assert isinstance(r.exception, DraftsmithError), r.output
    assert str(r.exception) == (
        f"{out}: not every rank has finished (rank 1: shard-00001.safetensors gone or cut "
        "short); rerun the same capture command on every rank (torchrun), which finishes "
        "them and merges")
    assert not (out / MANIFEST).exists()


def test_merge_names_the_ranks_not_begun_or_unfinished(ranks_done):
    out = ranks_done
    m = json.loads((out / "rank-0" / MANIFEST).read_text())
    (out / "rank-0" / MANIFEST).write_text(json.dumps({**m, "complete": False}))
    for f in (out / "rank-1").iterdir():
        f.unlink()
    (out / "rank-1").rmdir()
    r = CliRunner().invoke(app, ["merge", str(out)])
    assert "not every rank has finished (rank 0: unfinished; rank 1: not begun)" in str(
        r.exception), r.output
