"""Which compiled kernels two processes tuned differently: inductor benchmarks the candidate
configs of a Triton kernel on its first launch and caches the winner (`*.best_config`) beside the
kernel's source, so every later process on the machine reuses the first one's pick. H200 run 10's
baseline ran 13 % slower than in runs 4-9 with unchanged code; this names the kernels whose picks
differ between a slow and a fast process's inductor cache (TORCHINDUCTOR_CACHE_DIR).

    python benchmarks/autotune_diff.py collect CACHE_DIR OUT.json [RAW.tgz]  # where it tuned
    python benchmarks/autotune_diff.py diff A.json B.json           # anywhere
    python benchmarks/autotune_diff.py split FAST.json... -- SLOW.json...  # what splits the modes

`collect` must run under the torch that wrote the cache: a best_config's file name hashes the
kernel's file name with that torch's build key.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
from collections import Counter
from pathlib import Path

KERNEL = re.compile(r"^def (triton_\w+)\(", re.M)
VOLATILE = ("time_taken_ms", "triton_cache_hash", "configs_hash")  # not the pick itself


def best_config_path(source: Path) -> Path:
    """Where this torch's local autotune cache keeps the pick for the kernel in `source`."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    key = AutotuneCache._prepare_key(str(source))
    return Path(AutotuneCache._make_local_cache_key(str(source.parent), key))


