"""Which compiled kernels two processes tuned differently: inductor benchmarks the candidate
configs of a Triton kernel on its first launch and caches the winner (`*.best_config`) beside the
kernel's source, so every later process on the machine reuses the first one's pick. H200 run 10's
baseline ran 13 % slower than in runs 4-9 with unchanged code; this names the kernels whose picks
differ between a slow and a fast process's inductor cache (TORCHINDUCTOR_CACHE_DIR).

    python benchmarks/autotune_diff.py collect CACHE_DIR OUT.json   # on the machine that tuned
    python benchmarks/autotune_diff.py diff A.json B.json           # anywhere

`collect` must run under the torch that wrote the cache: a best_config's file name hashes the
kernel's file name with that torch's build key.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KERNEL = re.compile(r"^def (triton_\w+)\(", re.M)
VOLATILE = ("time_taken_ms", "triton_cache_hash", "configs_hash")  # not the pick itself


def best_config_path(source: Path) -> Path:
    """Where inductor's local autotune cache keeps the pick for the kernel in `source`."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    key = AutotuneCache._prepare_key(str(source))
    return Path(AutotuneCache._make_local_cache_key(str(source.parent), key))


def collect(cache_dir: Path) -> dict[str, dict]:
    """{kernel source hash: {"kernel": name, "config": the pick}} for every tuned kernel."""
    out = {}
    for src in sorted(cache_dir.rglob("*.py")):
        names = KERNEL.findall(src.read_text(encoding="utf-8", errors="replace"))
        if names and (cfg := best_config_path(src)).is_file():
            pick = {k: v for k, v in json.loads(cfg.read_text()).items() if k not in VOLATILE}
            out[src.stem] = {"kernel": names[0], "config": pick}
    return out


def diff(a: dict[str, dict], b: dict[str, dict]) -> list[tuple[str, dict, dict]]:
    """(kernel, pick in a, pick in b) for the kernels both tuned, where the picks differ."""
    return [(a[h]["kernel"], a[h]["config"], b[h]["config"]) for h in sorted(a.keys() & b.keys())
            if a[h]["config"] != b[h]["config"]]


def show(a: dict, b: dict, rows: list[tuple[str, dict, dict]]) -> str:
    lines = [f"{len(a)} and {len(b)} tuned kernels, {len(a.keys() & b.keys())} in both, "
             f"{len(rows)} picked differently", "", "| kernel | pick A | pick B |", "|---|---|---|"]
    lines += [f"| `{k}` | {json.dumps(x, sort_keys=True)} | {json.dumps(y, sort_keys=True)} |"
              for k, x, y in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "collect":
        picks = collect(Path(argv[1]))
        Path(argv[2]).write_text(json.dumps(picks, indent=1, sort_keys=True))
        print(f"{len(picks)} tuned kernels in {argv[1]} -> {argv[2]}")
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:])
        print(show(a, b, diff(a, b)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
