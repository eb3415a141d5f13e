#!/usr/bin/env bash
# Everything plait checks on a lent CUDA machine, as one command (the device tool's `run`):
#   bash benchmarks/gpu_check.sh          # results and logs in $OUT (default benchmarks/results/gpu)
# 1. the Triton kernel and CUDA-graph tests compiled on the device (fp32, fp16, bf16), and the
#    Engine's greedy parity on the Triton backend;
# 2. benchmarks/gpu_kernels.py: each kernel checked against the torch reference and timed, decode
#    attention's bandwidth as a fraction of the device's copy bandwidth;
# 3. benchmarks/gpu_decode.py: decode tokens/s of a ~1B Llama, torch vs Triton vs CUDA graphs.
# Packages the machine lacks can travel as wheels in .whl/ (installed to /tmp/site first).
# STAGES=tests,kernels,decode (the default: all three) picks stages.
set -u
STAGES=${STAGES:-tests,kernels,decode}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"
if [[ ,$STAGES, == *,tests,* ]]; then
t0=$SECONDS
timeout "${PYTEST_TIMEOUT:-330}" python3 -m pytest -v --tb=short -p no:cacheprovider -o addopts="" \
  tests/kernels/test_cuda_graph.py tests/kernels/test_triton_attention.py \
  tests/kernels/test_engine_triton.py -k "not compile_for_hopper" 2>&1 | tee "$OUT/pytest.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
echo "pytest: $((SECONDS - t0)) s" | tee -a "$OUT/env.log"
fi
if [[ ,$STAGES, == *,kernels,* ]]; then
t0=$SECONDS
timeout "${KERNELS_TIMEOUT:-110}" python3 -m benchmarks.gpu_kernels --out "$OUT" 2>&1 \
  | tee "$OUT/gpu_kernels.log" | tail -30
echo "gpu_kernels: $((SECONDS - t0)) s" | tee -a "$OUT/env.log"
fi
if [[ ,$STAGES, == *,decode,* ]]; then
t0=$SECONDS
timeout "${DECODE_TIMEOUT:-280}" python3 -m benchmarks.gpu_decode --out "$OUT" 2>&1 \
  | tee "$OUT/gpu_decode.log" | tail -40
echo "gpu_decode: $((SECONDS - t0)) s" | tee -a "$OUT/env.log"
fi
