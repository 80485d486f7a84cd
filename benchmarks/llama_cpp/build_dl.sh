#!/usr/bin/env bash
# ON THE GPU NODE, from the project root, carrying .peers/llama.cpp.tgz, .peers/ggml-cuda-sm90.sha256
# and one or more .peers/ggml-cuda-sm90.so.xz.part-N (prebuild_cuda.sh): each call keeps the parts it carried in
# .peers-build/parts (ignored, so they stay while the machine is warm); the first call unpacks llama.cpp's CPU side
# from .peers/llama-cpu.tar.xz where carried with its .sha256 (prebuild_cpu.sh), else builds the CPU
# backend in every x86 variant, the best one for this CPU chosen as it loads (GGML_CPU_ALL_VARIANTS: GGML_NATIVE
# does not go with GGML_BACKEND_DL; `CPU_ARGS` overrides), libllama and llama-bench / llama-quantize /
# llama-completion; once every part is there the CUDA backend is unpacked beside them, checked against
# its sha256, given the CUDA runtime and cuBLAS it needs, and llama-bench lists the devices it sees. Same layout
# as build-cuda.sh (.peers-build/build/bin), so bench.sh runs unchanged. Exit 0 only when the CUDA backend loads.
set -u
export PATH=/usr/local/cuda/bin:$PATH
sums=.peers/ggml-cuda-sm90.sha256; bin=.peers-build/build/bin; parts=.peers-build/parts
mkdir -p .peers-build/src "$parts"
cp .peers/ggml-cuda-sm90.so.xz.part-* "$parts"/ 2>/dev/null
grep -q "$(sha256sum .peers/llama.cpp.tgz | cut -d' ' -f1)" "$sums" \
  || { echo "llama.cpp.tgz is not the source the CUDA backend was built from: run prebuild_cuda.sh again" >&2; exit 1; }
[ -f .peers-build/src/llama.cpp/CMakeLists.txt ] || tar xzf .peers/llama.cpp.tgz -C .peers-build/src || exit 1
cpu=.peers/llama-cpu.tar.xz
if [ ! -x "$bin/llama-bench" ] && [ -f "$cpu" ]; then  # prebuild_cpu.sh's build of the same source
  sha256sum -c --quiet .peers/llama-cpu.sha256 && mkdir -p .peers-build/build && tar xJf "$cpu" -C .peers-build/build \
    && echo "llama.cpp's CPU side unpacked from $cpu" || echo "$cpu not used: built here" >&2
fi
if [ ! -x "$bin/llama-bench" ]; then
  cmake -S .peers-build/src/llama.cpp -B .peers-build/build -DGGML_CUDA=OFF -DGGML_BACKEND_DL=ON \
    -DBUILD_SHARED_LIBS=ON \
    ${CPU_ARGS:--DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=ON} -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null || exit 1
  cpus=$(cmake --build .peers-build/build --target help | grep -o "ggml-cpu[a-z0-9_.-]*" | sort -u)
  timeout 300 cmake --build .peers-build/build -j "$(nproc)" \
    --target llama-bench llama-quantize llama-completion $cpus \
    2>&1 | tail -1
  [ -x "$bin/llama-bench" ] || { echo "llama.cpp's CPU side did not build" >&2; exit 1; }
fi
cat "$parts"/ggml-cuda-sm90.so.xz.part-* | xz -dc > "$bin/libggml-cuda.so" 2>/dev/null \
  || { echo "CUDA backend incomplete; parts here: $(ls "$parts" | tr '\n' ' ')" >&2
       rm -f "$bin/libggml-cuda.so"; exit 2; }
grep libggml-cuda.so "$sums" | (cd "$bin" && sha256sum -c --quiet) \
  || { echo "libggml-cuda.so: sha256 differs from $sums" >&2; exit 1; }
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do  # found beside the library ($ORIGIN)
  [ -e "$bin/$lib" ] && continue
  found=$(find /usr/local/cuda*/ /usr/lib /usr/local/lib -name "$lib" 2>/dev/null | head -1)
  [ -z "$found" ] || ln -s "$found" "$bin/$lib"
done
ldd "$bin/libggml-cuda.so" | grep "not found" && exit 1
devices=$("$bin/llama-bench" --list-devices 2>&1); echo "$devices" | tail -3
grep -qE "^  CUDA[0-9]+: " <<< "$devices" || { echo "llama-bench lists no CUDA device" >&2; exit 1; }
