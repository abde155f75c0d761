#!/usr/bin/env bash
# One `loom bench` A/B on one lent GPU machine: the working tree against some of its files as they were at
# an earlier commit, back to back, so both figures come from the same card (cards of one kind differ by a
# few percent, more than many a change is worth).
#
#   bash tools/device_ab.sh prepare REV FILE...      here: FILE as at REV goes to .ab/FILE (ignored; carry .ab);
#                                                    .ab holds only these files afterwards
#   bash tools/device_ab.sh run NAME LIMIT_S -- BENCH_ARGS...
#                                                    there: NAME_new on the tree, NAME_old with .ab's files in
#
# `run` puts the tree's own files back when it ends, however it ends (it keeps them meanwhile in a scratch
# folder, not among the results). Results (JSON and each run's output) go to $OUT/ab (out/ab without $OUT);
# the summary lines are printed.
set -uo pipefail
usage() { echo "usage: bash tools/device_ab.sh prepare REV FILE... | run NAME LIMIT_S -- BENCH_ARGS..." >&2; exit 2; }
[ $# -ge 2 ] || usage
mode=$1
shift
case $mode in
prepare)
    rev=$1
    shift
    [ $# -gt 0 ] || usage
    rm -rf .ab  # files left by an earlier A/B would be swapped in too
    for file in "$@"; do
        mkdir -p ".ab/$(dirname "$file")"
        git show "$rev:$file" > ".ab/$file" || { echo "device_ab: $file is not in $rev" >&2; exit 2; }
    done
    echo "device_ab: $# file(s) as at $rev in .ab/ (carry .ab with the call)" ;;
run)
    [ $# -ge 3 ] && [ "$3" = "--" ] || usage
    name=$1 limit=$2
    shift 3
    [ -d .ab ] || { echo "device_ab: no .ab folder: run 'prepare' here and carry .ab" >&2; exit 2; }
    source "$(dirname "$0")/device_env.sh"
    out="${OUT:-out}/ab"
    mkdir -p "$out"
    tree=$(mktemp -d)
    mapfile -t files < <(cd .ab && find . -type f | sed 's|^\./||')
    for file in "${files[@]}"; do mkdir -p "$tree/$(dirname "$file")"; cp "$file" "$tree/$file"; done
    restore() { for file in "${files[@]}"; do cp "$tree/$file" "$file"; done; rm -rf "$tree"; }
    trap restore EXIT
    for side in new old; do
        [ "$side" = old ] && for file in "${files[@]}"; do cp ".ab/$file" "$file"; done
        echo "== ${name}_$side"
        timeout "$limit" python3 -m loom_live.plugin.cli bench --bridge none --no-baseline \
            --json "$out/${name}_$side.json" "$@" > "$out/${name}_$side.txt" 2>&1
        echo "   exit $?"
        grep -E "^(FPS|latency|jitter|stage)|^profile(:| family)" "$out/${name}_$side.txt"
    done ;;
*) usage ;;
esac
