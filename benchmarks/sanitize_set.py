"""The representative set that ``benchmarks/sanitize.sh`` runs under compute-sanitizer: every kernel
family and path once, on tiny shapes that still hit group tails, empty experts and rows past
``offs[-1]``. Each case runs its op forward and backward and checks the result against the float64
reference, so a kernel that the sanitizer passes but that computes garbage still fails.

``python benchmarks/sanitize_set.py [--list] [--kernels] [case ...]``: run the named cases (default:
all) and print one line per case; ``--kernels`` also names the Triton and Gluon kernels each case
launched (torch.profiler), the coverage that the sanitizer's table stands for.

The cases:
- ``gemm_tma``: 2D x 3D grouped GEMM on the TMA / warp-specialized path (bf16, aligned K and N), its
  dgrad and its ragged-K weight gradient, with an empty expert and rows past ``offs[-1]``;
- ``gemm_ws``: the same with >= 128 rows per group on average, so that the forward and the dgrad take
  the warp-specialized rows-ragged Gluon kernel (smaller groups keep Triton's kernel);
- ``gemm_pointer``: the same on the pointer-load path (K and N not 16-byte aligned), fp16;
- ``gemm_wgrad_empty``: ragged-K with every group but one empty;
- ``moe_plain``: the MoE block with plain SwiGLU and no biases (router, routing scan, permute-free
  up-projection with row scales, fused down-projection, plain combine, dSwiGLU, the row scatter);
- ``moe_gpt_oss``: the gpt-oss block (biases, the gpt-oss SwiGLU, the weighted combine and its
  weight gradient, the ones column that hands db_up to the weight-gradient GEMM);
- ``moe_ws``: the plain block with >= 128 routed rows per expert: the down-projection and the
  up-projection's dgrad on the warp-specialized rows-ragged kernel;
- ``moe_dswiglu``: the gpt-oss block with >= 128 routed rows per expert and ``fused_dswiglu=True``: the
  down-projection's dgrad on the dSwiGLU-epilogue kernel (which serves blocks whose routing weights
  are applied after the down-projection: the gpt-oss configuration);
- ``nvfp4``: quantize with an amax on the device, dequantize, and the ragged tiled scale layout;
- ``nvfp4_gemm``: the NVFP4 grouped GEMM with few rows per expert (the transposed tile, A decoded
  beforehand) and with many (the plain tile), an empty expert and rows past ``offs[-1]``;
- ``nvfp4_swiglu``: the standalone SwiGLU -> NVFP4 pass and the fused up-projection writing NVFP4 h,
  the latter with >= 128 rows per expert (the warp-specialized ``SWIGLU_NVFP4`` epilogue on Hopper)
  and with fewer (the Triton kernel).
"""

from __future__ import annotations

import sys

import torch

import moekit
from moekit import nvfp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the references (a smoke test of this file)


def _offs(counts):
    return torch.tensor(counts, device=DEV, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _check(got, want, what, tol):
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.2e} > {tol:.0e}")


def _gemm_case(k, n, dtype, counts, rows):
    torch.manual_seed(0)
    e = len(counts)
    offs = _offs(counts)
    a = torch.randn(rows, k, device=DEV, dtype=dtype, requires_grad=True)
    w = torch.randn(e, k, n, device=DEV, dtype=dtype, requires_grad=True)
    out = moekit.grouped_mm(a, w, offs)
    dout = torch.randn_like(out)
    da, dw = torch.autograd.grad(out, (a, w), dout)
    a64, w64 = a.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = moekit.grouped_mm_ref(a64, w64, offs)
    dref = torch.autograd.grad(ref, (a64, w64), dout.double())
    _check(out, ref, "grouped_mm", 1e-2)
    _check(da, dref[0], "grouped_mm dgrad", 1e-2)
    _check(dw, dref[1], "grouped_mm wgrad", 1e-2)
    if rows > int(offs[-1]):
        assert torch.all(out[int(offs[-1]):] == 0), "rows past offs[-1] are not zero"


def gemm_tma():
    _gemm_case(128, 192, torch.bfloat16, [70, 0, 129, 1, 64], 300)


def gemm_ws():
    _gemm_case(128, 256, torch.bfloat16, [300, 0, 257, 1, 130], 720)


def gemm_pointer():
    _gemm_case(72, 40, torch.float16, [33, 0, 65, 7], 120)


def gemm_wgrad_empty():
    torch.manual_seed(1)
    offs = _offs([0, 0, 97, 0])
    a = torch.randn(64, 120, device=DEV, dtype=torch.bfloat16)  # (M, Kt)
    b = torch.randn(120, 80, device=DEV, dtype=torch.bfloat16)  # (Kt, N)
    out = moekit.grouped_mm(a, b, offs)
    _check(out, moekit.grouped_mm_ref(a.double(), b.double(), offs), "ragged-K grouped_mm", 1e-2)
    assert torch.all(out[[0, 1, 3]] == 0), "an empty group's weight gradient is not zero"


