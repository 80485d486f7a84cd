#!/usr/bin/env bash
# The GPU-node measurements, as stages chained into a few device calls. Run from the repository root on the node:
#
#   OUT=$OUT bash scripts/gpu_session.sh STAGE[:SECONDS] [STAGE[:SECONDS] ...]
#
#   probe      store/transfer probe (benchmarks/probes/probe_store_gpu.py)
#   host       decode host time: helper-thread variants (ondemand pdscope static), then one dispatch's host
#              time idle and with copies in flight (benchmarks/probes/probe_decode_host.py, probe_dispatch.py)
#   cpu        XLA:CPU vs torch expert FFN (benchmarks/bench_cpu_expert.py; again per flag set in CPU_XLA_FLAGS)
#   plain      whole-model upper bound through the public API (benchmarks/bench_plain.py)
#   profile    the cost table of MODEL on this machine (`python -m pdscope_jax profile`)
#   smoke      ondemand, static and pdscope at the longest prompt, 16 tokens (does the offload path work here?)
#   trial      pdscope's decode executor chosen by its warm-up trial, beside the one-program step alone (:notrial)
#              and the host-planned loop alone (:host), on TRIAL_MODEL (default MODEL; mixtral-8x7b is where the
#              host loop led): the trial should decode at least as fast as the better of the two
#   uniform    every policy, uniform routing, BUDGET (`python -m pdscope_jax bench`, as are the stages below)
#   compare    a few policies (COMPARE_POLICIES) at the shortest and longest prompt, with a memory trace and a
#              host profile
#   memory     accelerator memory over MEMORY_STEPS decode steps (ondemand, pdscope), and a host profile (cProfile)
#   skewed     every policy on the skewed workload
#   ablation   greedy -> +h -> +i -> +p+a -> +g+c at the longest prompt (skewed)
#   cores      static and pdscope decode, XLA:CPU's threads on every core, then on XLA_CPU_CORES
#   batches    BATCHES (1 8 16 32) x BATCH_POLICIES at 512 tokens, chunked prefill of 256 (skewed)
#   predictors MODEL traces -> PhasePer -> Orbax -> evaluation (benchmarks/eval_predictors.py), timed end to end
#   qwen       whole-model (QWEN_PLAIN=1, empty: skip) and offloaded QWEN at QWEN_LENGTHS, QWEN_POLICIES
#   ep         EP_MODEL (default QWEN) offloaded on 1 and on EP_ACCELERATORS (2) GPUs side by side, each GPU with
#              BUDGET's pool, EP_POLICIES (ondemand[:host] pdscope[:host]) at EP_LENGTHS (128 and the longest): needs a
#              multi-GPU kind (docs/SCALING.md, "Plan for the GPU runs")
# Building an offloaded model takes a while per benchmark process, so long stages (uniform, skewed, ablation)
# want a device call each. BENCH_EXTRA: more bench options for `uniform` and `skewed` (e.g. --cprofile 8 for a
# host profile and timeline). Each stage runs under its own time limit (STAGE:SECONDS, default 240 s) and the
# chain goes on when one fails; every stage logs to <results>/<stage>.log (RESULTS, default /tmp/pdscope_results).
# Benchmarks save partial JSON as they go. With OUT set, everything ends up in one archive, $OUT/results.tgz
# (the device tool returns few files). Every benchmark here uses the real architectures with random weights;
# the JSON files say so.
# Smaller settings (a CPU smoke test of the commands): MODEL=tiny-deepseek-v2-lite QWEN=tiny-qwen3-30b-a3b
# LENGTHS="32 64" TOKENS=4 BUDGET="--gpu-memory 1GB --expert-pool 200KB" MEMORY_STEPS=8 PROBE_ARGS="--experts 8
# --hidden 64 --intermediate 32 --matmul 256" CPU_EXPERT_ARGS="--hidden 64 --intermediate 32" PREDICTOR_ARGS=...
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
res=${RESULTS:-/tmp/pdscope_results}
mkdir -p "$res"
model=${MODEL:-deepseek-v2-lite}
qwen=${QWEN:-qwen3-30b-a3b}
read -r -a lengths <<< "${LENGTHS:-128 512 1024 2048 4096}"
read -r -a budget <<< "${BUDGET:---gpu-memory 24GB --expert-pool 8GB}"
tokens=${TOKENS:-64}
longest=${lengths[-1]}
costs=${COSTS:-$res/costs_${model}.json}  # COSTS: a cost table from an earlier run
# HOST_ALLOC: bench --host-alloc (default auto: torch where it has CUDA, one pinned allocation per layer, from which
# device decode copies a layer's misses at once)
bench=(python3 -m pdscope_jax bench --new-tokens "$tokens" "${budget[@]}" ${HOST_ALLOC:+--host-alloc "$HOST_ALLOC"} --out "$res")

