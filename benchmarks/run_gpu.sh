#!/usr/bin/env bash
# One device call: GPU tests, config sweep, benchmark (the compiler report runs anywhere: benchmarks/compiler_report.py). Writes logs and tables to $OUT.
#   bash benchmarks/run_gpu.sh [tests] [sweep] [bench]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
steps=${*:-tests sweep bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -m moekit info
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests) python3 -m pytest -m gpu -q -x tests 2>&1 | tee "$OUT/pytest.log" | tail -30 ;;
    sweep) python3 benchmarks/sweep_grouped_mm.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.md" ;;
    bench) python3 -m moekit bench --out "$OUT" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench.log" ;;
  esac
done
