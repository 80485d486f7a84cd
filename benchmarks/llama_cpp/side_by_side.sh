#!/usr/bin/env bash
# ON THE GPU NODE, from the project root, after build_dl.sh: llama.cpp and the project on the same random weights at
# the same GPU memory, in one call. MODEL: a preset; TYPE: q4_0 (default), q8_0 or bf16, the GGUF's and so the
# project's precision (--quantize int4, int8, none); NCMOE: llama-bench -ncmoe values (0: the whole model on the GPU);
# OURS: "N:policy,policy ..." runs `pdscope-jax bench` with --gpu-memory set to llama.cpp's peak at -ncmoe N;
# WORKLOAD: uniform (default) or skewed, the bench's rewrite of the random weights, exported so llama.cpp routes alike;
# DEADLINE (epoch seconds, optional) cuts the project's runs short (each writes its points as they end).
# OURS_CONTEXT_MIB: the project's GPU memory outside XLA's allocator (CUDA context, libraries; "auto": measured by
# jax_context_mib.py); when set, XLA's allocator is held to llama.cpp's peak less it (an error past it) and the
# budget is that less OURS_SLACK_MIB (a list: each next slack retried where a run ran out of memory; a policy
# written POLICY@S1+S2 in OURS has its own list).
# The project's runs are sampled by nvidia-smi as llama.cpp's are (mem-ours-*.log).
# 1. The project's weights as a TYPE GGUF (export_gguf.py, cached in .peers-build/; a partial export is discarded).
# 2. llama-bench per -ncmoe: prompts 512 and 4,096, NEW_TOKENS tokens (default 64), at depths DEPTHS (default
#    0,512,4096), -ub/-b 4096, 2 repetitions, every core; its peak GPU memory sampled by nvidia-smi every 250 ms.
# 3. The project's bench at each chosen peak: prompts PROMPTS (default "512 4096", ascending), NEW_TOKENS new tokens,
#    2 repeats, each policy in its own process, so that XLA's peak (a process's peak so far) is the policy's own.
# Writes under ${RES:-$OUT}: llama-MODEL-TYPE-nN.json (+ .err, mem-*.log), bench-MODEL-TYPE-nN-POLICY/,
# side_by_side-MODEL-TYPE.json (llama.cpp's peaks and rates per -ncmoe) and host-state.log (the host's load and
# unwritten page cache before each timed run: a fresh export's GBs still being written compete with either side).
# The device tool returns at most 8 files from $OUT: a call sets RES to a folder of its own and packs it into $OUT.
# Limits (s): EXPORT_LIMIT 300, LLAMA_LIMIT 150 (per -ncmoe), OURS_LIMIT 240 (per policy).
set -u
export PYTHONPATH=$PWD:$PWD/.peers-build/src/llama.cpp/gguf-py PYTHONUNBUFFERED=1
noise='^W0000\|^I0000\|^WARNING: All log\|cuda_executor\|^E0000'
type=${TYPE:-q4_0}; declare -A quantize=([q4_0]="--quantize int4" [q8_0]="--quantize int8" [bf16]="")
[ -n "${quantize[$type]+set}" ] || { echo "TYPE must be q4_0, q8_0 or bf16, got $type" >&2; exit 2; }
workload=${WORKLOAD:-uniform}; suffix=$([ "$workload" = uniform ] || echo "-$workload")
name=$MODEL-$type$suffix; mkdir -p .peers-build
out=${RES:-${OUT:-.}}; mkdir -p "$out"; bin=.peers-build/build/bin; G=.peers-build/$name.gguf; t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# a line of host-state.log before a timed run: its name, the 1-minute load, page cache not yet written (kB)
host_state() {
  local unwritten; unwritten=$(grep -E '^(Dirty|Writeback):' /proc/meminfo | tr -s ' ' | paste -sd' ')
  echo "$1: load $(cut -d' ' -f1 /proc/loadavg); $unwritten" >> "$out/host-state.log"
}
# seconds a run of ours may take now: OURS_LIMIT, cut to what is left before DEADLINE
run_limit() {
  local limit=${OURS_LIMIT:-240}
  [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - $(date +%s) )) -lt "$limit" ] && limit=$(( DEADLINE - $(date +%s) ))
  echo "$limit"
}
if [ ! -f "$G" ]; then
  timeout "${EXPORT_LIMIT:-300}" python3 benchmarks/export_gguf.py --model "$MODEL" --type "$type" \
    --workload "$workload" --out "$G.part" 2>&1 | grep -v "$noise" | grep -v "GiB written" | tail -4
  if [ "${PIPESTATUS[0]}" != 0 ]; then rm -f "$G.part"; say "the export failed or ran out of time"; exit 1; fi
  mv "$G.part" "$G"
  sync  # the export's pages written out now, not while either side is timed
  say "the export's pages written to disk"
fi
say "GGUF: $(du -h "$G" | cut -f1)"
declare -A peak
if [ -n "${OURS:-}" ] && [ "${OURS_CONTEXT_MIB:-}" = auto ]; then
  OURS_CONTEXT_MIB=$(python3 benchmarks/llama_cpp/jax_context_mib.py 2>/dev/null | tail -1)
  say "the project's CUDA context: ${OURS_CONTEXT_MIB} MiB"
