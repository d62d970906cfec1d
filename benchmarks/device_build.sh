# Sourced by the run_device_*.sh runners: $OUT, the build settings, the GPU's name, then the
# editable build (its log in $OUT/build.log; the runner stops with the log's tail if it fails).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "built at ${SECONDS}s"
