#!/usr/bin/env bash
# The CUDA checks, for a machine with one GPU (under 5 minutes): tests/gpu/check_cuda.py on two gloo ranks sharing
# the GPU, then the benchmark's broadcast section with CUDA tensors. Uses the machine's own python3 with torch;
# zero_buffers comes from this checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
"$PY" tests/gpu/check_cuda.py
"$PY" benchmarks/bench.py --cuda-gloo --world 2 --only broadcast check report_diff --repeats 11 \
  --out "${OUT:-/tmp}/zb_gpu_bench"
