#!/usr/bin/env bash
# The prepared GPU run (the device tool's `run`), in two parts that each fit one
# 10-minute call; results under $OUT:
#   bash benchmarks/device_check.sh tests   (at most ~330 s)
#     env.txt        torch, Triton, GPU (and nvidia-smi)
#     gpu_tests.txt  the GPU tests of tests/torch/test_triton.py and test_triton_kvcache.py
#                    (compiled kernels vs the reference; 16 workers, compiling dominates)
#     bench_cli.txt  `attnkit bench` on CUDA (bf16, causal, forward and backward)
#   bash benchmarks/device_check.sh bench   (at most ~480 s)
#     warm.txt       the parallel warm-up's output (compiling each part's kernels)
#     gpu.txt/.csv   benchmarks/gpu.py: checks first, the bf16 GEMM ceiling, KV-cache
#                    decoding, then the timing grid (D = 128 first) until its budget
#   bash benchmarks/device_check.sh focus   (161 s on an H200, its time caps 600 s; after the two above)
#     gpu_tests.txt  the float32 GPU tests (the float32 tiles) while the kernels below compile
#     sweep.txt      benchmarks/gpu.py --sweep-decode: the decode kernel's candidates, the
#                    public call's host time
#     gpu.txt/.csv   benchmarks/gpu.py --dtypes float32: float32 checks and timing, decoding
#   bash benchmarks/device_check.sh decode   (at most ~170 s: after a change to decoding)
#     gpu_tests.txt  the KV-cache GPU tests while the benchmark's decode kernels compile
#     gpu.txt/.csv   benchmarks/gpu.py --decode-only
# Measured on an H200 (2026-12-04, Triton 3.6): the 62 GPU tests need more than 170 s
# with 8 workers (Triton compiles each kernel variant in 10–30 s); the benchmark's
# checks take ~50 s per (dtype, D, causal) for the same reason, and its timing grid
# ~5 s per shape. Run `tests`, then `bench` at once while the machine is warm.
# Needs torch, triton, numpy, pytest and pytest-xdist (the H200 image has them).
# Exits non-zero when a part failed or ran out of time.
set -u -o pipefail
part=${1:-tests}
extra=${GPU_ARGS:-}   # e.g. GPU_ARGS=--dry-run: the bench part on the CPU (Triton's interpreter)
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
case $part in
tests)
  { python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__,
'numpy', numpy.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv; } 2>&1 | tee "$out/env.txt"
  timeout 270 python3 -m pytest -q -n 16 -p no:cacheprovider -rfE --tb=short tests/torch/test_triton.py \
    tests/torch/test_triton_kvcache.py -k test_gpu 2>&1 | tee "$out/gpu_tests.txt"
  tests=$?
  echo "gpu tests exit: $tests" | tee -a "$out/gpu_tests.txt"
  timeout 50 python3 -m attnkit.cli bench --device cuda --dtype bfloat16 --shape 2 16 8192 128 \
    --causal --backward --repeats 3 2>&1 | tee "$out/bench_cli.txt"
  cli=$?
  echo "attnkit bench exit: $cli" | tee -a "$out/bench_cli.txt"
  exit $(( tests != 0 || cli != 0 )) ;;
bench)
  # compile every part's kernels first, one process per part in parallel (Triton's
  # on-disk cache), so that the checks and the timing below find them compiled
  # (a part that fails or times out is compiled again by the benchmark itself, slowly)
  start=$(date +%s) pids=() names=() failed=""
  parts=$(python3 benchmarks/gpu.py $extra --warm list) || failed=" (the list itself)"
  for what in $parts; do
    timeout 150 python3 -W ignore benchmarks/gpu.py $extra --warm "$what" > "$out/warm_$what.log" 2>&1 &
    pids+=($!) names+=("$what")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ "$rc" -eq 0 ] || failed="$failed ${names[$i]} (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
    { echo "== warm ${names[$i]}: exit $rc"; cat "$out/warm_${names[$i]}.log"; } >> "$out/warm.txt"
    rm -f "$out/warm_${names[$i]}.log"
  done
  echo "warm-up: $(( $(date +%s) - start )) s; failed:${failed:- none}" | tee "$out/gpu.txt"
  timeout 320 python3 -W ignore benchmarks/gpu.py $extra --budget-s 270 --out "$out/gpu.csv" 2>&1 | tee -a "$out/gpu.txt"
  bench=$?
  echo "benchmark exit: $bench" | tee -a "$out/gpu.txt"
  exit $(( bench != 0 || ${#failed} != 0 )) ;;
focus)
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name())" 2>&1 | tee "$out/env.txt"
  start=$(date +%s) pids=()
  timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider -rfE --tb=short tests/torch/test_triton.py \
    tests/torch/test_triton_kvcache.py -k "test_gpu and float32" > "$out/gpu_tests.txt" 2>&1 &
  tests_pid=$!
  for i in 0 1 2 3 4 5 6 7; do      # compile the decode candidates, 8 processes
    timeout 200 python3 -W ignore benchmarks/gpu.py --sweep-decode --shard $i/8 > "$out/warm_s$i.log" 2>&1 &
    pids+=($!)
  done
  for what in $(python3 benchmarks/gpu.py --dtypes float32 --warm list); do
    timeout 200 python3 -W ignore benchmarks/gpu.py --warm "$what" > "$out/warm_$what.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  tail -n 3 "$out"/warm_*.log > "$out/warm.txt" 2>&1; rm -f "$out"/warm_*.log
  wait $tests_pid; tests=$?
  echo "float32 gpu tests exit: $tests at $(( $(date +%s) - start )) s" | tee -a "$out/gpu_tests.txt"
  timeout 150 python3 -W ignore benchmarks/gpu.py --sweep-decode 2>&1 | tee "$out/sweep.txt"
  sweep=$?
  echo "sweep exit: $sweep at $(( $(date +%s) - start )) s" | tee -a "$out/sweep.txt"
  timeout 150 python3 -W ignore benchmarks/gpu.py --dtypes float32 --budget-s 100 --out "$out/gpu.csv" 2>&1 \
    | tee "$out/gpu.txt"
  bench=$?
  echo "benchmark exit: $bench at $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
  exit $(( tests != 0 || sweep != 0 || bench != 0 )) ;;
decode)
  start=$(date +%s)
  timeout 100 python3 -m pytest -q -n 14 -p no:cacheprovider -rfE --tb=short tests/torch/test_triton_kvcache.py \
    -k test_gpu > "$out/gpu_tests.txt" 2>&1 &
  tests_pid=$!
  timeout 100 python3 -W ignore benchmarks/gpu.py --warm decode > "$out/warm.txt" 2>&1
  wait $tests_pid; tests=$?
  echo "kvcache gpu tests exit: $tests at $(( $(date +%s) - start )) s" | tee -a "$out/gpu_tests.txt"
  tail -n 4 "$out/gpu_tests.txt"
  timeout 60 python3 -W ignore benchmarks/gpu.py --decode-only --out "$out/gpu.csv" 2>&1 | tee "$out/gpu.txt"
  bench=$?
  echo "benchmark exit: $bench at $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
  exit $(( tests != 0 || bench != 0 )) ;;
*)
  echo "usage: bash benchmarks/device_check.sh tests|bench|focus|decode" >&2; exit 2 ;;
esac
