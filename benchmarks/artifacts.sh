#!/usr/bin/env bash
# Big outputs of lent-GPU runs live in git history, not in the tree: every tracked file travels
# with each device call, and the 64 MiB carry must hold a GGUF half (49.2 MB). A session's
# ignored folders do not outlive it, so history is where a drafter and its data survive.
#
#   bash benchmarks/artifacts.sh list              # what is kept, and at which commit
#   bash benchmarks/artifacts.sh restore [NAME]    # into the ignored folders the recipe carries
#
# run6 (H200, 2026-12-01): .dataA/answers.jsonl.xz.00 (48,000 self-made prompts + greedy
# answers, 8.4 MB) and .kept26/ (the drafter trained 2 epochs on them, vocab 24,576, 27.3 MB).
# run7 (H200, 2026-12-01): .kept27/ (.kept26 trained 4 more epochs on the same answers, 27.3 MB):
# 1.86x decode-only at batch 1 (speculative_default.md, run 7).
# run8 (H200, 2026-12-01): .dataB/answers-s1.jsonl.xz.00 (48,000 more self-made prompts, seed 1,
# with greedy answers, 8.5 MB) and .kept28/ (.kept27 trained 2 epochs on both 48K sets, 27.3 MB):
# the best drafter so far (speculative_default.md, run 8).
# run17 (H200, 2026-12-02): .kept17/ (.kept28 with its MLP widened 1,536 -> 6,144, trained 2 more
# epochs on both 48K sets, 38.7 MB in three parts: carry it alone, not beside .m2): not yet
# measured speculatively (speculative_default.md, run 17); run 18 timed it: 1.89x decode-only at
# batch 1, tree 7/4/24 (.kept28: 1.83x), the best drafter timed so far.
# run18 (H200, 2026-12-02): .dataC/answers-s2.jsonl.xz.00 (48,000 more self-made prompts, seed 2,
# with greedy answers, 8.5 MB) and .kept18/ (.kept17 trained 1 epoch on those alone, 38.6 MB in
# three parts: carry it alone) (speculative_default.md, run 18).
# run19 (H200, 2026-12-02): .kept19/ (.kept17 trained 1 more epoch on the first 108,000 of the
# three 48K sets, 38.6 MB in three parts: carry it alone): 1.89x decode-only at batch 1 on chat
# and 2.14x on HumanEval, tree 7/4/24, 16 prompts (.kept17 in the same call: 1.82x and 2.10x),
# the best drafter timed then (speculative_default.md, run 19).
# run34 (H100, 2026-12-07): .kept34/ (.kept19 trained 1 more epoch on HEAD's code, whose target
# RMSNorm rounds as HF's since ed8c500, on the same first 108,000 conversations, 38.6 MB in three
# parts: carry it alone): 2.07-2.08x decode-only at batch 1 on chat and 2.35x on HumanEval, tree
# 7/4/24, 16 prompts (.kept19 in the same lease: 1.97-1.98x and 2.31x), the best drafter timed
# so far (speculative_default.md, run 34).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

# name  commit  path in that commit  folder here
ARTIFACTS="
run6-answers 116c00c benchmarks/artifacts/run6/answers .dataA
run6-drafter 116c00c benchmarks/artifacts/run6/drafter .kept26
run7-drafter c60d6b5 benchmarks/artifacts/run7/drafter .kept27
run8-answers a1b4bec benchmarks/artifacts/run8/answers-s1 .dataB
run8-drafter a1b4bec benchmarks/artifacts/run8/drafter .kept28
run17-drafter d412aec benchmarks/artifacts/run17/drafter .kept17
run18-answers 82a44af benchmarks/artifacts/run18/answers-s2 .dataC
run18-drafter 82a44af benchmarks/artifacts/run18/drafter .kept18
run19-drafter 1e29bdc benchmarks/artifacts/run19/drafter .kept19
run34-drafter 1302f7e benchmarks/artifacts/run34/drafter .kept34
"

restore_one() {  # name commit path folder
    local files exclude
    files=$(git ls-tree -r --name-only "$2" -- "$3/" 2>/dev/null) \
        || { echo "$1: commit $2 is not in this clone (a shallow or squashed copy?)" >&2; exit 1; }
    [ -n "$files" ] || { echo "$1: nothing under $3 at commit $2" >&2; exit 1; }
    mkdir -p "$4"
    for f in $files; do git cat-file blob "$2:$f" > "$4/$(basename "$f")"; done
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qxF "/$4/" "$exclude" 2>/dev/null || echo "/$4/" >> "$exclude"
    echo "$1 -> $4/ ($(du -sh "$4" | cut -f1))"
}

case "${1:-list}" in
list) echo "$ARTIFACTS" | sed '/^$/d' ;;
restore)
    found=0
    while read -r name commit path folder; do
        [ -n "$name" ] || continue
        [ -z "${2:-}" ] || [[ "$name" == "$2"* ]] || continue
        restore_one "$name" "$commit" "$path" "$folder"
        found=1
    done <<< "$ARTIFACTS"
    [ "$found" = 1 ] || { echo "no artifact named ${2:-}*: see \`$0 list\`" >&2; exit 1; }
    ;;
*) echo "usage: benchmarks/artifacts.sh list|restore [NAME]" >&2; exit 2 ;;
esac
