#!/bin/bash
# Parallel GPU test run on a lent machine (carry .gpu): T=480 bash tests/gpu/run_parallel.sh
# Several pytest processes share the process-safe disk compile cache; logs land in $OUT (or ./gpu_logs).
source .gpu/activate.sh
export PYTHONPATH=.:$PYTHONPATH QATTN_CACHE_DIR=/tmp/qc
OUT=${OUT:-gpu_logs}; mkdir -p $OUT
T=${T:-520}
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py -k "matches_reference and nvfp4" > $OUT/d1.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py -k "matches_reference and mxfp4" > $OUT/d2.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py -k "matches_reference and not (nvfp4 or mxfp4)" > $OUT/d3.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py tests/gpu/test_torch_compile_gpu.py tests/gpu/test_cuda_graph_gpu.py -k "not matches_reference" > $OUT/d4.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_kv_insert_gpu.py -k "transforms" > $OUT/i1.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_kv_insert_gpu.py -k "not transforms" > $OUT/i2.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_prefill_gpu.py tests/gpu/test_qk_int8_gpu.py tests/gpu/test_fp4_rows_gpu.py tests/gpu/test_compile_cache_gpu.py > $OUT/p1.txt 2>&1 &
timeout $T python -m pytest -q -p no:cacheprovider tests/gpu/test_qk_balance_gpu.py > $OUT/p2.txt 2>&1 &
if [ -n "$SANITIZE" ]; then  # memcheck of the small cases, alongside
  timeout $T compute-sanitizer --tool memcheck --report-api-errors no python -m tests.gpu.sanitize_small > $OUT/s1.txt 2>&1 &
fi
wait
for f in $OUT/*.txt; do echo "== $f"; grep -E "^FAILED|^ERROR|passed|failed|error|ERROR SUMMARY|sanitize_small" $f | tail -12; done
