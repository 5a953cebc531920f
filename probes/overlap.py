"""Can the SwiGLU backward pass run beside a weight-gradient GEMM? With h saved from the forward,
dW_down = h^T @ dOut does not wait for the pass (aux, dH) -> d_aux, so the two could share the GPU:
the persistent GEMM on all but S SMs, the bandwidth-bound pass on a second stream, filling the S SMs
the GEMM leaves free (and all of them once the GEMM is done). Times, per gpt-oss shape, the two one
after the other against the two side by side for several S, in paired rounds (ratios to sequential).

    python probes/overlap.py [gpt-oss-20b gpt-oss-120b]
"""

import sys

import torch

from moekit import config
from moekit.bench import SHAPES, environment, paired_ratios
from moekit.epilogue import SwiGLU
from moekit.experts import swiglu_bwd
from moekit.grouped_gemm import _ragged_k
from moekit.testing import offs_from_counts, routed_counts

ROUNDS = 10


def _problem(name):
    s = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    offs = offs_from_counts(routed_counts(s.tokens, s.e, s.top_k, generator=gen), device="cuda")
    m, d, f = s.tokens * s.top_k, s.d, s.f
    bf16 = torch.bfloat16
    h = torch.randn(m, f, device="cuda").to(bf16)
    dout = torch.randn(m, d, device="cuda").to(bf16)
    aux = (torch.randn(m, 2 * f, device="cuda") * 3).to(bf16)
    dh = torch.randn(m, f, device="cuda").to(bf16)
    return offs, h, dout, aux, dh


def main(names):
    print(environment())
    for name in names or ["gpt-oss-20b", "gpt-oss-120b"]:
        _compare(name)


def _compare(name):
    spec = SwiGLU()
    sms = config.num_sms(torch.device("cuda"))
    offs, h, dout, aux, dh = _problem(name)

    def gemm(cap=None):
        saved = config.num_sms
        if cap is not None:
            config.num_sms = lambda device: cap
        try:
            return _ragged_k(h.mT, dout, offs, dout.dtype, None, colsum=True)
        finally:
            config.num_sms = saved

    def seq():
        gemm()
        swiglu_bwd(aux, dh, spec)

    def par(free, side, pass_first=False):
        def run():
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            if not pass_first:
                gemm(sms - free)
            with torch.cuda.stream(side):
                swiglu_bwd(aux, dh, spec)
            if pass_first:
                gemm(sms - free)
            main_stream.wait_stream(side)
        return run

    low, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    fns = {"gemm": gemm, "pass": lambda: swiglu_bwd(aux, dh, spec), "seq": seq}
    for free in (0, 8, 16, 24, 32, 48):
        fns[f"par{free}"] = par(free, low)
    fns["par16-hi"] = par(16, high)
    fns["par24-hi"] = par(24, high)
    fns["par0-passfirst"] = par(0, low, pass_first=True)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    cells = paired_ratios(fns, "seq", rounds=ROUNDS)
    print(f"{name}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
