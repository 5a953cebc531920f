"""Paired A/B of the MoE block's training step with its expert weights stored transposed: the same
logical parameters (E, 2F, D) and (E, D, F), their storage (E, D, 2F) / (E, F, D), so that each GEMM
sees the other unit stride (the dgrads K-major, the forwards N-major). Gradients compared bit for bit.

    python probes/ab_weight_layout.py gpt-oss-20b qwen3-30b-a3b olmoe-1b-7b
"""

import sys

import torch

import moekit
from moekit.bench import BLOCK_SHAPES, environment, paired_ratios
from moekit.bench.moe import CONFIGS


def flip(p):
    return torch.nn.Parameter(p.detach().mT.contiguous().mT)



print(environment())
for name in sys.argv[1:]:
    s = BLOCK_SHAPES[name]
    torch.manual_seed(1)
    x = torch.randn(s.tokens, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    fns, grads = {}, {}
    for label, f1, f2 in (("base", 0, 0), ("w1T", 1, 0), ("w2T", 0, 1), ("bothT", 1, 1)):
        torch.manual_seed(0)
        moe = moekit.MoE(s.d, s.f, s.e, s.top_k, device="cuda", dtype=torch.bfloat16, **CONFIGS["plain"])
        ex = moe.experts
        if f1:
            ex.mlp1_weight_EGD = flip(ex.mlp1_weight_EGD)
        if f2:
            ex.mlp2_weight_EDF = flip(ex.mlp2_weight_EDF)
        params = [x, *moe.parameters()]

        def step(moe=moe, params=params, label=label, grads=grads, x=x, dy=dy):
            grads[label] = torch.autograd.grad(moe(x), params, dy)
        try:
            step()
            fns[label] = step
        except Exception as e:
            print(name, label, "failed:", type(e).__name__, str(e)[:200])
    torch.cuda.synchronize()
    eq = {k: all(torch.equal(a, b) for a, b in zip(grads["base"], grads[k], strict=True)) for k in fns}
    cells = paired_ratios(fns, "base", rounds=7, warmup_ms=30, rep_ms=150)
    print(name, "bit-equal:", eq, "|", " | ".join(cells), flush=True)
