"""Dry runs of benchmarks/h200.sh, the lent-GPU recipe, over a fake gpu_suite.py whose stages
write at once what the real ones would: the shell's control flow (which stages run, on which
data, with which settings, what comes back) is checked here, where a mistake costs nothing;
on the device it costs a call."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_SUITE = '''
import json, lzma, os, sys
from pathlib import Path
OUT = Path(os.environ["OUT"]); OUT.mkdir(parents=True, exist_ok=True)
WORK = Path(os.environ.get("WORK", "runs/x"))
D = Path(os.environ.get("DRAFTER", "runs/big/drafter"))
KEYS = ("N", "SEED", "GEN_BATCH", "OPENINGS", "PACK_STEM", "INIT_FROM", "EPOCHS",
        "DRAFTSMITH_TREE_TOPK", "DRAFTSMITH_VERIFY_ATTENTION", "DRAFTSMITH_FUSED_PHASES", "TREES",
        "GEN_COMPILE", "REFILL", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_DETERMINISTIC",
        "DRAFTER", "PYTHONPATH")
res = {}
for st in os.environ["STAGES"].split(","):
    with open(os.environ["CALLS"], "a") as f:
        seen = {k: os.environ.get(k) for k in KEYS}
        f.write(json.dumps({"stage": st, "work": str(WORK), **seen}) + "\\n")
    if st == "gen" and os.environ.get("FAIL_COMPILED_GEN") and os.environ["GEN_COMPILE"] == "1":
        sys.exit(1)  # as inductor did in run 6
    if st == "gen":
        WORK.mkdir(parents=True, exist_ok=True)
        seed = os.environ.get("SEED", "0")
        rows = "".join(f'{{"id": "s{seed}-{i}"}}\\n' for i in range(int(os.environ["N"])))
        (WORK / "answers.jsonl").write_text(rows)
    elif st == "pack":
        stem = os.environ.get("PACK_STEM", "answers")
        blob = lzma.compress((WORK / "answers.jsonl").read_bytes())
        (OUT / f"{stem}.jsonl.xz.00").write_bytes(blob)
    elif st == "unpack":
        parts = {p.name: p for d in os.environ["DATA_PARTS"].split(":") if Path(d).is_dir()
                 for p in Path(d).glob("answers*.jsonl.xz.*")}
        WORK.mkdir(parents=True, exist_ok=True)
        order = sorted(parts, key=lambda n: (n.split(".jsonl.xz.")[0], n))  # as the real one
        blob = b"".join(lzma.decompress(parts[n].read_bytes()) for n in order)
        (WORK / "answers.jsonl").write_bytes(blob)
    elif st == "restore":
        D.mkdir(parents=True, exist_ok=True)
    elif st == "train":
        D.mkdir(parents=True, exist_ok=True)
        ids = [json.loads(x)["id"] for x in open(WORK / "answers.jsonl")]
        (D / "draftsmith.json").write_text(json.dumps({"ids": ids}))
    elif st == "keep":
        (OUT / "drafter").mkdir(exist_ok=True)
        (OUT / "drafter" / "weights.safetensors.xz.00").write_text("w")
        (OUT / "drafter" / "draftsmith.json").write_text((D / "draftsmith.json").read_text())
    res[st] = {"result": {}}
(OUT / "gpu_suite.json").write_text(json.dumps(res))
'''


@pytest.fixture
def dry(tmp_path):
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for f in ("h200.sh", "autotune_diff.py"):
        shutil.copy(ROOT / "benchmarks" / f, repo / "benchmarks" / f)
    (repo / "benchmarks" / "gpu_suite.py").write_text(FAKE_SUITE)
    (tmp_path / "S.gguf").write_bytes(b"")
    data = tmp_path / "data"
    data.mkdir()

    def run(verb: str, out: str, **env: str) -> tuple[Path, list[dict]]:
        calls = tmp_path / f"calls_{out}.jsonl"
        full = {**os.environ, "OUT": str(tmp_path / out), "GGUF": str(tmp_path / "S.gguf"),
                "DATA_DIR": str(data), "RESPEC_DIR": str(tmp_path / "r"), "CALLS": str(calls),
                "TESTS": "0", "SPECS": "none", "BUDGET": "585", **env}
        for k in ("SEED", "MORE_N", "MORE_SEED", "N", "GEN_BATCH", "OPENINGS", "INIT_KEPT",
                  "GEN_COMPILE", "REFILL", "FAIL_COMPILED_GEN", "TORCHINDUCTOR_CACHE_DIR",
                  "TORCHINDUCTOR_DETERMINISTIC"):
            if k not in env:
                full.pop(k, None)
        subprocess.run(["bash", "benchmarks/h200.sh", verb], cwd=repo, env=full, check=True,
                       capture_output=True, timeout=120)
        rows = [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []
        return tmp_path / out, rows

    return repo, data, run


def pack(path: Path, ids: list[str]) -> None:
    path.write_bytes(lzma.compress("".join(f'{{"id": "{i}"}}\n' for i in ids).encode()))


def trained_ids(repo: Path) -> list[str]:
    return json.loads((repo / "runs/big/drafter/draftsmith.json").read_text())["ids"]


def test_more_data_joins_the_unpacked_answers_and_comes_back_apart(dry):
    repo, data, run = dry
    pack(data / "answers.jsonl.xz.00", ["old0", "old1"])
    out, calls = run("bigrun", "o1", N="48000", MORE_N="3", MORE_SEED="1", INIT_KEPT="/kept")
    gens = [c for c in calls if c["stage"] == "gen"]
    assert [c["work"] for c in gens] == ["runs/more"]  # the kept answers are not generated again
    assert (gens[0]["SEED"], gens[0]["GEN_BATCH"], gens[0]["OPENINGS"]) == ("1", "1024", "mixed")
    assert trained_ids(repo) == ["old0", "old1", "s1-0", "s1-1", "s1-2"]
    train = next(c for c in calls if c["stage"] == "train")
    assert train["INIT_FROM"] == "runs/init"
    assert (out / "answers-s1.jsonl.xz.00").is_file()  # the new data, packed apart
    assert not (out / "answers.jsonl.xz.00").exists()  # the carried data is not sent back
    assert (out / "drafter" / "weights.safetensors.xz.00").is_file()


def test_a_cold_restart_trains_on_both_packed_datasets(dry):
    repo, data, run = dry
    pack(data / "answers.jsonl.xz.00", ["old0"])
    pack(data / "answers-s1.jsonl.xz.00", ["new0", "new1"])
    _, calls = run("bigrun", "o2", N="48000")
    assert not [c for c in calls if c["stage"] == "gen"]
    assert trained_ids(repo) == ["old0", "new0", "new1"]


def test_fresh_generation_and_more_data_use_different_seeds(dry):
    repo, _, run = dry
    out, _ = run("bigrun", "o3", N="2", MORE_N="2")
    assert trained_ids(repo) == ["s0-0", "s0-1", "s1-0", "s1-1"]  # no duplicated prompts
    assert (out / "answers.jsonl.xz.00").is_file() and (out / "answers-s1.jsonl.xz.00").is_file()


def test_a_failed_compiled_generation_falls_back_to_static_eager_batches(dry):
    repo, _, run = dry
    _, calls = run("bigrun", "o5", N="2", FAIL_COMPILED_GEN="1")
    gens = [(c["GEN_COMPILE"], c["GEN_BATCH"], c["REFILL"], c["OPENINGS"])
            for c in calls if c["stage"] == "gen"]
    assert gens == [("1", "1024", None, "mixed"), ("0", "256", "0", "mixed")]
    assert trained_ids(repo) == ["s0-0", "s0-1"]


def test_respec_runs_take_the_verify_attention_tree_top_k_and_fused_phases(dry):
    _, _, run = dry
    out, calls = run("respec", "o4", RUNS="a:16:1:3:3/4/8:sdpa:max b:16:1::3/4/8 "
                                          "c:16:1::3/4/8:matmul:chunk:draft")
    specs = [c for c in calls if c["stage"] == "spec"]
    assert [(c["DRAFTSMITH_VERIFY_ATTENTION"], c["DRAFTSMITH_TREE_TOPK"],
             c["DRAFTSMITH_FUSED_PHASES"]) for c in specs] == [
        ("sdpa", "max", "all"), ("triton", "chunk", "all"), ("matmul", "chunk", "draft")]
    assert (out / "respec.tgz").is_file()


def test_respec_runs_take_their_own_environment(dry, tmp_path):
    """The 9th field sets variables for that run's process only (H200 run 10's baseline ran in a
    slow kernel mode that inductor's autotune cache carried from one process to the next)."""
    import tarfile

    _, _, run = dry
    icache = tmp_path / "i1"
    (icache / "ab").mkdir(parents=True)
    (icache / "ab" / "cab.py").write_text("def triton_poi_fused_0(x):\n    pass\n")
    (icache / "ab" / "k.best_config").write_text('{"XBLOCK": 4}')
    _, calls = run("respec", "o5", RUNS="a:16:1:3:3/4/8:matmul:chunk:all:"
                                        f"TORCHINDUCTOR_CACHE_DIR={icache},"
                                        "TORCHINDUCTOR_DETERMINISTIC=1 b:16:1:3:3/4/8 "
                                        "c:16:1::7/4/24:matmul:chunk:all:DRAFTER=runs/init")
    specs = [c for c in calls if c["stage"] == "spec"]
    assert [(c["TORCHINDUCTOR_CACHE_DIR"], c["TORCHINDUCTOR_DETERMINISTIC"]) for c in specs] == [
        (str(icache), "1"), (None, None), (None, None)]
    # a run's own DRAFTER wins over the default: bigrun's start beside what it trained
    assert [c["DRAFTER"] for c in specs] == ["runs/big/drafter"] * 2 + ["runs/init"]
    picks = json.loads((tmp_path / "r" / "spec_a.autotune.json").read_text())
    assert list(picks.values()) == [{"kernel": "triton_poi_fused_0", "config": {"XBLOCK": 4}}]
    with tarfile.open(tmp_path / "r" / "spec_a.kernels.tgz") as tgz:  # the raw evidence too
        assert sorted(tgz.getnames()) == ["ab/cab.py", "ab/k.best_config"]


