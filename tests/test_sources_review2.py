"""Prompt files that cannot be read are one clear error, not a traceback."""

from __future__ import annotations

import pathlib

import pytest

from draftsmith.data.prompts import load_prompts
from draftsmith.errors import DraftsmithError


def test_a_damaged_parquet_page_is_named(tmp_path):
    """A file whose footer reads but whose pages do not raised pyarrow's OSError mid-read."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": [f"hello world {i}" for i in range(2000)]}), path,
                   row_group_size=500)
    data = bytearray(path.read_bytes())
    for i in range(100, len(data) // 2):
        data[i] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match=r"p\.parquet: cannot read Parquet past row 0"):
        load_prompts(path)


def test_an_unreadable_json_file_is_named(tmp_path, monkeypatch):
    """An unreadable .json (no permission: root reads anyway, so it is simulated) raised a
    PermissionError where a .jsonl's was one line."""
    path = tmp_path / "p.json"
    path.write_text('[{"prompt": "hi there"}]')
    real = pathlib.Path.read_bytes

    def denied(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)
    with pytest.raises(DraftsmithError, match=r"p\.json: cannot read \(Permission denied\)"):
        load_prompts(path)
