"""Seeded random cases of every public bf16 and FP8 op against its float64 reference: random E, routings (random,
empty experts, one hot expert, all rows on none), K/N/D/F sizes, weight layouts (contiguous and .mT
views), sliced inputs, rows past offs[-1] holding NaN, both SwiGLU variants and layouts.

CPU runs the kernels on Triton's interpreter (``--fuzz-cases``, default 200, ~1 minute); ``-m gpu`` runs
the same generator on the GPU at realistic sizes (default 20 cases; pass ``--fuzz-cases 2000`` for the long
run). On the GPU every new shape class compiles kernels (24 cases with free K and N took over 60 s on an
H100), so there K and N come from a fixed menu of sizes, odd and aligned, and the randomness that costs no
compile (rows, routings, tails, layouts, seeds) stays free. A failure names its seed; replay it with
``--fuzz-seed SEED --fuzz-cases 1``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fp8_gemm import _assert_within, _oracle, _wgrad_oracle

import moekit
from moekit import combine, combine_ref, fp8, grouped_mm, grouped_mm_ref, topk_router
from moekit.routing import routing_metadata_ref
from moekit.testing import assert_close, assert_within_baseline, offs_from_counts, random_counts, reference_run

BF16 = torch.bfloat16
SWIGLUS = {
    "gpt-oss": dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0),
    "plain": dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0),
}


# The GPU's K and N: odd multiples of 8 (and of 16 for N, which the SwiGLU halves) beside aligned ones,
# below, at and past one tile
GPU_K = (8, 24, 72, 128, 136, 264, 512, 520, 640)
GPU_N = (16, 48, 80, 128, 144, 272, 528, 640)


@dataclasses.dataclass
class Case:
    seed: int
    counts: list[int]
    tail: int  # rows past offs[-1]
    k: int
    n: int
    b_trans: bool  # the weight as the .mT view of an (E, N, K) parameter
    a_sliced: bool  # a as a column slice of a wider buffer
    swiglu: str
    layout: str
    bias: bool

    def __str__(self) -> str:
        return f"seed {self.seed}: {dataclasses.asdict(self)}"


def _routing(gen, rows: int, e: int) -> list[int]:
    kind = int(torch.randint(0, 8, (1,), generator=gen))
    if kind < 4 or e == 1:
        return random_counts(rows, e, generator=gen)
    counts = [0] * e
    if kind < 6:  # one hot expert
        counts[int(torch.randint(0, e, (1,), generator=gen))] = rows
    elif kind == 6:  # every other expert empty
        for i, c in enumerate(random_counts(rows, (e + 1) // 2, generator=gen)):
            counts[2 * i] = c
    return counts  # kind 7: all zeros, every row past offs[-1]


def make_case(seed: int, *, big: bool) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def pick(lo, hi, step=1):
        return lo + step * int(torch.randint(0, (hi - lo) // step + 1, (1,), generator=gen))

    def menu(sizes):
        return sizes[int(torch.randint(0, len(sizes), (1,), generator=gen))]

    e = pick(1, 9 if big else 5)
    rows = pick(0, 3000 if big else 70)
    # K and N stay multiples of 8 (16-byte strides: the layout contract); odd multiples are the odd sizes
    if big:
        k, n = menu(GPU_K), menu(GPU_N)
    else:
        k, n = pick(8, 72, 8), pick(16, 80, 16)
    flip = [bool(torch.randint(0, 2, (1,), generator=gen)) for _ in range(5)]
    return Case(seed, _routing(gen, rows, e), pick(0, 40 if big else 9), k, n, flip[0], flip[1],
                "gpt-oss" if flip[2] else "plain", "interleaved" if flip[3] else "halves", flip[4])


def _a(case: Case, m: int, k: int, device) -> torch.Tensor:
    base = torch.randn(m, k + (8 if case.a_sliced else 0), device=device).to(BF16)
    a = base[:, 8:] if case.a_sliced else base
    if m:
        a[sum(case.counts) :] = float("nan")  # rows no expert owns: must not leak
    return a


def _weights(case: Case, k: int, n: int, device, scale: float = 1.0) -> torch.Tensor:
    e = len(case.counts)
    if case.b_trans:
        return (torch.randn(e, n, k, device=device) * scale / k**0.5).to(BF16).mT
    return (torch.randn(e, k, n, device=device) * scale / k**0.5).to(BF16)


def check_grouped_mm(case: Case, device) -> None:
    offs = offs_from_counts(case.counts, device=device)
    m = sum(case.counts) + case.tail
    a, b = _a(case, m, case.k, device), _weights(case, case.k, case.n, device)
    out = grouped_mm(a, b, offs)
    assert_close(out, grouped_mm_ref(torch.nan_to_num(a).double(), b.double(), offs), BF16, what=f"fwd {case}")
    assert not out[sum(case.counts) :].any(), f"rows past offs[-1] {case}"
    dy = torch.randn(m, case.n, device=device).to(BF16)
    dw = grouped_mm(a.mT, dy, offs)  # a's NaN rows lie past every group
    ref = grouped_mm_ref(torch.nan_to_num(a).mT.double(), dy.double(), offs)
    assert_close(dw, ref, BF16, what=f"wgrad {case}")
    for g, c in enumerate(case.counts):
        assert c or not dw[g].any(), f"empty expert {g} {case}"


def check_expert_chain(case: Case, device) -> None:
    """grouped_mm_swiglu -> grouped_mm_downproj, forward and every gradient, held to PyTorch's own error."""
    offs = offs_from_counts(case.counts, device=device)
    m, d, f = sum(case.counts) + case.tail, case.k, case.n // 2
    kw = dict(SWIGLUS[case.swiglu], gate_up_layout=case.layout)
    x = torch.nan_to_num(_a(case, m, d, device))
    w1, w2 = _weights(case, d, 2 * f, device, 2.0), _weights(case, f, d, device)
    e = len(case.counts)
    b1 = (torch.randn(e, 2 * f, device=device) * 0.5).to(BF16) if case.bias else None
    b2 = (torch.randn(e, d, device=device) * 0.5).to(BF16) if case.bias else None

    def chain(fns, x, w1, b1, w2, b2):
        h, aux = fns[0](x, w1, offs, bias=b1, **kw)
        return aux, fns[1](h, w2, offs, bias=b2, aux_biased_acc=aux, **kw)

    inputs = [x, w1, b1, w2, b2]
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    aux, out = chain((moekit.grouped_mm_swiglu, moekit.grouped_mm_downproj), *leaves)
    dy = torch.randn_like(out)
    out.backward(dy)
    refs = (moekit.grouped_mm_swiglu_ref, moekit.grouped_mm_downproj_ref)
    (r64, g64), (r16, g16) = (reference_run(lambda *t: chain(refs, *t), inputs, dy, dt) for dt in (torch.float64, BF16))
    names = ("aux", "out", "dx", "dw1", "db1", "dw2", "db2")
    got = [aux, out] + [None if t is None else t.grad for t in leaves]
    for name, g, o, bl in zip(names, got, list(r64) + g64, list(r16) + g16, strict=True):
        if g is not None:
            assert_within_baseline(g, o, bl, what=f"{name} {case}")


