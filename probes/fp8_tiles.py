"""Probe: which tile and operand path the FP8 rows-ragged grouped GEMM (``fp8.grouped_mm_fp8``) should
take on Hopper, and how far it is from bf16 (open question: the FP8 issue's ≥ 1.6× bf16 GEMM target).

Per problem: moekit's bf16 ``grouped_mm``, ``torch._grouped_mm`` (bf16) and, where the installed torch
has it, ``torch._scaled_grouped_mm`` (rowwise FP8: per-row and per-column scales, no promotion), against
``grouped_mm_fp8_fwd`` at several (rows per program, warps, stages) with TMA and with pointer operands;
CUDA-graph replays, balanced experts. Then the weight gradient, FP8 against bf16.

    python probes/fp8_tiles.py [--only forward|wgrad]
"""

import argparse

import torch

import moekit
from moekit import fp8
from moekit.bench import balanced_offs, environment, graph_ms
from moekit.fp8.gemm import grouped_mm_fp8_fwd

PROBLEMS = {  # name: (M routed rows, K, N, E)
    "gpt-oss-20b up": (32768, 2880, 5760, 32),
    "gpt-oss-20b down": (32768, 2880, 2880, 32),
    "qwen3-30b-a3b up": (65536, 2048, 1536, 128),
    "mixtral-8x7b up": (32768, 4096, 28672, 8),
}
TILES = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (128, 8, 5), (256, 8, 3)]


def problem(name, m, k, n, e):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    offs = balanced_offs(m, e)
    av, as_ = fp8.quantize(a)
    wv, ws = fp8.quantize_weights(w)
    fns = {"moekit bf16": lambda: moekit.grouped_mm(a, w.mT, offs),
           "torch._grouped_mm bf16": lambda: torch._grouped_mm(a, w.mT, offs)}
    if hasattr(torch, "_scaled_grouped_mm"):
        rows = torch.rand(m, device="cuda") + 0.5
        cols = torch.rand(e, n, device="cuda") + 0.5
        fns["torch._scaled_grouped_mm rowwise"] = lambda: torch._scaled_grouped_mm(
            av, wv.mT, rows, cols, offs=offs, out_dtype=torch.bfloat16)
    ref = grouped_mm_fp8_fwd(av, as_, wv, ws, offs, torch.float32, tma=False).double()

    def fp8_fn(tile, tma):
        got = grouped_mm_fp8_fwd(av, as_, wv, ws, offs, torch.float32, tile=tile, tma=tma).double()
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < 2.0**-9, (name, tile, tma, err)
        return lambda: grouped_mm_fp8_fwd(av, as_, wv, ws, offs, torch.bfloat16, tile=tile, tma=tma)

    fns[f"fp8 ptr {TILES[0]}"] = fp8_fn(TILES[0], False)
    for tile in TILES:
        fns[f"fp8 tma {tile}"] = fp8_fn(tile, True)
    tf, base = 2.0 * m * n * k / 1e9, None
    for label, fn in fns.items():
        try:
            ms = graph_ms(fn)
        except Exception as err:  # noqa: BLE001 - a peer's unsupported case is a row, not a stop
            print(f"| {name} | {label} | failed: {type(err).__name__}: {str(err)[:80]} | | |", flush=True)
            continue
        base = base or ms
        print(f"| {name} | {label} | {ms:.3f} | {tf / ms:.0f} | {base / ms:.2f} |", flush=True)


def wgrad(name, m, k, n, e):
    """The weight gradient dW (E, N, K) = dY_e^T X_e: FP8 (``weight_grad_fp8``, operands from
    ``quantize_ragged_t``) against moekit's bf16 ragged-K ``grouped_mm``."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = balanced_offs(m, e)
    dy_t, dy_s, _ = fp8.quantize_ragged_t(dy, offs)
    x_t, x_s, _ = fp8.quantize_ragged_t(x, offs)
    fns = {"moekit bf16 wgrad": lambda: moekit.grouped_mm(dy.mT, x, offs),
           "fp8 wgrad (pointers, 64x64)": lambda: fp8.weight_grad_fp8(dy_t, dy_s, x_t, x_s, offs)}
    tf, base = 2.0 * m * n * k / 1e9, None
    for label, fn in fns.items():
        ms = graph_ms(fn)
        base = base or ms
        print(f"| {name} | {label} | {ms:.3f} | {tf / ms:.0f} | {base / ms:.2f} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=["forward", "wgrad"])
    a = p.parse_args()
    print(environment())
    print("| problem | kernel | ms | TF/s | × moekit bf16 |\n|---|---|---|---|---|")
    for name, (m, k, n, e) in PROBLEMS.items():
        if a.only != "wgrad":
            problem(name, m, k, n, e)
        if a.only != "forward":
            wgrad(name, m, k, n, e)


if __name__ == "__main__":
    main()
