"""GPU memory a JAX process holds outside XLA's allocator (the CUDA context, the libraries' handles), in MiB.

What: nvidia-smi's used memory while this process holds a warm matmul program, less the GPU's used memory before
the process started JAX, less what XLA's allocator reserved (no preallocation, so it reserves what it uses). Printed
as one integer. `side_by_side.sh` takes it with OURS_CONTEXT_MIB=auto, so that the project's allocator is held to
llama.cpp's nvidia-smi peak less it, and both sides' nvidia-smi figures compare. Run on the GPU node:
    python3 benchmarks/llama_cpp/jax_context_mib.py
"""

import os
import subprocess


def used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def main() -> None:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # read before JAX's backends start
    before = used_mib()
    import jax
    import jax.numpy as jnp

    x = jnp.ones((4096, 4096), jnp.bfloat16)
    jax.jit(lambda a: (a @ a).sum())(x).block_until_ready()
    stats = jax.devices()[0].memory_stats() or {}
    reserved = stats.get("pool_bytes") or stats.get("bytes_reserved") or stats.get("bytes_in_use", 0)
    print(max(0, used_mib() - before - reserved // 2**20))


if __name__ == "__main__":
    main()
