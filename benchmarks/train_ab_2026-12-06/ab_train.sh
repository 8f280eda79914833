#!/usr/bin/env bash
# A/B of online training speed: 9960a66 (ab_old/src) vs HEAD (ab_head/src), same machine, alternated
set -uo pipefail
cd "$(dirname "$0")/.."
gguf=/tmp/m/S.gguf
[ -f $gguf ] || cat /tmp/m/part0 .m2/part1 > $gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ab_head/.whl/gguf*.whl 2>/dev/null
export DRAFTSMITH_DEFAULT_GGUF=$gguf DRAFTSMITH_CACHE=/tmp/dcache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt; date -u | tee -a $OUT/device.txt
for round in 1 2; do for v in old head; do
  out=/tmp/runs/$v$round; rm -rf $out
  s=$SECONDS
  PYTHONPATH=/tmp/site:$PWD/ab_$v/src timeout 200 python3 -m draftsmith train --prompts ab_head/answers.jsonl --target default \
     --epochs ${EPOCHS:-2} --batch-size 4 --max-len 1024 --lr 5e-4 --warmup-ratio 0.05 --draft-vocab-size 8192 \
     --device cuda --save-every 10000 --out $out > $OUT/train_${v}$round.txt 2>&1
  echo "$v round $round: rc $? wall $((SECONDS - s)) s" | tee -a $OUT/summary.txt
  cp $out/train_log.jsonl $OUT/train_log_${v}$round.jsonl 2>/dev/null
  python3 - $out/train_log.jsonl <<'P' | tee -a $OUT/summary.txt
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ts = [r["tokens_per_s"] for r in rows][3:]
print(f"  windows {len(rows)}, tok/s median {statistics.median(ts):.0f} (min {min(ts):.0f}, max {max(ts):.0f}), final loss {rows[-1]['loss']:.3f}")
P
done; done
