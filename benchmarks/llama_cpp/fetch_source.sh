#!/usr/bin/env bash
# Here (with a network), from the project root: llama.cpp's source as .peers/llama.cpp.tgz (about 5.5 MB), taken
# from the sdist of llama-cpp-python (it vendors llama.cpp; VERSION, default 0.3.36) and pruned of what the node's
# build never reads (models, docs, tests, scripts, the web UI and server, other backends' sources), so that it and
# the prebuilt CUDA parts fit a device call's 64 MiB. Then prebuild_cuda.sh (here), build_dl.sh (on the node).
# Usage: bash benchmarks/llama_cpp/fetch_source.sh [VERSION]
set -euo pipefail
version=${1:-0.3.36}; work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
[ -f "$src/CMakeLists.txt" ] || { echo "no vendored llama.cpp in llama-cpp-python $version" >&2; exit 1; }
rm -rf "$src"/{models,docs,media,benches,tests,.github,scripts,conversion} "$src"/tools/{ui,server}
for backend in "$src"/ggml/src/ggml-*/; do
  case $(basename "$backend") in
    ggml-cpu|ggml-cuda|ggml-blas|ggml-hip|ggml-rpc|ggml-zendnn) ;;  # small: kept as in the builds measured so far
    *) rm -rf "$backend" ;;
  esac
done
mkdir -p .peers && tar czf .peers/llama.cpp.tgz -C "$(dirname "$src")" llama.cpp
echo "wrote .peers/llama.cpp.tgz ($(du -h .peers/llama.cpp.tgz | cut -f1), llama-cpp-python $version's llama.cpp)"
