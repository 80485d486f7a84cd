"""Offload benchmark entry point; the logic and its options live in `pdscope_jax.bench.compare` (see its docstring).

    PYTHONPATH=. python benchmarks/bench.py --model deepseek-v2-lite --gpu-memory 24GB --expert-pool 8GB
"""

from pdscope_jax.bench.compare import main

if __name__ == "__main__":
    main()
