#!/usr/bin/env bash
# Here, on the development machine, from the project root after fetch_source.sh (beside this file): llama.cpp's
# CPU side as build_dl.sh builds it on the GPU node (GGML_BACKEND_DL, the CPU backend in every x86 variant, the
# best one for the node's CPU chosen as it loads, libllama, llama-bench / llama-quantize / llama-completion), so that
# a call unpacks it instead of spending about two minutes of device time building it. Libraries find each other
# beside themselves ($ORIGIN). Output: .peers/llama-cpu.tar.xz (bin/ of the build, stripped) and
# .peers/llama-cpu.sha256 (the archive and the source tarball it came from). About 8 minutes on 2 cores.
# Usage: bash benchmarks/llama_cpp/prebuild_cpu.sh [WORKDIR]
set -euo pipefail
work=${1:-/tmp/llama-cpu-prebuild}
[ -f .peers/llama.cpp.tgz ] \
  || { echo "no .peers/llama.cpp.tgz: run benchmarks/llama_cpp/fetch_source.sh first" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work/src"
tar xzf .peers/llama.cpp.tgz -C "$work/src"
cmake -S "$work/src/llama.cpp" -B "$work/build" -DGGML_CUDA=OFF -DGGML_BACKEND_DL=ON -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF '-DCMAKE_BUILD_RPATH=$ORIGIN' >/dev/null
cpus=$(cmake --build "$work/build" --target help | grep -o "ggml-cpu-[a-z0-9_]*" | grep -v feats | sort -u)
cmake --build "$work/build" -j "$(nproc)" --target llama-bench llama-quantize llama-completion $cpus 2>&1 | tail -1
mkdir -p "$work/out" && cp -a "$work/build/bin" "$work/out/"  # the libraries' version links kept
find "$work/out/bin" -type f -exec strip --strip-unneeded {} +
"$work/out/bin/llama-bench" --list-devices >/dev/null  # loads here, from where it lies
tar cf - -C "$work/out" bin | xz -T0 -9 > .peers/llama-cpu.tar.xz
sha256sum .peers/llama-cpu.tar.xz .peers/llama.cpp.tgz > .peers/llama-cpu.sha256
ls -la .peers/llama-cpu.*
