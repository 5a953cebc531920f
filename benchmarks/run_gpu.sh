#!/usr/bin/env bash
# The GPU workflow in one command: the GPU test suite, then the benchmarks, with logs and tables in $OUT.
#   bash benchmarks/run_gpu.sh [tests] [bench] [moe] [tokens] [experts] [grouped_mm] [sweep] [host] [profile]
#                              [sanitize] [kernels] [ep]
#     (default: tests bench)
#   tests:   python -m pytest -m gpu (the test paths in $TESTS, default tests)
#   bench:   python -m moekit bench (all three tables and their plots)
#   moe / experts / grouped_mm: one table alone (moe adds the bench arguments in $MOE_ARGS, such as
#       "--shape qwen3-30b-a3b"); sweep: the grouped-GEMM config sweep;
#   profile: per-kernel times of one gpt-oss-20b and -120b expert step.
#   sanitize: compute-sanitizer's four tools over benchmarks/sanitize_set.py (benchmarks/sanitize.sh).
#   kernels: per-kernel times of one block step of SonicMoE (when carried) and of moekit on each shape of
#       $SHAPES (default gpt-oss-20b), each in its own process (benchmarks/sonic_kernels.py; SonicMoE's
#       first call, which autotunes from an empty cache, under a ${SONIC_TIMEOUT:-480} s timeout;
#       $KERNELS_ARGS adds the probe's arguments, such as "--steady 6" for clocks and power).
#   ep: expert-parallel weak scaling over every GPU of the machine (benchmarks/ep_scaling.py; two or more
#       GPUs, NVLink multicast off).
# Optional archives, when present in the working tree:
#   .triton/triton.tar.xz  a Triton release to run on instead of the machine's own (a slim wheel tree)
#   .sonic/sonic.tar.xz    sonic-moe 0.1.2.post1 with its CuTe-DSL stack: the MoE table then times
#                          SonicMoE too (each shape in a child process with a timeout)
#   .sonic/quack/          QuACK's autotune results and compiled kernels from earlier runs: SonicMoE's
#                          first call per shape then compiles and tunes only what is missing; the
#                          updated folder comes back as $OUT/sonic-quack.tgz (unpack it into .sonic/)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -f .triton/triton.tar.xz ]; then
  mkdir -p /tmp/tri && tar -C /tmp/tri -xJf .triton/triton.tar.xz
  export PYTHONPATH=/tmp/tri:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 \
    TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas \
    TRITON_CUOBJDUMP_PATH=/usr/local/cuda/bin/cuobjdump TRITON_NVDISASM_PATH=/usr/local/cuda/bin/nvdisasm
fi
sonic=()
if [ -f .sonic/sonic.tar.xz ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .sonic/sonic.tar.xz
  export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages
  sonic=(--sonicmoe)
  mkdir -p .sonic/quack  # QuACK keeps both its autotune results and its compiled kernels there
  export QUACK_CACHE_DIR=$PWD/.sonic/quack QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-16}
  # the whole cache, and its autotune results alone (small enough to carry beside the bundle)
  trap 'tar -C .sonic -czf "$OUT/sonic-quack.tgz" quack;
        (cd .sonic && find quack -name "*.json" -print0 | tar --null -T - -czf "$OUT/sonic-tuned.tgz")' EXIT
fi
steps=${*:-tests bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -m moekit info
run_bench() { python3 -m moekit bench --out "$OUT" "$@" 2>&1 | grep --line-buffered -v "it/s\]"; }
for step in $steps; do
  echo "=== $step ==="
  case $step in
    tests) python3 -m pytest -m gpu -q -x ${TESTS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
    bench) run_bench "${sonic[@]}" | tee "$OUT/bench.log" ;;
    moe) run_bench --only moe "${sonic[@]}" ${MOE_ARGS:-} | tee "$OUT/moe.log" ;;
    tokens) run_bench --only sweep ${TOKENS_ARGS:-} | tee "$OUT/tokens.log" ;;
    host) python3 probes/host_step.py ${HOST_ARGS:-} 2>&1 | tee "$OUT/host.log" ;;
    experts|grouped_mm) run_bench --only "$step" | tee "$OUT/$step.log" ;;
    sweep) python3 benchmarks/sweep_grouped_mm.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.md" ;;
    sanitize) bash benchmarks/sanitize.sh 2>&1 | tee "$OUT/sanitize.log" ;;
    profile) for s in gpt-oss-20b gpt-oss-120b; do python3 benchmarks/profile_experts.py --shape $s; done 2>&1 \
      | tee "$OUT/profile.log" ;;
    kernels) for s in ${SHAPES:-gpt-oss-20b}; do
        [ ${#sonic[@]} -gt 0 ] && timeout "${SONIC_TIMEOUT:-480}" python3 benchmarks/sonic_kernels.py --impl sonic --shape "$s" ${KERNELS_ARGS:-}
        python3 benchmarks/sonic_kernels.py --impl moekit --shape "$s" ${KERNELS_ARGS:-}
      done 2>&1 | tee "$OUT/kernels.log" ;;
    ep) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python3 benchmarks/ep_scaling.py --chunks 1 --chunks 2 --chunks 4 --profile --out "$OUT/ep_scaling.md" 2>&1 \
      | tee "$OUT/ep.log" ;;
  esac
done
