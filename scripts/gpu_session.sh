#!/usr/bin/env bash
# The GPU-node measurements the open issues ask for, in stages that each fit one device call (< 10 min).
# Run from the repository root on the GPU node; results land in $OUT (or benchmarks/results when OUT is unset).
#
#   bash scripts/gpu_session.sh probe      store/transfer probe, XLA:CPU vs torch expert FFN     (~3 min)
#   bash scripts/gpu_session.sh plain      whole-model upper bound, DeepSeek-V2-Lite + Qwen3      (~7 min)
#   bash scripts/gpu_session.sh offload    profile + all policies, DeepSeek-V2-Lite, uniform      (~9 min)
#   bash scripts/gpu_session.sh skewed     all policies on the skewed workload + ablation         (~9 min)
#   bash scripts/gpu_session.sh memory     GPU memory over 1,000 decode steps                     (~4 min)
#   bash scripts/gpu_session.sh predictors DeepSeek-V2-Lite traces -> PhasePer -> Orbax, timed   (~8 min)
#   bash scripts/gpu_session.sh qwen       all policies, Qwen3-30B-A3B                            (~9 min)
#
# Every benchmark here uses the real architectures with random weights; the JSON files say so.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
budget=(--gpu-memory 24GB --expert-pool 8GB)
lengths=(--prompt-lens 128 512 1024 2048 4096)

case "${1:-}" in
  probe)
    python3 scripts/probe_store_gpu.py --out "$out/probe_store_gpu.json"
    python3 scripts/bench_cpu_expert.py --out "$out/cpu_expert_vs_torch.json"
    ;;
  plain)
    python3 scripts/bench_plain.py --model deepseek-v2-lite --repeats 2 --out "$out"
    python3 scripts/bench_plain.py --model qwen3-30b-a3b --repeats 2 --out "$out"
    ;;
  offload)
    python3 -m pdscope_jax profile deepseek-v2-lite --out "$out/costs_deepseek-v2-lite_h200.json"
    python3 -m pdscope_jax bench --model deepseek-v2-lite "${lengths[@]}" --new-tokens 64 "${budget[@]}" \
      --policies plain static ondemand greedy fate pdscope --hot-table auto \
      --cost-table "$out/costs_deepseek-v2-lite_h200.json" --repeats 2 --out "$out"
    ;;
  skewed)
    python3 -m pdscope_jax bench --model deepseek-v2-lite --workload skewed "${lengths[@]}" --new-tokens 64 \
      "${budget[@]}" --policies static ondemand greedy fate pdscope --hot-table auto \
      --cost-table "$out/costs_deepseek-v2-lite_h200.json" --repeats 1 --out "$out"
    python3 -m pdscope_jax bench --model deepseek-v2-lite --workload skewed --ablation --prompt-lens 4096 \
      --new-tokens 64 "${budget[@]}" --hot-table auto --cost-table "$out/costs_deepseek-v2-lite_h200.json" \
      --repeats 1 --out "$out"
    ;;
  memory)
    python3 -m pdscope_jax bench --model deepseek-v2-lite --policies ondemand --prompt-lens 128 --new-tokens 16 \
      "${budget[@]}" --track-memory 1000 --repeats 1 --out "$out"
    ;;
  predictors)
    start=$(date +%s)
    python3 -m pdscope_jax collect-traces --model deepseek-v2-lite --weights random --out /tmp/traces-dsv2 \
      --split train --prompts 64 --prompt-len 512 --decode-steps 32 --batch 8
    python3 -m pdscope_jax train-predictors --traces /tmp/traces-dsv2 --model deepseek-v2-lite --out /tmp/predictors \
      --groups-png "$out/layer_groups_deepseek-v2-lite.png"
    echo "{\"offline_phase_seconds\": $(( $(date +%s) - start ))}" > "$out/predictors_deepseek-v2-lite_time.json"
    ;;
  qwen)
    python3 -m pdscope_jax bench --model qwen3-30b-a3b --prompt-lens 512 4096 --new-tokens 64 "${budget[@]}" \
      --policies static ondemand greedy fate pdscope --hot-table auto --repeats 1 --out "$out"
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
