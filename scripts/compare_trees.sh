#!/usr/bin/env bash
# compare_trees.sh OLD_TREE LIMIT_S BENCH_ARGS... : run the same `pdscope-jax bench` for the tree at OLD_TREE
# (a checkout of an earlier commit) and for this one, one after the other on the same machine, each under
# its own time limit, with one persistent compilation cache (identical programs compile once). Writes
# $OUT/{new,old}/ (JSON + PNG) and $OUT/{new,old}.log; the bench saves partial JSON as it goes.
# Used to show that a change which should not change behaviour does not change throughput.
set -uo pipefail
cd "$(dirname "$0")/.."
old=$(cd "$1" && pwd); limit=$2; shift 2
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/pdscope_jax_cc}
watch=$(pwd)/scripts/run_watched.sh
for tree in new old; do
  dir=$(pwd); [ "$tree" = old ] && dir=$old
  mkdir -p "$OUT/$tree"
  echo "=== $tree ($dir, $(git -C "$dir" rev-parse --short HEAD 2>/dev/null || cat "$dir/COMMIT")) $(date +%T)"
  (cd "$dir" && PYTHONPATH=. bash "$watch" "$OUT/$tree.log" "$limit" -m pdscope_jax bench "$@" --out "$OUT/$tree")
  tail -n 3 "$OUT/$tree.log"
done
