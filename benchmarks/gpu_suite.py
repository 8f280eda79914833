"""One GPU run that makes every figure the benchmarks need, stage by stage, saving as it goes.

data (2,000 self-made conversations, throughput vs HF generate at batch 64) -> train (TTT curve,
tokens/s) -> speculative bench (batch 1/8/32, chain steps 1-7, two trees, HumanEval and chat;
greedy agreement) -> doctor -> tune. A failing stage is recorded and the next one runs.

Usage on the lent H200 (after `../shared/device/prepare-default-model.sh`), two calls in a row:
  1. carry [".m1"]: mkdir -p /tmp/m && cp .m1/part0 /tmp/m/
  2. carry [".m2", ".whl"]: cat /tmp/m/part0 .m2/part1 > /tmp/m/S.gguf && pip install --no-index
     --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:src
     DRAFTSMITH_DEFAULT_GGUF=/tmp/m/S.gguf timeout 580 python3 benchmarks/gpu_suite.py
Env overrides: WORK (a data folder, e.g. runs/demo/data), DRAFTER, TRAIN_SECONDS, N, ANSWER,
EPOCHS, TRAIN_BATCH, TRAIN_LEN, PROFILE_STEPS, INIT_HEAD, DRAFT_VOCAB, DRAFT_LAYERS,
DRAFT_INTER (MLP width; with INIT_FROM wider widens it), GEN_BATCH,
GEN_COMPILE (1 = on), SEED (self-made prompts, default 0), PACK_STEM (pack: answers-s1 etc.),
REFILL (0 = static batches), OPENINGS (builtin, mixed or a file), TEMP,
LR, MAX_SAMPLES (train on the first N conversations), COMPILE_LOSS=0 or 1 (default: on the GPU),
INIT_FROM (a drafter folder whose weights start training), NEW, PROMPTS,
REPEATS (spec: each group timed that often), SPEC_BATCHES,
COMPILE (1 = spec and tune compiled), SUITES, CHAIN, TREES, BOOKKEEPING_AB (1: each
setting also with eager bookkeeping), SPEC_TEMPS (0+0.7: greedy and sampled rows), SPEC_TOP_P,
TUNE_TEMPS (0+0.7: a tune each), TUNE_BATCHES, TUNE_STEPS, TUNE_TOPK, STAGES, TARGET, DEVICE,
KEPT (restore), DATA_PARTS (unpack: folders of packed answers).
Results land in $OUT/gpu_suite.json after every stage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/gpu_out"))
WORK = Path(os.environ.get("WORK", "/tmp/gpu_work"))  # data stage output: prompts, answers, dataset
DRAFTER = Path(os.environ.get("DRAFTER", WORK / "drafter"))  # e.g. runs/demo/drafter after a demo
N = int(os.environ.get("N", "2000"))
NEW = int(os.environ.get("NEW", "128"))
TARGET = os.environ.get("TARGET", "default")
DEVICE = os.environ.get("DEVICE", "cuda")
DT = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SPEC_BATCHES = [int(x) for x in os.environ.get("SPEC_BATCHES", "1,8,32").split(",")]
EPOCHS = int(os.environ.get("EPOCHS", "6"))
TRAIN_BATCH = int(os.environ.get("TRAIN_BATCH", "4"))
TRAIN_LEN = int(os.environ.get("TRAIN_LEN", "1024"))
ANSWER = int(os.environ.get("ANSWER", "192"))
COMPILE = os.environ.get("COMPILE") == "1"  # spec and tune: the target's layers compiled
# also: gen, keep, restore, pack, unpack
STAGES = os.environ.get("STAGES", "data,hf,train,spec,doctor,tune").split(",")
results: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "n": N}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str))


def stage(name: str, fn) -> None:
    if name not in STAGES:
        return
    print(f"== {name}", flush=True)
    t = time.perf_counter()
    try:
        results[name] = {"result": fn()}
    except Exception:  # noqa: BLE001 - record and go on: later stages still give figures
        results[name] = {"error": traceback.format_exc()[-3000:]}
        print(results[name]["error"], flush=True)
    results[name]["seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps({name: results[name]}, default=str)[:3000], flush=True)
    save()


def target_and_model():
    from draftsmith.targets import load_target

    t = load_target(TARGET)
    return t, t.build(DT, DEVICE)


def data_stage() -> dict:
    from draftsmith.data.pipeline import make_dataset

    rec = make_dataset(WORK, N, TARGET, DEVICE, DT, batch_size=64, max_len=1024,
                       max_new_tokens=ANSWER, vocab_size=8192, command="benchmarks/gpu_suite.py",
                       progress=False)
    shutil.copy(WORK / "make.json", OUT / "data_make.json")
    return rec


def gen_stage() -> dict:
    """Prompts and answers only (no capture), at batch GEN_BATCH: data for online training."""
    from draftsmith.data.prompts import read_prompts
    from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
    from draftsmith.data.selfmade import MagpieConfig, openings_from, self_made_prompts

    t, model = target_and_model()
    WORK.mkdir(parents=True, exist_ok=True)
    b = int(os.environ.get("GEN_BATCH", "256"))
    compiled = os.environ.get("GEN_COMPILE") == "1"
    t0 = time.perf_counter()
    opens = openings_from(os.environ.get("OPENINGS"))  # 'builtin': code, reasoning, writing
    cfg = MagpieConfig(N, b, 128, openings=opens, seed=int(os.environ.get("SEED", "0")))
    made = self_made_prompts(t, WORK / "prompts.jsonl", cfg, model, progress=False,
                             compile=compiled)
    t1 = time.perf_counter()
    temp = float(os.environ.get("TEMP", "0.8"))
    # The static cache is read whole at every step: size it to these prompts (<= 128 generated
    # tokens + the template + an opening) plus the answer, not to 1,024.
    regen = RegenConfig(ANSWER, ANSWER + 224, batch_size=b, temperature=temp,
                        refill=os.environ.get("REFILL", "1") == "1")
    answered = regenerate(read_prompts(WORK / "prompts.jsonl"), WORK / "answers.jsonl",
                          EngineBackend(t, model, regen, compiled),
                          t.tokenizer, regen, False)
    t2 = time.perf_counter()
    return {"batch": b, "temperature": regen.temperature, "refill": regen.refill,
            "compile": compiled, "prompts": made, "answers": answered,
            "prompt_seconds": t1 - t0, "answer_seconds": t2 - t1,
            "answer_tok_s": answered.get("answer_tokens", 0) / (t2 - t1)}


def hf_stage() -> dict:
    """Regenerate throughput at batch 64: our engine vs HF generate, same prompts, same run."""
    import transformers as tf

    from draftsmith.data.prompts import read_prompts
    from draftsmith.engine.generate import run_generation
    from draftsmith.engine.runtime import Runtime

    t, model = target_and_model()
    convs = list(read_prompts(WORK / "prompts.jsonl"))[:64]
    ids = [t.chat_ids([{"role": "user", "content": c.first_user()}]) for c in convs]
    ours = {}
    for compiled in (False, True):  # same prompts, fixed length, both runtimes
        rt = Runtime(model, 64, max(map(len, ids)) + NEW + 8, compile=compiled)
        run_generation(rt, ids, 8)
        g = run_generation(rt, ids, NEW)
        ours["compiled" if compiled else "eager_kernels"] = len(ids) * NEW / (g.prefill_s +
                                                                            g.decode_s)
    hf = tf.AutoModelForCausalLM.from_pretrained(t.folder, dtype=DT).to(DEVICE).eval()
    tok = t.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok([tok.decode(x) for x in ids], return_tensors="pt", padding=True,
              add_special_tokens=False).to(DEVICE)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
              pad_token_id=tok.pad_token_id or 0)
    hf.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=kw["pad_token_id"])
    sync()
    t0 = time.perf_counter()
    hf.generate(**enc, **kw)
    sync()
    hf_tps = len(ids) * NEW / (time.perf_counter() - t0)
    return {"batch": len(ids), "new_tokens": NEW, "draftsmith_tok_s": ours, "hf_tok_s": hf_tps,
            "ratio": {k: v / hf_tps for k, v in ours.items()},
            "regenerate": regen_vs_hf(t, model, hf, enc, convs)}


def regen_vs_hf(t, model, hf, enc, convs) -> dict:
    """The regenerate stage itself (greedy answers stopping at EOS, finished rows idle in the
    static batch) against HF generate on the same 64 prompts stopping at EOS the same way."""
    from draftsmith.data.prompts import read_prompts
    from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate

    cfg = RegenConfig(NEW, 1024, batch_size=len(convs), temperature=0.0)
    warm = list(read_prompts(WORK / "prompts.jsonl"))[64:128] or convs
    res: dict = {}
    for compiled in (False, True):
        backend = EngineBackend(t, model, cfg, compiled)
        tmp = OUT / f"regen_{compiled}.jsonl"
        regenerate(warm, tmp, backend, t.tokenizer, cfg, False)  # graphs and compile: once
        tmp.unlink()
        sync()
        t0 = time.perf_counter()
        stats = regenerate(convs, tmp, backend, t.tokenizer, cfg, False)
        sync()
        secs = time.perf_counter() - t0
        tmp.unlink()
        res["compiled" if compiled else "eager_kernels"] = {
            "answer_tokens": stats["answer_tokens"], "seconds": secs,
            "tok_s": stats["answer_tokens"] / secs}
    eos = list(t.eos_ids)
    sync()
    t0 = time.perf_counter()
    out = hf.generate(**enc, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                      pad_token_id=t.tokenizer.pad_token_id or 0)
    sync()
    secs = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1]:].tolist()
    toks = sum(next((i for i, x in enumerate(r) if x in eos), len(r)) for r in new)
    res["hf"] = {"answer_tokens": toks, "seconds": secs, "tok_s": toks / secs}
    res["ratio"] = {k: res[k]["tok_s"] / res["hf"]["tok_s"] for k in ("eager_kernels", "compiled")}
    return res


def env_flag(name: str) -> bool | None:
    """1 -> True, 0 -> False, unset -> None (the code's own default); anything else is an error."""
    v = os.environ.get(name)
    if v is None:
        return None
    if v not in ("0", "1"):
        raise SystemExit(f"{name}={v!r}: use 0 or 1, or leave it unset")
    return v == "1"


def draft_vocab() -> int | None:
    """DRAFT_VOCAB, else 8,192; with INIT_FROM, else that drafter's own (None)."""
    if v := os.environ.get("DRAFT_VOCAB"):
        return int(v)
    return None if os.environ.get("INIT_FROM") else 8192


def train_stage() -> dict:
    from draftsmith.train import TrainConfig, train

    vocab = next(WORK.rglob("vocab*.safetensors"), None)
    out = DRAFTER
    # Online (the target recomputes hidden states): ~5x the offline rate on the lent H200, whose
    # page faults slow shard reads. Rows of 1,024 tokens, 4 per step: ~120 steps an epoch at 2,000.
    train(TrainConfig(out=str(out), prompts=str(WORK / "answers.jsonl"), target=TARGET,
                      epochs=EPOCHS, lr=float(os.environ.get("LR", "5e-4")), warmup_ratio=0.03,
                      batch_size=TRAIN_BATCH, max_len=TRAIN_LEN,
                      draft_vocab_size=draft_vocab(),
                      num_layers=int(os.environ["DRAFT_LAYERS"]) if os.environ.get(
                          "DRAFT_LAYERS") else None,  # None: 1, or INIT_FROM's depth
                      intermediate_size=int(os.environ["DRAFT_INTER"]) if os.environ.get(
                          "DRAFT_INTER") else None,  # None: the target's, or INIT_FROM's
                      vocab=str(vocab) if vocab else None, device=DEVICE,
                      save_every=200, resume=True, progress=False, log_every=20,
                      profile_steps=int(os.environ.get("PROFILE_STEPS", "5")),
                      init_head=os.environ.get("INIT_HEAD", "random"),
                      max_samples=int(os.environ["MAX_SAMPLES"]) if "MAX_SAMPLES" in os.environ
                      else None, init_from=os.environ.get("INIT_FROM"),
                      time_limit=float(os.environ["TRAIN_SECONDS"]) if "TRAIN_SECONDS" in
                      os.environ else None,
                      compile_loss=env_flag("COMPILE_LOSS")))
    if not (out / "draftsmith.json").is_file():  # stopped by the time limit: call again
        from draftsmith.train.checkpoint import latest_checkpoint

        return {"stopped_at": str(latest_checkpoint(out))}
    if os.environ.get("KEEP", "1") == "1":  # bigrun keeps once, itself, right after training
        keep_stage()
    return json.loads((out / "draftsmith.json").read_text()).get("training", {})


PART_BYTES = 15 * 2**20  # each file that comes back from the device is <= 16 MiB


def keep_stage() -> dict:
    """DRAFTER's small files and its weights (embedding left out; floats as bf16, ints such as
    d2t kept) into $OUT/drafter: the weights as one xz-compressed safetensors blob in parts of
    at most PART_BYTES, as each file that comes back is <= 16 MiB (bf16 loses ~30 % to xz)."""
    from safetensors.torch import load_file, save

    keep = OUT / "drafter"
    keep.mkdir(parents=True, exist_ok=True)
    for f in DRAFTER.iterdir():
        if f.is_file() and f.suffix in (".json", ".jsonl", ".png", ".md", ".txt"):
            shutil.copy(f, keep / f.name)
    state = load_file(str(DRAFTER / "model.safetensors"))
    state.pop("embed_tokens.weight", None)  # the target's, frozen: not worth carrying back
    state = {k: (v.bfloat16() if v.is_floating_point() else v).contiguous()
             for k, v in state.items()}
    parts = write_parts(xz(save(state)), keep, "weights.safetensors.xz")
    return {"kept": sorted(p.name for p in keep.iterdir()), "weight_parts": parts}


def xz(blob: bytes) -> bytes:
    import lzma
    import subprocess

    if shutil.which("xz"):  # all cores: the lent machine has 16
        return subprocess.run(["xz", "-T0", "-6", "-c"], input=blob, check=True,
                              capture_output=True).stdout
    return lzma.compress(blob, preset=6)


def write_parts(blob: bytes, folder: Path, stem: str) -> int:
    """`blob` as folder/stem.00, .01, ... of at most PART_BYTES each; returns how many."""
    parts = [blob[i : i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)]
    for i, part in enumerate(parts):
        (folder / f"{stem}.{i:02d}").write_bytes(part)
    return len(parts)


def read_parts(files: list[Path]) -> bytes:
    """The reverse of xz + write_parts: parts joined in name order, then decompressed."""
    import lzma

    return lzma.decompress(b"".join(f.read_bytes() for f in sorted(files, key=lambda f: f.name)))


def pack_stage() -> dict:
    """WORK/answers.jsonl, xz-compressed, into $OUT/STEM.jsonl.xz.00, .01, ... (PACK_STEM, default
    answers; another stem, e.g. answers-s1, keeps a second dataset's parts apart): generated data
    that outlives the machine (it goes cold 30 s after a call, and runs/ with it)."""
    stem = os.environ.get("PACK_STEM", "answers")
    if not stem.startswith("answers") or "." in stem:
        raise SystemExit(f"PACK_STEM={stem!r}: a name starting with 'answers', without dots")
    blob = xz((WORK / "answers.jsonl").read_bytes())
    return {"parts": write_parts(blob, OUT, f"{stem}.jsonl.xz"), "bytes": len(blob)}


def unpack_stage() -> dict:
    """The reverse of pack: parts found in DATA_PARTS (folders, ':'-separated; the first folder
    holding a name wins), each dataset (stem) joined in name order, the datasets one after the
    other in stem order, into WORK/answers.jsonl, unless it is there already."""
    dest = WORK / "answers.jsonl"
    dirs = [Path(d) for d in os.environ.get("DATA_PARTS", "").split(":") if d]
    by_name: dict[str, Path] = {}  # a part in two folders (copied by call 0, still carried):
    for f in (f for d in dirs if d.is_dir() for f in d.glob("answers*.jsonl.xz.*")):
        by_name.setdefault(f.name, f)  # the first folder's copy, read once
    sets: dict[str, list[Path]] = {}
    for name, f in by_name.items():
        sets.setdefault(name.split(".jsonl.xz.")[0], []).append(f)
    if dest.is_file() or not sets:
        return {"unpacked": False, "parts": len(by_name)}
    data = b"".join(read_parts(sets[stem]) for stem in sorted(sets))  # raises if one is missing
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return {"unpacked": True, "parts": len(by_name), "datasets": sorted(sets),
            "conversations": data.count(b"\n")}


# in a restored drafter's folder: the kept folder it came from (h200.sh's bigrun trains over it)
RESTORED_FROM = "restored_from.txt"


def restore_stage() -> dict:
    """DRAFTER rebuilt from what keep_stage brought back (KEPT, default .drafter/): the small
    files as they were, the weight parts joined (or, from leases before 2026-12-01, the two
    model_a/b files merged), the embedding taken from the target. A drafter restored from
    another KEPT is replaced; one trained here is kept."""
    from safetensors.torch import load, load_file, save_file

    kept = Path(os.environ.get("KEPT", ".drafter"))
    marker = DRAFTER / RESTORED_FROM  # a drafter trained here has none and is never replaced
    source = str(kept.resolve())
    there = (DRAFTER / "model.safetensors").is_file()
    if not kept.is_dir() or there and (not marker.is_file() or marker.read_text() == source):
        return {"restored": False, "drafter": str(DRAFTER)}
    if marker.is_file():  # restored from another kept drafter earlier on this machine
        shutil.rmtree(DRAFTER)
    DRAFTER.mkdir(parents=True, exist_ok=True)
    state: dict = {}
    for f in sorted(kept.iterdir()):
        if f.name.startswith("model_") and f.suffix == ".safetensors":
            state.update(load_file(str(f)))
        elif f.is_file() and not f.name.startswith("weights.safetensors.xz."):
            shutil.copy(f, DRAFTER / f.name)
    if parts := list(kept.glob("weights.safetensors.xz.*")):
        state.update(load(read_parts(parts)))
    from draftsmith.targets import load_target

    embed = load_target(TARGET).weights["model.embed_tokens.weight"]  # no model build needed
    state["embed_tokens.weight"] = embed.to(torch.bfloat16)
    save_file(state, str(DRAFTER / "model.safetensors"))
    marker.write_text(source)
    return {"restored": True, "drafter": str(DRAFTER), "tensors": len(state)}


def suites(t) -> dict[str, list[list[int]]]:
    from draftsmith.bench.suites import suite_messages

    n = int(os.environ.get("PROMPTS", "8"))
    names = env_list("SUITES", "chat,humaneval")
    return {name: [t.chat_ids(m) for m in suite_messages(name, n)] for name in names}


def spec_stage() -> dict:
    os.environ.setdefault("DRAFTSMITH_HOST_TIMING", "1")  # a clock read per step, no sync
    from draftsmith.bench.run import warm_each
    from draftsmith.engine.generate import run_generation
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models.eagle3 import load_drafter

    t, model = target_and_model()
    drafter = None  # CHAIN= TREES=: the baselines alone, no drafter needed
    if any(settings(b) for b in SPEC_BATCHES):
        drafter = load_drafter(DRAFTER, DEVICE, DT, embed=model.embed.weight)
    rt = Runtime(model, max(SPEC_BATCHES), 1024, compile=COMPILE)
    rows = []
    for suite, prompts in suites(t).items():
        for b, params in ((b, p) for b in (SPEC_BATCHES if suite == "chat" else (1,))
                          for p in spec_params()):
            groups = batches(prompts, b) * int(os.environ.get("REPEATS", "1"))  # less noise
            tag = "" if params.greedy else f" T{params.temperature:g}"
            warm_each(lambda g, p=params: run_generation(rt, g, 8, p, t.eos_ids), groups)
            torch.manual_seed(0)  # each sampled run draws from the same seed
            base = measure(lambda g, p=params: run_generation(rt, g, NEW, p, t.eos_ids), groups)
            rows.append({"suite": suite, "batch": b, "setting": "baseline" + tag,
                         "temperature": params.temperature, **base})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
            for steps, topk, n, fuse in variants(settings(b)):
                dec = SpecDecoder(rt, drafter, steps, topk, n, params, fuse_bookkeeping=fuse)
                warm_each(lambda g, d=dec: d.generate(g, 8, t.eos_ids), groups)
                torch.manual_seed(0)
                r = measure(lambda g, d=dec: d.generate(g, NEW, t.eos_ids), groups)
                dec.profile = True
                prof = dec.generate(groups[0], NEW, t.eos_ids)
                r["phases"] = prof.phases.to_dict() if prof.phases else None
                r["speedup"] = r["tok_s"] / base["tok_s"]
                r["decode_speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
                if b == 1 and params.greedy:  # sampled rows differ from greedy by design
                    r["greedy_agreement"] = agreement(model, groups, base["tokens"], r["tokens"],
                                                      t.eos_ids)
                name = f"{steps}/{topk}/{n}" + (" eager-bk" if fuse is False else "") + tag
                rows.append({"suite": suite, "batch": b, "setting": name,
                             "temperature": params.temperature, **r})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    for r in rows:
        r.pop("tokens", None)
    from draftsmith.engine.speculative import SAMPLED_DRAFTS

    return {"new_tokens": NEW, "compile": COMPILE, "sampled_drafts": SAMPLED_DRAFTS, "rows": rows}


def spec_params() -> list:
    """The spec stage's sampling settings: SPEC_TEMPS (e.g. 0+0.7+1: greedy, then sampled at
    each temperature under the engine's DRAFTSMITH_SAMPLED_DRAFTS rule) with SPEC_TOP_P;
    default greedy only."""
    from draftsmith.engine.sampling import SamplingParams

    top_p = float(os.environ.get("SPEC_TOP_P", "1"))
    return [SamplingParams(float(x), top_p) for x in env_list("SPEC_TEMPS", "0")]


def settings(b: int) -> list[tuple[int, int, int]]:
    steps = env_list("CHAIN", "1,2,3,4,5,6,7" if b == 1 else "2,3,5")
    chain = [(int(s), 1, int(s) + 1) for s in steps]
    return chain + [tuple(int(x) for x in t.split("/")) for t in env_list("TREES", "3/4/8,5/8/16")]


def env_list(name: str, default: str) -> list[str]:
    """A list variable, split at "," or "+" (h200.sh's per-run VAR=value fields split at commas,
    so TREES=3/4/8+7/4/24 travels through them whole); empty items dropped."""
    return [x for x in re.split(r"[,+]", os.environ.get(name, default)) if x]


def variants(base: list[tuple[int, int, int]]) -> list[tuple[int, int, int, bool | None]]:
    """Each setting as the engine runs it; with BOOKKEEPING_AB=1 also with eager bookkeeping
    (compiled engines only), right after it in the same process."""
    ab = COMPILE and os.environ.get("BOOKKEEPING_AB") == "1"
    return [v for s in base for v in ([(*s, None), (*s, False)] if ab else [(*s, None)])]


def batches(prompts: list[list[int]], b: int) -> list[list[list[int]]]:
    rows = [prompts[i % len(prompts)] for i in range(max(b, len(prompts)))]
    return [rows[i : i + b] for i in range(0, len(rows) - b + 1, b)]


def measure(fn, groups) -> dict:
    from draftsmith.engine.spec_state import SpecResult

    runs = [fn(g) for g in groups]
    toks = sum(len(x) for r in runs for x in r.tokens)
    pre, dec = sum(r.prefill_s for r in runs), sum(r.decode_s for r in runs)
    host = [h for r in runs if (h := r.extra.get("host") if isinstance(r, SpecResult) else r.host)]
    # decode_tok_s: the tokens after the first over decode time alone (prefill is not a cycle)
    res = {"tok_s": toks / (pre + dec), "prefill_ms": 1e3 * pre / len(runs),
           "decode_tok_s": (toks - sum(len(r.tokens) for r in runs)) / dec,
           "tokens": [x for r in runs for x in r.tokens]}
    if host:  # DRAFTSMITH_HOST_TIMING=1: host ms a step launching graphs / waiting on the device
        n = sum(h["iterations"] for h in host)
        for key in ("launch_ms", "wait_ms"):
            res[f"host_{key}"] = sum(h.get(key, 0) * h["iterations"] for h in host) / max(n, 1)
    if isinstance(runs[0], SpecResult):
        m = SpecResult.merged(runs)
        res.update(accept_length=m.mean_accept_length, accept_hist=m.accept_hist,
                   position_acceptance=m.position_rates,
                   wall_cycle_ms=1e3 * dec / max(m.cycles, 1))  # vs the phases' cycle_ms
    return res


def agreement(model, groups, base, spec, eos) -> dict:
    """bench's check of speculative against plain greedy output over every decoded row, in the
    run reports' keys: the divergences, each with the target's top-2 logit gap at the first
    differing position (bf16 near-ties explain divergence; bench keeps the first 20)."""
    from draftsmith.bench.run import agreement as bench_agreement

    a = bench_agreement(model, groups, base, spec, eos)
    # rows: REPEATS decodes each prompt again (through run 18 only the first pass was checked
    # and "prompts" counted all rows)
    return {"rows": a["prompts"], "distinct_prompts": len({tuple(p) for g in groups for p in g}),
            "diverged": a["prompts"] - a["identical"],
            "top2_gaps_at_divergence": [round(d["top2_gap"], 4) for d in a["divergences"]]}


def doctor_stage() -> dict:
    from draftsmith.doctor import DoctorOptions, report_json, run_doctor
    from draftsmith.doctor.render import show

    rep = run_doctor(DoctorOptions(WORK / "dataset", DRAFTER, TARGET, "sglang",
                                   device=DEVICE, dtype=DT))
    show(rep)
    (OUT / "doctor.json").write_text(report_json(rep))  # strict: a NaN is null
    return {"exit_code": rep.exit_code(False)}


def tune_stage() -> dict:
    """`draftsmith tune` at each of TUNE_TEMPS (default 0: greedy; "0+0.7+1": three tunes, into
    OUT/tune, OUT/tune_t0.7, OUT/tune_t1), over TUNE_BATCHES, TUNE_STEPS, TUNE_TOPK;
    TUNE_REFILL=1: `--refill` (rows refilled as they end), into OUT/tune_refill...; "0+1": both,
    static first."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.tune.cli import run_tune

    src = Path(__file__).resolve().parents[1] / "src/draftsmith/bench/chat_suite.jsonl"
    batches = [int(b) for b in env_list("TUNE_BATCHES", "1,8,32")]
    steps, topk = int(os.environ.get("TUNE_STEPS", "6")), int(os.environ.get("TUNE_TOPK", "4"))
    reps = {}
    for refill in (r == "1" for r in env_list("TUNE_REFILL", "0")):
        for temp in (float(t) for t in env_list("TUNE_TEMPS", "0")):
            name = ("tune" if temp == 0 else f"tune_t{temp:g}") + ("_refill" if refill else "")
            t0 = time.time()
            rep = run_tune(DRAFTER, TARGET, src, batches, steps, NEW, 2, DEVICE, DT, COMPILE,
                           OUT / name, topk, SamplingParams(temp), refill=refill)
            key = f"T{temp:g}" + (" refill" if refill else "")
            reps[key] = {k: v for k, v in rep.items() if k != "costs"}
            reps[key]["wall_s"] = time.time() - t0
            print(json.dumps({"tune": key, "recommendations": rep["recommendations"]}),
                  flush=True)
    return reps["T0"] if list(reps) == ["T0"] else reps


if __name__ == "__main__":
    save()
    stage("restore", restore_stage)
    stage("unpack", unpack_stage)
    stage("data", data_stage)
    stage("gen", gen_stage)
    stage("pack", pack_stage)
    stage("hf", hf_stage)
    stage("train", train_stage)
    stage("spec", spec_stage)
    stage("doctor", doctor_stage)
    stage("tune", tune_stage)
    stage("keep", keep_stage)
