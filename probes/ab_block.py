"""Paired A/B of the whole MoE block: an older revision of the package (``moekit_old``, set up as in
``probes/ab_revision.py``) against the working tree, in one process, on the benchmark's block shapes
(plain configuration). Per shape and revision: kernels per training step, the host's time to enqueue
a forward and a step (GPU queue drained, the revisions interleaved), and paired do_bench times of the
forward and the step.

    python probes/ab_block.py [shape ...] [--rounds 9] [--tokens 1024 --tokens 4096]
"""

import argparse
import dataclasses
import sys

import torch

sys.path.insert(0, ".ab/abtest")  # git-ignored
import moekit_old  # noqa: E402

import moekit  # noqa: E402
from moekit.bench import BLOCK_SHAPES, cuda_kernels, environment, host_us, paired_ratios  # noqa: E402
from moekit.bench.moe import CONFIGS  # noqa: E402


def block(pkg, shape):
    torch.manual_seed(0)
    return pkg.MoE(shape.d, shape.f, shape.e, shape.top_k, device="cuda", dtype=torch.bfloat16, **CONFIGS["plain"])


def kernels_per_step(step):
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return len(cuda_kernels(prof))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite"])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--tokens", action="append", type=int, help="T per step (default: the shape's)")
    p.add_argument("--host-reps", type=int, default=100, help="interleaved host timings per revision")
    a = p.parse_args()
    print(environment())
    for name, tokens in ((n, t) for n in a.shapes for t in a.tokens or [None]):
        shape = BLOCK_SHAPES[name] if tokens is None else dataclasses.replace(BLOCK_SHAPES[name], tokens=tokens)
        torch.manual_seed(1)
        x = torch.randn(shape.tokens, shape.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fns, lines = {}, []
        for label, pkg in (("old", moekit_old), ("new", moekit)):
            moe = block(pkg, shape)
            params = [x, *moe.parameters()]

            def fwd(moe=moe, x=x):
                return moe(x)

            def step(moe=moe, params=params, x=x, dy=dy):
                return torch.autograd.grad(moe(x), params, dy)

            fns[f"{label} fwd"], fns[f"{label} step"] = fwd, step
            step()
            lines.append(f"  {label}: {kernels_per_step(step)} kernels per step")
        print(f"{name} (T={shape.tokens})")
        print("\n".join(lines))
        for what in ("fwd", "step"):  # host time, old and new interleaved (this host's speed drifts by tens of %)
            old, new = [], []
            for _ in range(a.host_reps):
                old.append(host_us(fns[f"old {what}"], 1))
                new.append(host_us(fns[f"new {what}"], 1))
            r = sorted(n / o for o, n in zip(old, new, strict=True))
            n = len(r)
            print(f"  host {what}: old {sorted(old)[n // 2] / 1e3:.3f} ms, new {sorted(new)[n // 2] / 1e3:.3f} ms, "
                  f"paired ratio x{r[n // 2]:.3f} [{r[n // 4]:.3f}-{r[3 * n // 4]:.3f}] (median, quartiles of {n})")
        for what in ("fwd", "step"):
            cells = paired_ratios({k: v for k, v in fns.items() if k.endswith(what)}, f"old {what}", rounds=a.rounds)
            print("  " + " | ".join(cells))


if __name__ == "__main__":
    main()
