"""Why does the expert table time gpt-oss-120b's step ~2 ms slower than profile_experts.py does
(27.0-27.7 against 25.2-25.9 ms over several runs) while 20b agrees within 0.6 ms?

Per shape, with the expert table's setup (seeded routing, shared parameters): moekit's step back to
back on a GPU that idled 5 s; the same right after 3 s of the torchtitan step; do_bench's median
(the table's method) right after that; and each kernel of one hot step, in launch order. nvidia-smi
samples the SM clock and board power of the back-to-back runs.

    python probes/bench_gap.py [shape ...]
"""

import sys
import time

import torch
from power import _sampled
from torch.profiler import ProfilerActivity, profile

from moekit import GptOssExperts
from moekit.bench import SHAPES, bench_ms, cuda_kernels, environment
from moekit.bench.baselines import TorchtitanExperts
from moekit.bench.experts import _dense_calls
from moekit.testing import routed_counts


def _kernels(step):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in cuda_kernels(prof)]


def _probe(name):
    s = SHAPES[name]
    rows = s.tokens * s.top_k
    counts = routed_counts(s.tokens, s.e, s.top_k, generator=torch.Generator().manual_seed(0)).cuda()
    torch.manual_seed(0)
    ex = GptOssExperts(s.d, s.f, s.e, device="cuda", dtype=torch.bfloat16)
    base = TorchtitanExperts(ex)
    x = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16)
    params = [x, *ex.parameters()]

    def step(mod=ex):
        torch.autograd.grad(mod(x, counts), params, dy)

    for _ in range(3):
        step()
        step(base)
    torch.cuda.synchronize()
    time.sleep(5.0)
    cool = _sampled(step)
    hot_tt = _sampled(lambda: step(base), seconds=3.0)
    hot = _sampled(step)
    med = bench_ms(step)
    print(f"{name}: cool b2b {cool[0]:.2f} ms ({cool[1]:.0f} MHz, {cool[2]:.0f} W) | torchtitan "
          f"{hot_tt[0]:.2f} ms ({hot_tt[1]:.0f} MHz, {hot_tt[2]:.0f} W) | hot b2b {hot[0]:.2f} ms "
          f"({hot[1]:.0f} MHz, {hot[2]:.0f} W) | do_bench median {med:.2f} ms", flush=True)
    ks = _kernels(step)
    print(f"  one hot step: {sum(t for _, t in ks):.2f} ms in {len(ks)} kernels")
    for kname, t in ks:
        if t > 0.05:
            print(f"    {t:7.3f} ms  {kname[:70]}")
    fwd, bwd = _dense_calls(x.detach(), s.d, s.f, "cuda")
    print("  dense GEMMs of the same shapes (fwd: up, down; bwd: dH, dW_down, dX, dW_up):",
          " ".join(f"{t:.3f}" for _, t in _kernels(lambda: (fwd(), bwd()))))


def main():
    print(environment())
    for name in sys.argv[1:] or ["gpt-oss-20b", "gpt-oss-120b"]:
        _probe(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