run_stage() {  # name, then the commands as one string
  local name=$1
  echo "=== $name (limit ${limit}s) $(date +%T)"
  local start=$SECONDS
  timeout -k 10 "$limit" bash -c "set -euo pipefail; $2" > "$res/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - start))s"
  tail -n 25 "$res/$name.log"
}

for arg in "$@"; do
  stage=${arg%%:*}
  limit=240
  [[ $arg == *:* ]] && limit=${arg#*:}
  case "$stage" in
    probe) run_stage probe "python3 benchmarks/probes/probe_store_gpu.py ${PROBE_ARGS:-} --out $res/probe_store_gpu.json" ;;
    host) run_stage host "
      python3 benchmarks/probes/probe_decode_host.py --model $model ${budget[*]} --policies ondemand pdscope static \
        \$( [ -f $costs ] && echo --cost-table $costs ) --out $res/probe_decode_host.json
      python3 benchmarks/probes/probe_dispatch.py --model $model --out $res/probe_dispatch.json" ;;
    cpu) run_stage cpu "python3 benchmarks/bench_cpu_expert.py ${CPU_EXPERT_ARGS:-} --out $res/cpu_expert_vs_torch.json
      for flag in ${CPU_XLA_FLAGS:-}; do  # XLA:CPU options to compare, e.g. --xla_cpu_use_xnnpack=true
        XLA_FLAGS=\$flag python3 benchmarks/bench_cpu_expert.py ${CPU_EXPERT_ARGS:-} \
          --out $res/cpu_expert_\${flag//[^a-z0-9]/_}.json || true
      done" ;;
    plain) run_stage plain "
      python3 benchmarks/bench_plain.py --model $model --lengths ${lengths[*]} --new-tokens $tokens --repeats 2 \
        --out $res" ;;
    profile) run_stage profile "python3 -m pdscope_jax profile $model ${PROFILE_ARGS:-} --out $costs" ;;
    smoke) run_stage smoke "
      ${bench[*]} --model $model --prompt-lens $longest --policies ondemand static pdscope --cost-table $costs \
        --repeats 1 --new-tokens 16" ;;
    trial) run_stage trial "
      ${bench[*]} --model ${TRIAL_MODEL:-$model} --prompt-lens 512 $longest --policies pdscope pdscope:notrial \
        pdscope:host --cost-table $costs --repeats 3" ;;
    uniform) run_stage uniform "
      ${bench[*]} --model $model --prompt-lens ${lengths[*]} --policies ondemand static greedy pdscope fate plain \
        --hot-table auto --cost-table $costs --repeats 1 ${BENCH_EXTRA:-}" ;;
    compare) run_stage compare "
      ${bench[*]} --model $model --prompt-lens ${COMPARE_LENGTHS:-${lengths[0]} $longest} \
        --policies ${COMPARE_POLICIES:-ondemand static pdscope} --hot-table auto --cost-table $costs --repeats 1 \
        --cprofile ${PROFILE_TOKENS:-8} --track-memory ${MEMORY_STEPS:-300}" ;;
    memory) run_stage memory "
      ${bench[*]} --model $model --prompt-lens ${lengths[0]} --policies ondemand pdscope --cost-table $costs \
        --repeats 1 --new-tokens 8 --cprofile ${PROFILE_TOKENS:-8} --track-memory ${MEMORY_STEPS:-1000}" ;;
    skewed) run_stage skewed "
      ${bench[*]} --model $model --workload skewed --prompt-lens ${SKEWED_LENGTHS:-${lengths[*]}} \
        --policies ${SKEWED_POLICIES:-static ondemand greedy pdscope fate} --hot-table auto --cost-table $costs --repeats 1 \
        ${BENCH_EXTRA:-}" ;;
    ablation) run_stage ablation "
      ${bench[*]} --model $model --workload skewed --ablation --prompt-lens $longest --cost-table $costs --repeats 1" ;;
    cores) run_stage cores "
      for cores in \$(nproc) ${XLA_CPU_CORES:-14}; do  # XLA:CPU's threads on all cores, then on fewer
        ${bench[*]} --model $model --prompt-lens ${lengths[0]} --policies static pdscope --hot-table auto \
          --cost-table $costs --repeats 1 --new-tokens 32 --xla-cpu-cores \$cores
      done" ;;
    batches) run_stage batches "
      ${bench[*]} --model $model --workload skewed --prompt-lens 512 --batch ${BATCHES:-1 8 16 32} \
        --policies ${BATCH_POLICIES:-greedy pdscope} --hot-table auto --cost-table $costs --repeats 1" ;;
    predictors) run_stage predictors "
      start=\$(date +%s)
      for split in train heldout; do
        python3 -m pdscope_jax collect-traces --model $model --weights random --out $res/traces-\$split \
          --split \$split ${PREDICTOR_ARGS:---prompts 64 --prompt-len 512 --decode-steps 32 --batch 8}
      done
      python3 -m pdscope_jax train-predictors --traces $res/traces-train --model $model --out $res/predictors \
        --no-progress --groups-png $res/layer_groups_$model.png ${TRAIN_ARGS:-}
      echo \"{\\\"offline_phase_seconds\\\": \$(( \$(date +%s) - start )), \\\"weights\\\": \\\"random\\\", \\\"command\\\": \\\"gpu_session.sh predictors (collect-traces train+heldout, train-predictors)\\\"}\" > $res/predictors_${model}_time.json
      python3 benchmarks/eval_predictors.py --model $model --predictors $res/predictors/$model \
        --train-traces $res/traces-train --eval heldout=$res/traces-heldout \
        --out-json $res/predictors_$model.json --out-png $res/predictors_$model.png
      du -sb $res/predictors/$model
      rm -rf $res/traces-train $res/traces-heldout" ;;
    qwen) run_stage qwen "
      if [ -n \"${QWEN_PLAIN-1}\" ]; then
        python3 benchmarks/bench_plain.py --model $qwen --lengths ${QWEN_LENGTHS:-512 $longest} --new-tokens $tokens \
          --repeats 1 --out $res
      fi
      python3 -m pdscope_jax profile $qwen ${PROFILE_ARGS:-} --out $res/costs_$qwen.json
      ${bench[*]} --model $qwen --prompt-lens ${QWEN_LENGTHS:-512 $longest} \
        --policies ${QWEN_POLICIES:-static ondemand greedy fate pdscope} --hot-table auto \
        --cost-table $res/costs_$qwen.json --repeats 1" ;;
    ep) run_stage ep "
      for n in 1 ${EP_ACCELERATORS:-2}; do
        ${bench[*]} --model ${EP_MODEL:-$qwen} --accelerators \$n --prompt-lens ${EP_LENGTHS:-128 $longest} \
          --policies ${EP_POLICIES:-ondemand ondemand:host pdscope pdscope:host} --repeats 2 --new-tokens 32
      done" ;;
    *) sed -n '2,/^set /{/^#/p}' "$0"; exit 2 ;;  # the usage above
  esac
done
if [ -n "${OUT:-}" ]; then
  tar -C "$res" --exclude='./traces-*' --exclude='./predictors' -czf "$OUT/results.tgz" . && ls -la "$OUT"
fi
