"""Probe: the host's time per eager block step with the launch layer's cache on and off, and where
the rest of a forward's goes (open question: what is left of a step's host time once launches are cheap).

Per shape and T: host ms per step (``bench.sweep.host_ms``) with ``fast_launch`` off and on, in
alternating rounds of one process, and the graphed step's GPU ms; then the public ``grouped_mm``'s
host us per call against ``torch._grouped_mm``; then a cProfile of one eager step, by own time.

    python probes/host_step.py [--shape qwen3-30b-a3b --shape gpt-oss-20b] [--tokens 1024 --tokens 4096]
"""

import argparse
import cProfile
import dataclasses
import pstats

import torch
import triton
import triton.language as tl

import moekit
from moekit import launch
from moekit.bench import BLOCK_SHAPES, graph_ms, host_us
from moekit.bench.moe import training_step
from moekit.bench.sweep import host_ms


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, n, mask=pid < 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", action="append")
    p.add_argument("--tokens", action="append", type=int)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile-lines", type=int, default=45)
    p.add_argument("--dump", help="also write each profiled shape's pstats here (DIR/<shape>-<T>.prof)")
    p.add_argument("--profile-shape", action="append", help="shapes to profile (default: the first --shape)")
    a = p.parse_args()
    shapes = a.shape or ["qwen3-30b-a3b", "gpt-oss-20b"]
    tokens = a.tokens or [1024, 4096]
    print("| shape | T | host ms, Triton's launch | host ms, launch layer | graph ms |")
    print("|---|---|---|---|---|")
    for name in shapes:
        for t in tokens:
            shape = dataclasses.replace(BLOCK_SHAPES[name], tokens=t)
            _, _, step = training_step(shape, "plain")
            samples = {False: [], True: []}
            for r in range(a.rounds):
                for fast in ((False, True) if r % 2 == 0 else (True, False)):
                    with moekit.options(fast_launch=fast):
                        samples[fast].append(host_ms(step))
            g = graph_ms(step)
            med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
            print(f"| {name} | {t} | {med[False]:.2f} | {med[True]:.2f} | {g:.2f} |", flush=True)
    # the public grouped GEMM against torch's, host time per call
    e, d, n, m = 128, 2048, 1536, 8192
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, d, device="cuda", dtype=torch.bfloat16)
    offs = torch.linspace(m / e, m, e, device="cuda").to(torch.int32)
    for fast in (False, True):
        with moekit.options(fast_launch=fast):
            ours = host_us(lambda: moekit.grouped_mm(x, w.mT, offs), 50)
        print(f"grouped_mm host us, fast_launch={fast}: {ours:.1f}")
    print(f"torch._grouped_mm host us: {host_us(lambda: torch._grouped_mm(x, w.mT, offs), 50):.1f}")
    # single launches: an empty Triton kernel through Triton and through the launch layer, a torch op
    small = torch.zeros(128, device="cuda")
    print(f"empty Triton kernel host us: Triton {host_us(lambda: _empty_kernel[(1,)](small, 1, BLOCK=1), 50):.1f}, "
          f"launch layer {host_us(lambda: launch.kernel(_empty_kernel)[(1,)](small, 1, BLOCK=1), 50):.1f}; "
          f"torch add {host_us(lambda: small.add_(1), 50):.1f}; "
          f"torch.empty {host_us(lambda: torch.empty(1024, device='cuda'), 50):.1f}")
    # where an eager step's host time goes now (the backward on the calling thread, so cProfile sees it)
    for name in a.profile_shape or shapes[:1]:
        shape = dataclasses.replace(BLOCK_SHAPES[name], tokens=tokens[0])
        _, _, step = training_step(shape, "plain")
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):
            prof.enable()
            for _ in range(10):
                step()
            prof.disable()
        torch.cuda.synchronize()
        if a.dump:
            prof.dump_stats(f"{a.dump}/{name}-{tokens[0]}.prof")
        stats = pstats.Stats(prof).strip_dirs()
        print(f"## {name}, T = {tokens[0]}: ten steps")
        stats.sort_stats("tottime").print_stats(a.profile_lines)
        stats.sort_stats("cumulative").print_stats(a.profile_lines)

if __name__ == "__main__":
    main()
