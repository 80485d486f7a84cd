#!/usr/bin/env bash
# Here, on the development machine (no GPU; nvcc 13.0 and gcc), from the project root after
# fetch_source.sh (beside this file): llama.cpp's CUDA backend for Hopper (sm_90, machine code only) built as a
# loadable library (GGML_BACKEND_DL, as llama.cpp's release builds ship it), so the GPU node builds only the CPU
# backend and the tools (build_dl.sh) instead of spending about 5.5 minutes of device time on CUDA. Output: .peers/
# ggml-cuda-sm90.so.xz.part-N (10 MB parts: the device tool's working tree, 49 MB, plus a call's carried paths must
# stay under 64 MiB, so the parts travel in two calls) and .peers/ggml-cuda-sm90.sha256 (the library and the source
# tarball it came from). Needs cuBLAS's headers and library to link: the nvidia-cublas wheel (pip, cu13), beside the
# toolkit's files in a merged folder, and a stub libcuda.so.1 that only names the driver's functions (the node's
# driver provides them). About 17 minutes on 2 cores. Usage: bash benchmarks/llama_cpp/prebuild_cuda.sh [WORKDIR]
set -euo pipefail
work=${1:-/tmp/llama-prebuild}; cuda=${CUDA_HOME:-/usr/local/cuda}
[ -f .peers/llama.cpp.tgz ] \
  || { echo "no .peers/llama.cpp.tgz: run benchmarks/llama_cpp/fetch_source.sh first" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"/{wheel,tk/lib/stubs,tk/include,src}
python3 -m pip download -q --no-deps "nvidia-cublas==13.*" -d "$work/wheel"
(cd "$work/wheel" && python3 -m zipfile -e nvidia_cublas-*.whl x)
tk=$work/tk
for d in bin nvvm targets; do ln -sfn "$cuda/$d" "$tk/$d"; done; ln -sfn lib "$tk/lib64"
for f in "$cuda"/include/* "$work"/wheel/x/nvidia/cu13/include/*; do ln -sf "$f" "$tk/include/"; done
for f in "$cuda"/lib64/*; do ln -sf "$f" "$tk/lib/"; done
for f in "$work"/wheel/x/nvidia/cu13/lib/*.so.13; do
  ln -sf "$f" "$tk/lib/"; ln -sf "$(basename "$f")" "$tk/lib/$(basename "$f" .13)"
done
gcc -E -P "$cuda/include/cuda.h" | grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' | sed 's/\s*(//' | sort -u \
  | awk '{print "int " $1 "(void) { return 999; }"}' > "$work/cuda_stub.c"
gcc -shared -fPIC -o "$tk/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$work/cuda_stub.c"
tar xzf .peers/llama.cpp.tgz -C "$work/src"
PATH=$tk/bin:$PATH cmake -S "$work/src/llama.cpp" -B "$work/build" -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_BUILD_TYPE=Release -DGGML_BACKEND_DL=ON -DBUILD_SHARED_LIBS=ON -DGGML_CPU=OFF -DGGML_NATIVE=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DCUDAToolkit_ROOT="$tk" -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" '-DCMAKE_BUILD_RPATH=$ORIGIN' \
  >/dev/null
PATH=$tk/bin:$PATH cmake --build "$work/build" -j "$(nproc)" --target ggml-cuda 2>&1 | grep -v warning | tail -2
strip --strip-unneeded -o "$work/libggml-cuda.so" "$work/build/bin/libggml-cuda.so"
rm -f .peers/ggml-cuda-sm90.so.xz.part-*
xz -T0 -9 -c "$work/libggml-cuda.so" | split -b 10M -d -a 1 - .peers/ggml-cuda-sm90.so.xz.part-
(cd "$work" && sha256sum libggml-cuda.so) > .peers/ggml-cuda-sm90.sha256
sha256sum .peers/llama.cpp.tgz >> .peers/ggml-cuda-sm90.sha256
ls -la .peers/ggml-cuda-sm90.*
