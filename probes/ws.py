"""Probe: the warp-specialized Hopper kernels (``_kernels/hopper_gemm.py``) against the Triton ones.

Times, with every implementation interleaved, the six GEMMs of a gpt-oss expert MLP step: the
up-projection with its SwiGLU epilogue, the down-projection with its bias, the two dgrads
(rows ragged) and the two weight gradients (ragged K), with
the ``warp_specialized`` option toggled in-process; torch._grouped_mm and a dense matmul give the scale. Also the
dH dgrad with the opt-in dSwiGLU epilogue ("ws"; "triton": the Triton dgrad plus the pass) against the
plain warp-specialized dgrad plus the pass ("unfused", the default). Checks
each warp-specialized result against the Triton path first. A development tool: the committed
tables come from ``python -m moekit bench``.
"""

import sys

import torch

import moekit
from moekit import config
from moekit.bench import BLOCK_SHAPES, SHAPES, environment, interleaved_ms
from moekit.epilogue import SwiGLU
from moekit.experts import grouped_mm_dswiglu, grouped_mm_swiglu_fwd, swiglu_bwd
from moekit.grouped_gemm import _ragged_k, _ragged_m
from moekit.hopper import ws_gemm
from moekit.testing import offs_from_counts, routed_counts


def _with_options(fn, **changes):
    """fn run under ``moekit.options(**changes)``."""
    def run():
        with moekit.options(**changes):
            return fn()
    return run


def _toggled(fn, ws: bool):
    """fn on the warp-specialized kernels (ws) or on the Triton ones."""
    return _with_options(fn, warp_specialized=ws)


def _fused(fn):
    """fn with the opt-in fused dSwiGLU dgrad (the ``fused_dswiglu`` option)."""
    return _with_options(fn, fused_dswiglu=True)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(names, only=()):
    for name in names:
        probe_shape(name, SwiGLU(), only)


def probe_shape(name, spec, only=()):
    s = SHAPES.get(name) or BLOCK_SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    offs = offs_from_counts(routed_counts(s.tokens, s.e, s.top_k, generator=gen), device="cuda")
    m, d, f, e = s.tokens * s.top_k, s.d, s.f, s.e
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w_up = (torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16) / d**0.5).mT  # (E, D, 2F)
    b_up = torch.randn(e, 2 * f, device="cuda", dtype=torch.bfloat16)
    w_down = (torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16) / f**0.5).mT  # (E, F, D)
    h, aux = grouped_mm_swiglu_fwd(x, w_up, offs, b_up, spec)
    problems = {
        "up+swiglu": (lambda: grouped_mm_swiglu_fwd(x, w_up, offs, b_up, spec), 2 * m * d * 2 * f,
                      lambda: x @ w_up[0], lambda: torch._grouped_mm(x, w_up, offs)),
    }
    b_down = torch.randn(e, d, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    problems["down fwd (bias)"] = (lambda: _ragged_m(h, w_down, offs, bf16, None, bias=b_down), 2 * m * d * f,
                                   lambda: h @ w_down[0], lambda: torch._grouped_mm(h, w_down, offs))
    problems["dH (dgrad)"] = (lambda: _ragged_m(dy, w_down.mT, offs, bf16, None), 2 * m * d * f,
                              lambda: dy @ w_down[0].mT, lambda: torch._grouped_mm(dy, w_down.mT, offs))
    dh_out = torch.empty(m, f, device="cuda", dtype=bf16)
    problems["dH on ws (dgrad)"] = (  # dH as the Gluon kernel would run it where K > N ("triton": what ships)
        lambda: (ws_gemm(dy, w_down.mT, offs, dh_out) if config.use_warp_specialized(dh_out.device)
                 else _ragged_m(dy, w_down.mT, offs, bf16, None)), 2 * m * d * f,
        lambda: dy @ w_down[0].mT, lambda: torch._grouped_mm(dy, w_down.mT, offs))
    problems["dH+dSwiGLU"] = (
        _fused(lambda: grouped_mm_dswiglu(dy, w_down, offs, aux, spec, ones_col=True)), 2 * m * d * f,
        lambda: dy @ w_down[0].mT,
        lambda: swiglu_bwd(aux, _ragged_m(dy, w_down.mT, offs, bf16, None), spec, with_h=True, ones_col=True),
    )
    problems["dX (dgrad)"] = (lambda: _ragged_m(aux, w_up.mT, offs, bf16, None), 4 * m * d * f,
                              lambda: aux @ w_up[0].mT, lambda: torch._grouped_mm(aux, w_up.mT, offs))
    dx_out = torch.empty(m, d, device="cuda", dtype=bf16)
    problems["dX on ws (dgrad)"] = (  # dX as the Gluon kernel would run it ("triton": what ships)
        lambda: (ws_gemm(aux, w_up.mT, offs, dx_out) if config.use_warp_specialized(dx_out.device)
                 else _ragged_m(aux, w_up.mT, offs, bf16, None)), 4 * m * d * f,
        lambda: aux @ w_up[0].mT, lambda: torch._grouped_mm(aux, w_up.mT, offs))
    problems["dW_up (wgrad)"] = (lambda: _ragged_k(x.mT, aux, offs, torch.bfloat16, None), 2 * m * d * 2 * f,
                                 lambda: x.mT @ aux, lambda: torch._grouped_mm(x.mT, aux, offs))
    problems["dW_down (wgrad)"] = (lambda: _ragged_k(h.mT, dy, offs, torch.bfloat16, None), 2 * m * d * f,
                                   lambda: h.mT @ dy, lambda: torch._grouped_mm(h.mT, dy, offs))
    for label, (fn, flops, dense, grouped) in problems.items():
        if only and not any(o in label for o in only):
            continue
        got, want = _toggled(fn, True)(), _toggled(fn, False)()
        errs = [_rel(g, w_) for g, w_ in zip(got if isinstance(got, tuple) else (got,),
                                               want if isinstance(want, tuple) else (want,), strict=True)
                if g is not None]
        other = "unfused" if label == "dH+dSwiGLU" else "torch"
        ms = interleaved_ms({"ws": _toggled(fn, True), "triton": _toggled(fn, False),
                             other: _toggled(grouped, True), "dense": dense}, rounds=3, rep_ms=100)
        cells = " ".join(f"{k} {v:.3f} ms ({flops / v / 1e9:.0f})" for k, v in ms.items())
        print(f"{name} {label}: diff vs triton {max(errs):.1e} | {cells}", flush=True)


if __name__ == "__main__":
    print(environment())
    assert config.use_warp_specialized(torch.device("cuda")), "needs an sm_90 GPU and Gluon"
    # arguments: shape names, and substrings of the problem labels to time (default: all)
    main([a for a in sys.argv[1:] if a in SHAPES or a in BLOCK_SHAPES] or ["gpt-oss-20b", "gpt-oss-120b"],
         [a for a in sys.argv[1:] if a not in SHAPES and a not in BLOCK_SHAPES])