def test_a_respec_run_imports_the_src_it_names(dry):
    """SRC=dir in a run's own field: that process imports the draftsmith there (the code before
    a change, beside it in one call), the gguf site first; the others import the checkout's."""
    repo, _, run = dry
    _, calls = run("respec", "o6", RUNS="o:16:1::7/4/24:triton:chunk:all:SRC=ab_base/src "
                                        "n:16:1::7/4/24")
    paths = [c["PYTHONPATH"].split(":") for c in calls if c["stage"] == "spec"]
    assert paths == [["/tmp/site", f"{repo}/ab_base/src"], ["/tmp/site", f"{repo}/src"]]


def test_gpu_tests_start_with_the_first_call_only_and_only_with_time_left(dry):
    """TESTS=1: the GPU tests start beside the first call's generation, their log comes back in
    the archive, and no later call (the drafter exists) starts them again; with too little
    budget they do not start at all, so the call's final wait cannot hang."""
    import tarfile

    repo, _, run = dry

    def archived(out: Path) -> list[str]:
        with tarfile.open(out / "bigrun.tgz") as tgz:
            return [Path(n).name for n in tgz.getnames()]

    out, _ = run("bigrun", "t1", N="2", TESTS="1")
    assert "probe_log.txt" in archived(out) and (repo / "runs/tests_started").is_file()
    out, _ = run("bigrun", "t2", N="2", TESTS="1")
    assert "probe_log.txt" not in archived(out)
    shutil.rmtree(repo / "runs")
    out, _ = run("bigrun", "t3", N="2", TESTS="1", BUDGET="80")
    assert not (repo / "runs/tests_started").exists() and "probe_log.txt" not in archived(out)


