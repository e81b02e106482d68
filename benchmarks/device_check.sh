#!/usr/bin/env bash
# One run on a GPU machine (the device tool's `run`), results under $OUT:
#   env.txt         torch, Triton, GPU (and nvidia-smi)
#   gpu_tests.txt   the GPU tests of tests/torch/test_triton.py and test_triton_kvcache.py
#                   (compiled kernels vs the reference)
#   bench_cli.txt   `attnkit bench` on CUDA (bf16, causal, forward and backward)
#   gpu.txt/.csv    benchmarks/gpu.py: checks first, the bf16 GEMM ceiling, KV-cache
#                   decoding, then the timing grid
# Fits one 10-minute call (at most 530 s): tests capped at 170 s, attnkit bench at 40 s,
# the benchmark at 300 s (its timing stops starting new shapes after 240 s).
# Needs torch, triton, numpy, pytest and pytest-xdist (the H200 image has them).
# Exits non-zero when the tests or the benchmark failed (or ran out of time).
set -u -o pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
{ python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__,
'numpy', numpy.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv; } 2>&1 | tee "$out/env.txt"
timeout 170 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/torch/test_triton.py \
  tests/torch/test_triton_kvcache.py -k test_gpu 2>&1 \
  | tee "$out/gpu_tests.txt"
tests=$?
echo "gpu tests exit: $tests" | tee -a "$out/gpu_tests.txt"
timeout 40 python3 -m attnkit.cli bench --device cuda --dtype bfloat16 --shape 2 16 8192 128 \
  --causal --backward --repeats 3 2>&1 | tee "$out/bench_cli.txt"
cli=$?
echo "attnkit bench exit: $cli" | tee -a "$out/bench_cli.txt"
timeout 300 python3 benchmarks/gpu.py --budget-s 240 --out "$out/gpu.csv" 2>&1 | tee "$out/gpu.txt"
bench=$?
echo "benchmark exit: $bench" | tee -a "$out/gpu.txt"
exit $(( tests != 0 || cli != 0 || bench != 0 ))