def _moe_case(e=8, t=77, **kw):
    torch.manual_seed(2)
    d, f, k = 128, 192, 2
    moe = moekit.MoE(d, f, e, k, device=DEV, dtype=torch.bfloat16, **kw)
    x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y = moe(x)
    grads = torch.autograd.grad(y, [x, *moe.parameters()], torch.randn_like(y))
    assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads), "non-finite output"


def moe_plain():
    _moe_case(bias=False, router_bias=False, activation="swiglu")


def moe_gpt_oss():
    _moe_case()


def moe_ws():
    _moe_case(e=4, t=300, bias=False, router_bias=False, activation="swiglu")


def moe_dswiglu():
    with moekit.options(fused_dswiglu=True):
        _moe_case(e=4, t=300)


def nvfp4_case():
    torch.manual_seed(3)
    x = torch.randn(200, 96, device=DEV, dtype=torch.bfloat16)
    values, scales, g = nvfp4.quantize(x)
    ref = nvfp4.quantize_ref(x)
    assert torch.equal(values.view(torch.uint8), ref[0].view(torch.uint8)), "nvfp4 values"
    assert torch.equal(scales.view(torch.uint8), ref[1].view(torch.uint8)), "nvfp4 scales"
    assert torch.equal(nvfp4.dequantize(values, scales, g), nvfp4.dequantize_ref(*ref)), "nvfp4 dequantize"
    offs = _offs([50, 0, 129, 1])  # rows 180-199 are past offs[-1]
    got = nvfp4.to_blocked_ragged(scales, offs)
    assert torch.equal(got.view(torch.uint8), nvfp4.to_blocked_ragged_ref(scales, offs).view(torch.uint8))


def nvfp4_gemm_case():
    from moekit.nvfp4.gemm import grouped_mm_nvfp4_ref

    torch.manual_seed(4)
    for counts, rows, k, n in (([9, 0, 16, 3], 33, 256, 384), ([300, 0, 257, 130], 700, 128, 200)):
        offs = _offs(counts)
        a = nvfp4.quantize(torch.randn(rows, k, device=DEV))
        w = nvfp4.quantize_weights(torch.randn(len(counts), k, n, device=DEV) * 0.1)
        got = moekit.grouped_mm_nvfp4(*a, *w, offs)
        _check(got.float(), grouped_mm_nvfp4_ref(*a, *w, offs).float(), f"nvfp4 gemm {counts}", 1e-2)


def nvfp4_swiglu_case():
    from moekit.nvfp4 import swiglu as ns

    torch.manual_seed(5)
    pre = (torch.randn(77, 2 * 96, device=DEV) * 3).to(torch.bfloat16)
    got = ns.swiglu_quantize_nvfp4(pre, torch.tensor(0.003, device=DEV))
    want = ns.swiglu_quantize_nvfp4_ref(pre, torch.tensor(0.003, device=DEV))
    _check(nvfp4.dequantize(*got), nvfp4.dequantize(*want), "swiglu -> nvfp4", 5e-2)
    for counts, rows in (([300, 0, 257, 130], 700), ([20, 0, 9], 40)):
        offs = _offs(counts)
        x = torch.randn(rows, 128, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(len(counts), 128, 2 * 160, device=DEV, dtype=torch.bfloat16) * 0.1
        g = torch.tensor(0.003, device=DEV)
        got = ns.grouped_mm_swiglu_nvfp4(x, w, offs, g)
        want = ns.grouped_mm_swiglu_nvfp4_ref(x, w, offs, g)
        _check(nvfp4.dequantize(*got), nvfp4.dequantize(*want), f"up-projection -> nvfp4 {counts}", 5e-2)


CASES = {
    "gemm_tma": gemm_tma,
    "gemm_ws": gemm_ws,
    "gemm_pointer": gemm_pointer,
    "gemm_wgrad_empty": gemm_wgrad_empty,
    "moe_plain": moe_plain,
    "moe_gpt_oss": moe_gpt_oss,
    "moe_ws": moe_ws,
    "moe_dswiglu": moe_dswiglu,
    "nvfp4": nvfp4_case,
    "nvfp4_gemm": nvfp4_gemm_case,
    "nvfp4_swiglu": nvfp4_swiglu_case,
}


def main(argv: list[str]) -> int:
    if "--list" in argv:
        print(" ".join(CASES))
        return 0
    kernels = "--kernels" in argv and DEV == "cuda"
    failed = 0
    for name in [a for a in argv if not a.startswith("--")] or list(CASES):
        try:
            if kernels:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    CASES[name]()
                    torch.cuda.synchronize()
                names = sorted({e.name for e in prof.events() if e.name.startswith("_")})
                print(f"{name} kernels: {' '.join(names)}", flush=True)
            else:
                CASES[name]()
            if DEV == "cuda":
                torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)
        except Exception as exc:  # report and go on: one case's failure must not hide the others'
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
