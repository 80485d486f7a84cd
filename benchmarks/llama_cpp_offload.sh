#!/usr/bin/env bash
# ON THE GPU NODE, after ../shared/tools/llama-cpp/build-cuda.sh (carried as .peers/, see that folder's README):
# llama.cpp on a random bf16 DeepSeek-V2-Lite (ds2_lite_gguf.py) with its expert offload at ~24 GB (-ncmoe 9) and
# ~12 GB (-ncmoe 20) and whole, decode also at depth 512 (the project decodes after its prompt); peak GPU memory
# sampled by nvidia-smi every 250 ms. Writes llama-NAME.json and mem-NAME.log under ${OUT:-.}.
set -u
out=${OUT:-.}; G=.peers-build/ds2-bf16.gguf; bin=.peers-build/build/bin
[ -f $G ] || python3 .peers/ds2_lite_gguf.py $G .peers-build/src/llama.cpp/gguf-py || exit 1
run() {
  local name=$1; local limit=$2; shift 2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$out/mem-$name.log" 2>/dev/null & local sp=$!
  timeout $limit $bin/llama-bench "$@" -t "$(nproc)" -o json > "$out/llama-$name.json" 2>/dev/null
  kill $sp 2>/dev/null
  python3 - "$out/llama-$name.json" "$name" "$(sort -n "$out/mem-$name.log" | tail -1)" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no result", e); raise SystemExit
print(sys.argv[2], "peak GPU MiB", sys.argv[3], " ".join(
    f"{'pp' + str(r['n_prompt']) if r['n_prompt'] else 'tg' + str(r['n_gen'])}@d{r.get('n_depth', 0)}={r['avg_ts']:.1f}" for r in rows))
PY
}
run ncmoe9 120 -m $G -ngl 99 -ncmoe 9 -p 512,4096 -n 64 -d 0,512 -ub 4096 -b 4096 -r 3
run ncmoe20 120 -m $G -ngl 99 -ncmoe 20 -p 512,4096 -n 64 -d 0,512 -ub 4096 -b 4096 -r 3
run gpu 60 -m $G -ngl 99 -p 512 -n 64 -d 0,512 -ub 4096 -b 4096 -r 3
