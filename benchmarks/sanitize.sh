#!/usr/bin/env bash
# compute-sanitizer over moekit's representative kernel set (benchmarks/sanitize_set.py), one run per tool:
#   bash benchmarks/sanitize.sh [tool ...]      (default: memcheck racecheck initcheck synccheck)
# Writes $OUT/sanitize_<tool>.log per tool and $OUT/sanitize.md, a table of each tool's error count.
# SANITIZE_TIMEOUT (seconds per tool, default 300) bounds each run; a run cut short says so in the table.
# PyTorch's caching allocator is off, so that memcheck sees every allocation's true bounds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTORCH_NO_CUDA_MEMORY_CACHING=1
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
tools=${*:-memcheck racecheck initcheck synccheck}
{
  echo "compute-sanitizer over \`python benchmarks/sanitize_set.py\` ($(python3 benchmarks/sanitize_set.py --list))"
  echo
  echo "$(date -u +%F) | $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) | $($SAN --version | tail -1)"
  echo
  echo "| tool | errors | cases | note |"
  echo "|---|---|---|---|"
} > "$OUT/sanitize.md"
for tool in $tools; do
  log="$OUT/sanitize_$tool.log"
  extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  start=$(date +%s)
  timeout "${SANITIZE_TIMEOUT:-300}" "$SAN" --tool "$tool" "${extra[@]}" --print-limit 50 \
    python3 benchmarks/sanitize_set.py > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  # "ERROR SUMMARY: N errors" (memcheck, initcheck, synccheck), "RACECHECK SUMMARY: H hazards displayed
  # (N errors, W warnings)" (racecheck)
  errors=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | grep -oE "[0-9]+ errors?" | grep -oE "[0-9]+" || true)
  ok=$(grep -c ": ok$" "$log" || true)
  note="${secs} s"
  [ "$rc" = 124 ] && note="cut at ${SANITIZE_TIMEOUT:-300} s, unfinished"
  echo "| $tool | ${errors:-none reported} | $ok ok of $(python3 benchmarks/sanitize_set.py --list | wc -w) | $note |" \
    >> "$OUT/sanitize.md"
  echo "$tool: ${errors:-?} errors, $ok cases ok, rc $rc, $note"
done
