#!/usr/bin/env bash
# compare_trees.sh OLD_TREE LIMIT_S BENCH_ARGS... : run the same `pdscope-jax bench` for the tree at OLD_TREE
# (a checkout of an earlier commit) and for this one, one after the other on the same machine, each under
# its own time limit (LIMIT_S, or FIRST_LIMIT_S for the first, which also compiles), with one persistent
# compilation cache (identical programs compile once). ORDER ("new old" by default) sets which runs first:
# swap it between two calls to see the order's own effect. Writes $OUT/{new,old}/ (JSON + PNG) and
# $OUT/{new,old}.log; the bench saves partial JSON as it goes.
# A tree's commit is read from its COMMIT file where it has one (a copy outside git), else from git.
# Used to show that a change which should not change behaviour does not change throughput.
set -uo pipefail
cd "$(dirname "$0")/.."
old=$(cd "$1" && pwd); limit=$2; shift 2
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/pdscope_jax_cc}
watch=$(pwd)/scripts/run_watched.sh
first=1
for tree in ${ORDER:-new old}; do
  dir=$(pwd); [ "$tree" = old ] && dir=$old
  tree_limit=$limit; [ $first = 1 ] && tree_limit=${FIRST_LIMIT_S:-$limit}; first=0
  mkdir -p "$OUT/$tree"
  echo "=== $tree ($dir, commit $(cat "$dir/COMMIT" 2>/dev/null || git -C "$dir" rev-parse --short HEAD)) $(date +%T)"
  (cd "$dir" && PYTHONPATH=. bash "$watch" "$OUT/$tree.log" "$tree_limit" -m pdscope_jax bench "$@" --out "$OUT/$tree")
  tail -n 3 "$OUT/$tree.log"
done
