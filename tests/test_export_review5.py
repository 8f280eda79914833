"""`draftsmith import` into a folder it cannot write (a full disk) was an OSError traceback;
it is one error saying the drafter there is kept."""

from __future__ import annotations

import errno

import pytest
from test_export import make

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter
from draftsmith.models import eagle3


def test_an_import_that_cannot_write_is_one_error_and_keeps_the_old(target, tmp_path,
                                                                    monkeypatch):
    sp = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    old = make(target, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(DraftsmithError, match="cannot write the drafter .No space left on "
                                              "device.; what was there is kept"):
        import_drafter(sp, old, overwrite=True)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert eagle3.load_drafter(old) is not None