def test_gpu_suite_lists_split_at_commas_or_plus(monkeypatch, tmp_path):
    """RUNS' per-run VAR=value fields split at commas, so a list travels with "+" instead:
    TREES=3/4/8+7/4/24 and SUITES=chat+humaneval mean what their comma forms mean."""
    import importlib.util

    monkeypatch.setenv("DEVICE", "cpu")
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks/gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    monkeypatch.setenv("TREES", "3/4/8+7/4/24")
    monkeypatch.setenv("CHAIN", "2,3")
    assert suite.settings(8) == [(2, 1, 3), (3, 1, 4), (3, 4, 8), (7, 4, 24)]
    monkeypatch.setenv("CHAIN", "")  # no chain: the trees alone
    assert suite.settings(1) == [(3, 4, 8), (7, 4, 24)]
    monkeypatch.delenv("CHAIN")
    monkeypatch.delenv("TREES")
    assert suite.settings(1)[:2] == [(1, 1, 2), (2, 1, 3)] and suite.settings(1)[-1] == (5, 8, 16)
    monkeypatch.setenv("SUITES", "chat+humaneval")
    assert suite.env_list("SUITES", "chat") == ["chat", "humaneval"]


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_kernels_needs_no_model_and_brings_back_the_microbenches(dry, tmp_path):
    """A fresh machine's first call, carrying nothing: no GGUF, no /tmp/m/part0; a failing test
    run is logged, not fatal (the timings still come back)."""
    repo, _, run = dry
    for name in ("verify_attention.py", "verify_linear.py", "draft_head.py", "norm_linear.py"):
        (repo / "benchmarks" / name).write_text(
            "import json, sys\n"
            "out = sys.argv[sys.argv.index('--out') + 1]\n"
            "json.dump({'argv': sys.argv[1:]}, open(out, 'w'))\n"
            "print(json.dumps({'script': sys.argv[0]}))\n")
    out, _ = run("kernels", "k", GGUF=str(tmp_path / "missing.gguf"))
    attention = json.loads((out / "verify_attention.json").read_text())["argv"]
    assert "--split" in attention and "0,64" in attention
    assert (out / "verify_linear.json").is_file() and (out / "draft_head.json").is_file()
    log = (out / "kernels_log.txt").read_text()
    benches = ("verify_attention", "verify_linear", "draft_head", "norm_linear")
    assert all(f"{name}.py" in log for name in benches)
    assert "kernel GPU tests: rc" in log  # no tests folder in the dry repo
    out, _ = run("kernels", "k1", GGUF=str(tmp_path / "missing.gguf"), KERNELS="norm_linear")
    log = (out / "kernels_log.txt").read_text()
    assert "norm_linear.py" in log and "verify_attention.py" not in log
    assert not (out / "verify_linear.json").exists()


