#!/bin/bash
# Parallel GPU test run on a lent machine (carry .gpu), in two parts that each fit one 10-minute device call:
#   PART=1 T=540 bash tests/gpu/run_parallel.sh   # decode (+ sliding window, softcap), KV insert, FP4 rows, INT8 prepass, graphs, memcheck
#   PART=2 T=540 bash tests/gpu/run_parallel.sh   # prefill (split by topic, sliding window, softcap, FP8 P.V varlen, launch plans, packed forms), channel balancing, compile cache
# (no PART: both parts at once, ~16 processes: for a machine with the cores and the time). Several pytest
# processes share the process-safe disk compile cache; logs land in $OUT (or ./gpu_logs), one summary per log.
source .gpu/activate.sh
export PYTHONPATH=.:$PYTHONPATH QATTN_CACHE_DIR=${QATTN_CACHE_DIR:-/tmp/qc}
OUT=${OUT:-gpu_logs}; mkdir -p $OUT
T=${T:-520}
P="python -m pytest -q -p no:cacheprovider"
run() { local name=$1; shift; timeout $T "$@" > $OUT/$name.txt 2>&1 & }
if [ -z "$PART" ] || [ "$PART" = 1 ]; then
  run d1 $P tests/gpu/test_decode_gpu.py -k "matches_reference and nvfp4"
  run d2 $P tests/gpu/test_decode_gpu.py -k "matches_reference and mxfp4"
  run d3 $P tests/gpu/test_decode_gpu.py -k "matches_reference and not (nvfp4 or mxfp4)"
  run d4 $P tests/gpu/test_decode_gpu.py tests/gpu/test_torch_compile_gpu.py tests/gpu/test_cuda_graph_gpu.py -k "not matches_reference"
  run d5 $P tests/gpu/test_decode_fuzz_gpu.py tests/gpu/test_decode_window_gpu.py tests/gpu/test_decode_softcap_gpu.py
  run i1 $P tests/gpu/test_kv_insert_gpu.py -k "transforms"
  run i2 $P tests/gpu/test_kv_insert_gpu.py -k "not transforms"
  run q1 $P tests/gpu/test_fp4_rows_gpu.py tests/gpu/test_qk_int8_gpu.py
  run m1 $P tests/gpu/test_multi_device_gpu.py  # skips on one GPU
  run s1 compute-sanitizer --tool memcheck --report-api-errors no python -m tests.gpu.sanitize_small
fi
if [ -z "$PART" ] || [ "$PART" = 2 ]; then
  F=tests/gpu/test_prefill_gpu.py
  run p1 $P $F -k "warpgroup_skip or long_causal"
  run p2 $P $F -k "fp8 and not split_tail and not warpgroup_skip"
  run p3 $P $F -k "error_vs_same and not fp8"
  run p4 $P $F -k "quantized_q_equals and not fp8"
  run p5 $P $F -k "not fp8 and not error_vs_same and not quantized_q_equals and not split_tail and not warpgroup_skip and not long_causal"
  run p6 $P $F -k "split_tail"
  run p7 $P tests/gpu/test_prefill_fuzz_gpu.py
  run w1 $P tests/gpu/test_prefill_window_gpu.py tests/gpu/test_prefill_softcap_gpu.py
  run p8 $P tests/gpu/test_prefill_fp8_varlen_gpu.py tests/gpu/test_launch_plan_gpu.py tests/gpu/test_prefill_packed_gpu.py
  run b1 $P tests/gpu/test_qk_balance_gpu.py tests/gpu/test_compile_cache_gpu.py
fi
wait
for f in $OUT/*.txt; do echo "== $f"; grep -E "^FAILED|^ERROR| passed| failed|ERROR SUMMARY|sanitize_small" $f | tail -12; done
