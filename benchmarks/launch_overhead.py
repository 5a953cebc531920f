"""Host-side cost per call (microseconds) of each layer of grouped_mm, next to torch._grouped_mm.

Small problems (decode-like, small-M) finish on the GPU in ~0.2 ms, so a Python launch path that
costs as much shows up in eager timings. This measures the CPU time per call with the GPU kept busy
(calls are queued without synchronizing), and the same kernel timed eagerly and as CUDA-graph replays.

    python benchmarks/launch_overhead.py [--out bench/results/h200/launch_overhead.md]
"""

import argparse
import time
from pathlib import Path

import torch
import triton

from moekit import grouped_mm
from moekit.bench import SHAPES, environment
from moekit.bench.grouped_mm import _problem
from moekit.grouped_gemm import grouped_mm_op, ragged_m


def host_us(fn, n=300):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, help="also write the table (with its date, device and versions) here")
    a = p.parse_args()
    x, dy, w, offs = _problem(SHAPES["small-M"], "down", "balanced", "cuda")
    b = w.mT
    calls = {
        "moekit.grouped_mm (public)": lambda: grouped_mm(x, b, offs),
        "moekit::grouped_mm custom op": lambda: grouped_mm_op(x, b, offs, None),
        "launcher (ragged_m)": lambda: ragged_m(x, b, offs, torch.bfloat16, None),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, b, offs),
    }
    rows = {}
    for name, fn in calls.items():
        eager = triton.testing.do_bench(fn, return_mode="median")
        graph = triton.testing.do_bench_cudagraph(fn, return_mode="median")
        rows[name] = (host_us(fn), eager, graph)
    base = rows["torch._grouped_mm"][0]
    lines = [environment(), "", "Command: `python benchmarks/launch_overhead.py`", "",
             "Host time per call of the small-M down-projection (calls queued without a sync), "
             "and the same call timed eagerly and as CUDA-graph replays.", "",
             "| call | host us/call | vs torch._grouped_mm | eager ms (do_bench) | graph ms (do_bench_cudagraph) |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {h:.1f} | {h / base:.2f}x | {e:.3f} | {g:.3f} |" for n, (h, e, g) in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
