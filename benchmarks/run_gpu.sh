#!/usr/bin/env bash
# One device call: GPU tests, config sweep, benchmark (the compiler report runs anywhere: benchmarks/compiler_report.py). Writes logs and tables to $OUT.
#   bash benchmarks/run_gpu.sh [tests] [sweep] [bench] [experts] [profile]   (default: the first three)
#   experts: the expert-MLP table alone; profile: per-kernel times of one gpt-oss-20b and -120b step
#   moe: the MoE-block table alone (with SonicMoE when .sonic/sonic.tar.xz was carried along)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -f .sonic/sonic.tar.xz ]; then  # SonicMoE for the block benchmark (../shared/tools/sonicmoe_bundle.sh)
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .sonic/sonic.tar.xz
  export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages MOEKIT_BENCH_SONICMOE=1
fi
steps=${*:-tests sweep bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -m moekit info
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests) python3 -m pytest -m gpu -q -x tests 2>&1 | tee "$OUT/pytest.log" | tail -30 ;;
    sweep) python3 benchmarks/sweep_grouped_mm.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.md" ;;
    bench) python3 -m moekit bench --out "$OUT" 2>&1 | grep --line-buffered -v "it/s\]" | tee "$OUT/bench.log" ;;
    moe) python3 -m moekit bench --only moe --out "$OUT" 2>&1 | grep --line-buffered -v "it/s\]" | tee "$OUT/moe.log" ;;
    experts) python3 -m moekit bench --only experts --out "$OUT" 2>&1 | grep --line-buffered -v "it/s\]" | tee "$OUT/experts.log" ;;
    profile) for s in gpt-oss-20b gpt-oss-120b; do python3 benchmarks/profile_experts.py --shape $s; done 2>&1 | tee "$OUT/profile.log" ;;
  esac
done
