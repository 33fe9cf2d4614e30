#!/usr/bin/env bash
# Bytes each planned device call sends (benchmarks/gpu_check.sh, top): the working tree that
# travels (tracked files plus untracked files git does not ignore) plus that call's carried
# .gpu_carry paths, against the 64 MiB limit of one call.
#   bash scripts/gpu_call_sizes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((64 << 20))
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) |
    xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
printf 'working tree that travels: %.2f MiB\n' "$(echo "$tree / 1048576" | bc -l)"
call() { # $1 label, then the carried paths
    local label=$1 bytes
    shift
    bytes=$(du -cb "$@" | tail -n 1 | cut -f1)
    bytes=$((bytes + tree))
    printf '%s: %.1f MiB of 64 (%s)%s\n' "$label" "$(echo "$bytes / 1048576" | bc -l)" "$*" \
        "$( ((bytes > limit)) && echo '  OVER THE LIMIT')"
}
call "call 1" .gpu_carry/wheels/study
call "call 2" .gpu_carry/model-1 .gpu_carry/wheels/suite
call "call 3" .gpu_carry/model-2 .gpu_carry/wheels/model