def check_routing_and_combine(case: Case, device) -> None:
    """topk_router's metadata equals a stable argsort's; combine against its float64 reference."""
    e = len(case.counts)
    top_k = 1 + case.seed % e
    t = sum(case.counts) // top_k + 1
    x = torch.randn(t, case.k, device=device).to(BF16)
    r = topk_router(x, torch.randn(e, case.k, device=device), None, top_k=top_k)
    for got, want in zip((r.counts, r.offs, r.token_idx, r.row_of), routing_metadata_ref(r.experts, e), strict=True):
        assert torch.equal(got, want), f"routing metadata {case}"
    y = torch.randn(t * top_k, case.n, device=device).to(BF16)
    out = combine(y, r.weights, r.row_of)
    assert_within_baseline(out, combine_ref(y.double(), r.weights.double(), r.row_of),
                           combine_ref(y, r.weights, r.row_of), what=f"combine {case}")


def check_fp8(case: Case, device) -> None:
    """fp8.grouped_mm_fp8 (weights as stored or as a .mT view) and fp8.weight_grad_fp8 against float64
    products of their dequantized operands; x's NaN rows past offs[-1] must not leak."""
    offs = offs_from_counts(case.counts, device=device)
    m = sum(case.counts) + case.tail
    a = _a(case, m, case.k, device)
    ops = (*fp8.quantize(a), *fp8.quantize_weights(_weights(case, case.k, case.n, device).mT), offs)
    out = fp8.grouped_mm_fp8(*ops, out_dtype=torch.float32)
    _assert_within(out, _oracle(*ops), fp8.grouped_mm_fp8_ref(*ops, out_dtype=torch.float32), device,
                   f"fp8 fwd {case}")
    assert not out[sum(case.counts):].any(), f"fp8 rows past offs[-1] {case}"
    dy = torch.randn(m, case.n, device=device).to(BF16)
    ops = (*fp8.quantize_ragged_t(dy, offs)[:2], *fp8.quantize_ragged_t(a, offs)[:2], offs)
    dw = fp8.weight_grad_fp8(*ops, out_dtype=torch.float32)
    _assert_within(dw, _wgrad_oracle(*ops), fp8.weight_grad_fp8_ref(*ops, out_dtype=torch.float32), device,
                   f"fp8 wgrad {case}")
    for g, c in enumerate(case.counts):
        assert c or not dw[g].any(), f"fp8 empty expert {g} {case}"


CHECKS = (check_grouped_mm, check_expert_chain, check_routing_and_combine, check_fp8)


def _seeds(config, default: int) -> list[int]:
    first = config.getoption("--fuzz-seed")
    cases = config.getoption("--fuzz-cases") or default
    return list(range(first, first + cases))


def _run(seeds, device, big: bool) -> None:
    for seed in seeds:
        case = make_case(seed, big=big)
        torch.manual_seed(seed)
        CHECKS[seed % len(CHECKS)](case, device)


def test_fuzz_interpreter(interpreter, pytestconfig):
    _run(_seeds(pytestconfig, 200), "cpu", big=False)


@pytest.mark.gpu
def test_fuzz_gpu(pytestconfig):
    _run(_seeds(pytestconfig, 20), "cuda", big=True)