def candidates(source: Path) -> list[Path]:
    """The names other torch versions gave a kernel's pick: H200 run 11's torch 2.11 has no
    `_make_local_cache_key`, so the collect there failed on the first kernel."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    paths = [source.with_suffix(".best_config")]
    if hasattr(AutotuneCache, "_prepare_key"):
        paths.append(source.parent / f"{AutotuneCache._prepare_key(str(source))}.best_config")
    if hasattr(AutotuneCache, "_make_local_cache_key"):
        paths.append(best_config_path(source))
    return paths


def kernels_in(source: Path) -> list[str]:
    """The Triton kernels a kernel file defines; a graph's wrapper (which embeds its kernels'
    sources in strings for async_compile) defines none of its own."""
    text = source.read_text("utf-8", "replace")
    return [] if "async_compile" in text else KERNEL.findall(text)


def kernel_files(cache_dir: Path) -> dict[Path, list[str]]:
    """{kernel source file: the kernels it defines}, each file read once (no graph wrappers)."""
    return {f: found for f in sorted(cache_dir.rglob("*.py")) if (found := kernels_in(f))}


def kernel_names(files: dict[Path, list[str]]) -> dict[Path, str]:
    """{best_config file: the kernel it tunes} for every pick found from a kernel's source; a
    folder holding one kernel and one pick pairs them whatever the naming."""
    per_folder = Counter(f.parent for f in files)
    names: dict[Path, str] = {}
    for src, found in files.items():
        if hit := next((c for c in candidates(src) if c.is_file()), None):
            names[hit] = found[0]
            continue
        picks = list(src.parent.glob("*.best_config"))
        if len(picks) == 1 and per_folder[src.parent] == 1:
            names[picks[0]] = found[0]
    return names


def collect(cache_dir: Path, files: dict[Path, list[str]] | None = None) -> dict[str, dict]:
    """{pick file's name: {"kernel": name or "?", "config": the pick}} for every tuned kernel.
    Pick files are named from the kernel's source hash, so two caches written by one torch name a
    kernel alike. files: `kernel_files(cache_dir)`, when the caller has it already."""
    names = kernel_names(kernel_files(cache_dir) if files is None else files)
    out = {}
    for cfg in sorted(cache_dir.rglob("*.best_config")):
        pick = {k: v for k, v in json.loads(cfg.read_text()).items() if k not in VOLATILE}
        out[cfg.stem] = {"kernel": names.get(cfg, "?"), "config": pick}
    return out


def archive(cache_dir: Path, out: Path, cap: int = 2 << 20,
            files: dict[Path, list[str]] | None = None) -> int:
    """The raw evidence beside `collect`'s summary: every pick file and every kernel source in
    the cache (no graph wrappers), as a .tgz of at most `cap` bytes of input, smallest files
    first (an archive too big to leave the device would lose the run's other results). Returns
    the number of files written."""
    kernels = kernel_files(cache_dir) if files is None else files
    sizes = {f: f.stat().st_size for f in [*cache_dir.rglob("*.best_config"), *kernels]}
    total, kept = 0, []
    for f in sorted(sizes, key=sizes.__getitem__):
        if total + sizes[f] > cap:
            break
        total += sizes[f]
        kept.append(f)
    with tarfile.open(out, "w:gz") as tgz:
        for f in sorted(kept):
            tgz.add(f, arcname=str(f.relative_to(cache_dir)))
    return len(kept)


def diff(a: dict[str, dict], b: dict[str, dict]) -> list[tuple[str, dict, dict]]:
    """(kernel, pick in a, pick in b) for the kernels both tuned, where the picks differ."""
    def name(h: str) -> str:
        return a[h]["kernel"] if a[h]["kernel"] != "?" else b[h]["kernel"]

    return [(name(h), a[h]["config"], b[h]["config"]) for h in sorted(a.keys() & b.keys())
            if a[h]["config"] != b[h]["config"]]


def split(fast: list[dict], slow: list[dict]) -> list[tuple[str, list[dict], list[dict]]]:
    """(kernel, fast picks, slow picks) for the kernels every run tuned, by name (a hash moves
    with the code around a kernel), where no fast run picked anything a slow run picked. Names
    are numbered per graph, so one run may tune several kernels of a name: all their picks
    count. One run a side is a plain diff; each more run narrows the list."""
    def picks(runs: list[dict], kernel: str) -> list[dict]:
        return [v["config"] for run in runs for v in run.values() if v["kernel"] == kernel]

    names = set.intersection(*({v["kernel"] for v in run.values()} for run in fast + slow))
    rows = []
    for kernel in sorted(names - {"?"}):
        f, s = picks(fast, kernel), picks(slow, kernel)
        if not any(x == y for x in f for y in s):
            rows.append((kernel, f, s))
    return rows


def show(a: dict, b: dict, rows: list[tuple[str, dict, dict]]) -> str:
    lines = [f"{len(a)} and {len(b)} tuned kernels, {len(a.keys() & b.keys())} in both, "
             f"{len(rows)} picked differently", "", "| kernel | pick A | pick B |", "|---|---|---|"]
    lines += [f"| `{k}` | {json.dumps(x, sort_keys=True)} | {json.dumps(y, sort_keys=True)} |"
              for k, x, y in rows]
    return "\n".join(lines)


def _short(config: dict) -> str:
    return json.dumps({k: v for k, v in config.items() if k != "found_by_coordesc"}, sort_keys=True)


def main(argv: list[str]) -> int:
    if len(argv) in (3, 4) and argv[0] == "collect":
        cache = Path(argv[1])
        files = kernel_files(cache)
        picks = collect(cache, files)
        Path(argv[2]).write_text(json.dumps(picks, indent=1, sort_keys=True))
        print(f"{len(picks)} tuned kernels in {argv[1]} -> {argv[2]}")
        if len(argv) == 4:
            print(f"{archive(cache, Path(argv[3]), files=files)} files -> {argv[3]}")
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:])
        print(show(a, b, diff(a, b)))
        return 0
    if argv[:1] == ["split"] and "--" in argv[2:-1]:
        cut = argv.index("--")
        fast, slow = ([json.loads(Path(p).read_text()) for p in ps]
                      for ps in (argv[1:cut], argv[cut + 1:]))
        for kernel, f, s in split(fast, slow):
            print(f"`{kernel}`\n  fast: {[_short(c) for c in f]}\n  slow: {[_short(c) for c in s]}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