def test_enginetests_needs_no_model_and_logs_a_failed_run(dry, tmp_path):
    """The engine's GPU tests as a call of their own: no GGUF needed; a failing run is logged
    with its exit status, and the call still ends well (its log comes back)."""
    _, _, run = dry
    out, _ = run("enginetests", "e", GGUF=str(tmp_path / "missing.gguf"))
    log = (out / "enginetests_log.txt").read_text()
    assert "engine GPU tests: rc" in log and "test_speculative_gpu.py" in log


def test_device_tree_moves_only_output_folders_and_restores_them(tmp_path):
    """slim moves committed output folders (no scripts in them) aside for the device's carry
    limit, keeps folders with scripts and top-level files, refuses to slim twice over a held
    copy; restore puts every file back as it was."""
    repo = tmp_path / "repo"
    files = {"benchmarks/run1/log.txt": "a", "benchmarks/run1/sub/x.json": "b",
             "benchmarks/checks/fit.py": "c", "benchmarks/checks/out.txt": "d",
             "benchmarks/notes.md": "e", "src/m.py": "f"}
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    shutil.copy(ROOT / "benchmarks/device_tree.sh", repo / "benchmarks/device_tree.sh")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    env = {**os.environ, "HOLD": str(tmp_path / "hold")}

    def run(verb: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "benchmarks/device_tree.sh", verb], cwd=repo, env=env,
                              capture_output=True, text=True)

    assert run("slim").returncode == 0
    assert not (repo / "benchmarks/run1").exists()
    assert (tmp_path / "hold/run1/sub/x.json").read_text() == "b"
    assert all((repo / f).exists() for f in files if not f.startswith("benchmarks/run1"))
    (repo / "benchmarks/run1").mkdir()
    (repo / "benchmarks/run1/log.txt").write_text("a")
    bad = run("slim")
    assert bad.returncode != 0 and "restore first" in bad.stdout
    shutil.rmtree(repo / "benchmarks/run1")
    assert run("restore").returncode == 0
    assert {rel: (repo / rel).read_text() for rel in files} == files
