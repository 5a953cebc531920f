#!/usr/bin/env bash
# compute-sanitizer over moekit's representative kernel set (benchmarks/sanitize_set.py), one run per tool:
#   bash benchmarks/sanitize.sh [tool ...]   (default: memcheck racecheck synccheck initcheck initcheck-tma)
# initcheck does not count a TMA store (moekit's Hopper epilogues, and cuBLAS's) as initializing the
# memory it writes (a one-kernel probe showed it: a TMA store leaves its bytes "uninitialized"), so:
#   initcheck      runs with MOEKIT_TMA=0, moekit's kernels on their pointer paths; what it still reports
#                  are torch's kernels reading cuBLAS's outputs (the router's GEMMs). Excluding torch's
#                  kernels (--kernel-name-exclude) does not help: their writes then go unseen too, and
#                  every read of a tensor they wrote is reported;
#   initcheck-tma  runs the default paths; its reports are expected, and the table names the kernels
#                  that made them.
# Writes $OUT/sanitize_<tool>.log per tool and $OUT/sanitize.md: each tool's error count, and where the
# errors were (racecheck: the kernel and code offsets of each hazard; initcheck: the reading kernel).
# SANITIZE_TIMEOUT (seconds per tool, default 300) bounds each run; a run cut short says so in the table.
# PyTorch's caching allocator is off, so that memcheck sees every allocation's true bounds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTORCH_NO_CUDA_MEMORY_CACHING=1
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
tools=${*:-memcheck racecheck synccheck initcheck initcheck-tma}
cases=$(python3 benchmarks/sanitize_set.py --list)
{
  echo "compute-sanitizer over \`python benchmarks/sanitize_set.py\` ($cases)"
  echo
  echo "$(date -u +%F) | $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) | $($SAN --version | tail -1)"
  echo
  echo "Kernels each case launched (\`python benchmarks/sanitize_set.py --kernels\`):"
  echo
  python3 benchmarks/sanitize_set.py --kernels 2>&1 | grep " kernels: " | sed 's/^/- /'
  echo
  echo "| tool | errors | cases | time | where |"
  echo "|---|---|---|---|---|"
} > "$OUT/sanitize.md"
for tool in $tools; do
  log="$OUT/sanitize_$tool.log"
  extra=(--print-limit 100000)
  env=()
  case $tool in
    racecheck) extra+=(--racecheck-report hazard) ;;
    initcheck) env=(MOEKIT_TMA=0) ;;
    initcheck-tma) extra=(--print-limit 300) ;;  # printing every report would take the run past its limit
  esac
  start=$(date +%s)
  env "${env[@]}" timeout "${SANITIZE_TIMEOUT:-300}" "$SAN" --tool "${tool%-tma}" "${extra[@]}" \
    python3 benchmarks/sanitize_set.py > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  # "ERROR SUMMARY: N errors" (memcheck, initcheck, synccheck), "RACECHECK SUMMARY: H hazards displayed
  # (N errors, W warnings)" (racecheck)
  errors=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | grep -oE "[0-9]+ errors?" | grep -oE "[0-9]+" || true)
  ok=$(grep -c ": ok$" "$log" || true)
  note="${secs} s"
  [ "$rc" = 124 ] && note="cut at ${SANITIZE_TIMEOUT:-300} s, unfinished"
  if [ "$tool" = racecheck ]; then  # "Write Thread (..) at KERNEL+0xOFF in FILE:LINE"
    where=$(grep -oE "(Write|Read) Thread \([0-9,]+\) at [A-Za-z0-9_]+\+0x[0-9a-f]+" "$log" \
      | sed -E 's/ Thread \([0-9,]+\) at / /' | sort | uniq -c | awk '{printf "%s%s %s x%s", sep, $2, $3, $1; sep="; "}')
  else  # the kernel named on each report's "at ..." line
    where=$(grep -E "^=========     at " "$log" | sed -E 's/^=========     at (void )?//; s/[<(+].*//' \
      | sort | uniq -c | awk '{printf "%s%s x%s", sep, $2, $1; sep="; "}')
  fi
  echo "| $tool | ${errors:-none reported} | $ok ok of $(echo "$cases" | wc -w) | $note | ${where:--} |" \
    >> "$OUT/sanitize.md"
  echo "$tool: ${errors:-?} errors, $ok cases ok, rc $rc, $note"
  xz -f -9 "$log"
done