fi
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
say "GPU memory used before any run: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1) MiB"
for n in ${NCMOE:-}; do
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$out/mem-$name-n$n.log" 2>/dev/null &
  sampler=$!
  host_state "llama.cpp -ncmoe $n"
  timeout "${LLAMA_LIMIT:-150}" $bin/llama-bench -m "$G" -ngl 99 -ncmoe "$n" -p 512,4096 -n "${NEW_TOKENS:-64}" \
    -d "${DEPTHS:-0,512,4096}" -ub 4096 -b 4096 -t "$(nproc)" -r 2 -o json > "$out/llama-$name-n$n.json" \
    2> "$out/llama-$name-n$n.err"
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  peak[$n]=$(sort -n "$out/mem-$name-n$n.log" | tail -1)
  say "llama.cpp -ncmoe $n done"
done
python3 - "$out" "$name" ${NCMOE:-} <<'PY'
import json, sys
out, name, runs = sys.argv[1], sys.argv[2], {}
for n in sys.argv[3:]:
    try:
        rows = json.load(open(f"{out}/llama-{name}-n{n}.json"))
    except (OSError, ValueError) as err:
        runs[n] = {"error": str(err)}
        continue
    mem = [int(v) for v in open(f"{out}/mem-{name}-n{n}.log").read().split() if v.isdigit()]
    runs[n] = {"peak_gpu_mib": max(mem, default=None), "tests": [
        {"test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}", "depth": r.get("n_depth", 0),
         "tok_s": r["avg_ts"], "samples_tok_s": r.get("samples_ts")} for r in rows]}
    print(f"llama.cpp -ncmoe {n}: peak {runs[n]['peak_gpu_mib']} MiB;",
          " ".join(f"{t['test']}@d{t['depth']} {t['tok_s']:.1f}" for t in runs[n]["tests"]))
json.dump({"model": name, "ncmoe": runs}, open(f"{out}/side_by_side-{name}.json", "w"), indent=1)
PY
for spec in ${OURS:-}; do
  n=${spec%%:*}; policies=${spec#*:}; mib=${peak[$n]:-}
  [ -n "$mib" ] || { say "no llama.cpp peak for -ncmoe $n: skipped"; continue; }
  for entry in ${policies//,/ }; do
    policy=${entry%@*}; slacks=${OURS_SLACK_MIB:-0}  # POLICY@S1+S2: this policy's own slacks
    [ "$entry" = "$policy" ] || slacks=$(echo "${entry#*@}" | tr + ' ')
    limit=$(run_limit)
    [ "$limit" -ge 60 ] || { say "no time left for $policy at -ncmoe $n"; continue; }
    held=$(( mib - ${OURS_CONTEXT_MIB:-0} ))
    for slack in $slacks; do  # several: the next is tried only where the run ran out of memory
      budget=$(( held - slack )); run="$out/bench-$name-n$n-${policy//:/_}"; rm -rf "$run"
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 \
        > "$out/mem-ours-$name-n$n-${policy//:/_}.log" 2>/dev/null &
      sampler=$!
      # with OURS_CONTEXT_MIB, XLA's allocator is held to llama.cpp's peak less our CUDA context: past it, an error
      fraction=$(python3 -c "print(f'{$held / $total_mib:.6f}')")
      host_state "$policy at -ncmoe $n, budget $budget MiB"
      env ${OURS_CONTEXT_MIB:+XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction} \
        timeout "$limit" python3 -m pdscope_jax bench --model "$MODEL" ${quantize[$type]} --workload "$workload" \
        --gpu-memory "${budget}MiB" --prompt-lens ${PROMPTS:-512 4096} --new-tokens "${NEW_TOKENS:-64}" --repeats 2 \
        --policies "$policy" --out "$run" > "$run.log" 2>&1
      status=$?
      grep -v "$noise" "$run.log" | grep -v "^\s*$" | grep -v "━\|───" | tail -8 | cut -c1-220
      kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
      say "$policy at -ncmoe $n's ${mib} MiB (budget ${budget} MiB${OURS_CONTEXT_MIB:+, XLA held to $held MiB}) done;" \
        "nvidia-smi peak $(sort -n "$out/mem-ours-$name-n$n-${policy//:/_}.log" | tail -1) MiB"
      # out of memory: a run that failed with RESOURCE_EXHAUSTED (not one cut by its time limit, status 124, and
      # not the decode bank's handled fallback to pieces, which warns with the allocator's message and goes on)
      [ "$status" != 0 ] && [ "$status" != 124 ] \
        && grep RESOURCE_EXHAUSTED "$run.log" | grep -qv "allocated in pieces" || break
      say "$policy ran out of memory with a ${slack} MiB slack (its log: $run.slack$slack.log)"
      mv "$run.log" "$run.slack$slack.log"
      limit=$(run_limit)
      [ "$limit" -ge 60 ] || break
    done
  done
done
