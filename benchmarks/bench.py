"""Offload benchmark entry point, the same as `pdscope-jax bench` (options: `pdscope_jax.cli.bench`).

    PYTHONPATH=. python benchmarks/bench.py --model deepseek-v2-lite --gpu-memory 24GB --expert-pool 8GB
"""

from pdscope_jax.cli.bench import main

if __name__ == "__main__":
    main()
