#!/usr/bin/env bash
# The device tool copies the working tree with each call, 64 MiB in all with what it carries.
# The committed benchmark outputs are ~22 MB of it, so the default target (98 MB) has gone over
# in four calls of ~25 MB (.m5 .m6 .m3 .m4). With them moved aside the tree is ~3 MB, and the
# model goes in two calls (.m1, then .m2 with .whl) and .kept19 (38.7 MB) in one.
#   bash benchmarks/device_tree.sh slim      # output folders (no .py/.sh in them) -> $HOLD
#   bash benchmarks/device_tree.sh restore   # back, before any commit
# Nothing is deleted: `git status` shows the moved folders as deleted until `restore`.
set -euo pipefail
cd "$(dirname "$0")/.."
HOLD=${HOLD:-/tmp/draftsmith_hold}
case "${1:-}" in
slim)
    mkdir -p "$HOLD"
    for d in $(git ls-files benchmarks | awk -F/ 'NF > 2 {print $2}' | sort -u); do
        [ -d "benchmarks/$d" ] || continue
        git ls-files "benchmarks/$d" | grep -q '\.py$\|\.sh$' && continue
        [ -e "$HOLD/$d" ] && { echo "$HOLD/$d exists: restore first"; exit 1; }
        mv "benchmarks/$d" "$HOLD/"
    done
    echo "tracked files left: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
    ;;
restore)
    [ -d "$HOLD" ] || { echo "nothing held in $HOLD"; exit 0; }
    for d in "$HOLD"/*; do
        [ -e "$d" ] || continue
        [ -e "benchmarks/$(basename "$d")" ] && { echo "benchmarks/$(basename "$d") exists"; exit 1; }
        mv "$d" benchmarks/
    done
    git status --short -- benchmarks | head
    ;;
*)
    echo "usage: benchmarks/device_tree.sh slim|restore"; exit 2
    ;;
esac
