"""Export review 15: the SGLang version that reads fc_norm / norm_output, named at export."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_export import make

from draftsmith.export import export_drafter
from draftsmith.models.eagle3 import save_drafter


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_sglang_export_names_the_sglang_pr_that_reads_the_flag(target, tmp_path, flag):
    """SGLang's llama_eagle3.py reads fc_norm and norm_output from PR #24663 on (sgl-project/
    sglang #26506: "the analogous changes for the MHA EAGLE3 draft already landed in #24663");
    the one at 03d5a77 and d737979 reads neither. The warning said only 'an SGLang whose
    llama_eagle3.py reads them', which no user can check a server against."""
    src = make(target, tmp_path / "d", **{flag: True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_drafter(src, "sglang", tmp_path / "sg", target=str(target.folder))
    said = [str(w.message) for w in caught if f"{flag} written to config.json" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "SGLang from PR #24663" in said[0]


def test_sglang_import_of_norm_output_names_the_sglang_pr(target, tmp_path):
    """The import's norm_output note said SGLang's llama_eagle3.py serves Eagle-3.1, which holds
    only from PR #24663 on (an older one feeds the pre-norm state back)."""
    from draftsmith.export import read_any

    src = make(target, tmp_path / "d", norm_output=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_drafter(src, "sglang", tmp_path / "sg", target=str(target.folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_any(out, str(target.folder))
    said = [str(w.message) for w in caught if "norm_output true read as" in str(w.message)]
    assert len(said) == 1 and "SGLang from PR #24663" in said[0], said


LEGACY = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.",
          "fc_norm.2.": "aux_norm_high."}


def test_sglang_import_reads_the_legacy_aux_norm_names_sglang_loads(target, tmp_path):
    """SGLang's llama_eagle3.py since PR #24663 builds the per-aux norms for `fc_norm` or the
    legacy `use_aux_norm` flag and loads `aux_norm_low/mid/high` as `fc_norm.0/1/2`
    (`legacy_name_map`). The import read neither: it left the norms out as tensors 'SGLang does
    not load' and built a drafter without them, drafting otherwise than SGLang serves it."""
    from safetensors.torch import load_file, save_file

    from draftsmith.export import read_any
    from draftsmith.models.eagle3 import load_drafter

    src = make(target, tmp_path / "d", fc_norm=True)
    d = load_drafter(src)
    with torch.no_grad():
        for i, norm in enumerate(d.fc_norm):
            norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()) + i)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_drafter(save_drafter(d, tmp_path / "d2"), "sglang", tmp_path / "sg",
                             target=str(target.folder))
    c = json.loads((out / "config.json").read_text())
    c["use_aux_norm"] = c.pop("fc_norm")
    (out / "config.json").write_text(json.dumps(c))
    w = load_file(str(out / "model.safetensors"))
    renamed = {next((k.replace(a, b) for a, b in LEGACY.items() if k.startswith(a)), k): v
               for k, v in w.items()}
    save_file(renamed, str(out / "model.safetensors"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = read_any(out, str(target.folder))
    assert back.cfg.fc_norm
    assert not [m for m in caught if "does not load" in str(m.message)]
    for mine, theirs in zip(d.fc_norm, back.fc_norm, strict=True):
        assert torch.equal(mine.weight, theirs.weight)
