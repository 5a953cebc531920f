"""Probe: the MoE block (``moekit.MoE``, gpt-oss-20b) with and without the warp-specialized kernels.

Times the forward and a training step with the ``warp_specialized`` option toggled in-process, interleaved over four
rotating rounds, so that both variants see the same GPU and the same clocks; then prints the
per-kernel CUDA time of three steps of each (torch.profiler). A development tool: the committed tables
come from ``python -m moekit bench``.

    python probes/block_ws.py [shape]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile
from ws import _toggled  # (probes/ is on sys.path when run as a script)

from moekit.bench import SHAPES, environment, interleaved_ms
from moekit.layers import MoE


def main(name: str):
    s = SHAPES[name]
    torch.manual_seed(0)
    moe = MoE(s.d, s.f, s.e, s.top_k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(s.tokens, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *moe.parameters()]
    steps = {ws: _toggled(lambda: torch.autograd.grad(moe(x), params, dy), ws) for ws in (True, False)}
    fns = {}
    for ws in (True, False):
        fns["ws" if ws else "triton", "fwd"] = _toggled(lambda: moe(x), ws)
        fns["ws" if ws else "triton", "step"] = steps[ws]
    for fn in fns.values():
        fn()  # compile outside the timing
    for key, ms in interleaved_ms(fns, rounds=4).items():
        print(f"{name} {key[0]} {key[1]}: {ms:.3f} ms")
    for ws in (True, False):
        steps[ws]()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                steps[ws]()
            torch.cuda.synchronize()
        print("ws" if ws else "triton (warp_specialized=False)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    print(environment())
    main(next((a for a in sys.argv[1:] if a in SHAPES), "gpt-oss-20b"))
