"""``grouped_mm_nvfp4_wgrad``, the ragged-K grouped GEMM on NVFP4 operands: the op (the interpreter,
and ``-m gpu`` a CUDA GPU) and its reference against a float64 oracle of their own decode, on ragged
groups with an empty one, a group starting inside a 16-element block, columns past offs[-1] with NaN
scales, every output dtype; the same errors on both paths; opcheck; no host sync, a CUDA-graph replay
with new data and routing, and torch.compile."""

import pytest
import torch

import moekit
from moekit import grouped_mm_nvfp4_wgrad, grouped_mm_nvfp4_wgrad_ref, nvfp4
from moekit.nvfp4.gemm import _grouped_mm_nvfp4_wgrad_op
from moekit.testing import offs_from_counts

FP4, E4M3, U8 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.uint8
BF16, F32 = torch.bfloat16, torch.float32
DEV = "cuda"
gpu = pytest.mark.gpu
_E2M1 = torch.tensor(nvfp4.E2M1_VALUES + tuple(-v for v in nvfp4.E2M1_VALUES), dtype=torch.float64)


def _operands(counts, t, m, n, device="cpu"):
    """x^T (M, T) and dy^T (N, T) quantized along T, columns of very different magnitudes, offs over T."""
    x = torch.randn(t, m, device=device) * torch.logspace(-4, 1, m, device=device)
    dy = torch.randn(t, n, device=device) * torch.logspace(-6, 0, t, device=device)[:, None]
    return (*nvfp4.quantize_ref(x.T.contiguous()), *nvfp4.quantize_ref(dy.T.contiguous()),
            offs_from_counts(counts, device))


def _decode(values, scales):  # the oracle's own decode: code table times the block's scale
    b = values.view(U8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)
    return _E2M1.to(values.device)[codes] * scales.double().repeat_interleave(16, dim=-1)


def _assert_matches_oracle(out, args):
    a_v, a_s, a_g, b_v, b_s, b_g, offs = args
    a, b = _decode(a_v, a_s), _decode(b_v, b_s)
    want = torch.zeros(offs.numel(), a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    absdot = torch.zeros_like(want)
    start, scale = 0, a_g.double() * b_g.double()
    for g, end in enumerate(offs.tolist()):
        want[g] = a[:, start:end] @ b[:, start:end].T * scale
        absdot[g] = a[:, start:end].abs() @ b[:, start:end].T.abs() * scale
        start = end
    rounding = {BF16: 2**-8, torch.float16: 2**-11, F32: 0.0}[out.dtype]
    accumulation = (a.shape[1] + 4) * 2**-23 * absdot
    tol = rounding * (want.abs() + accumulation) + accumulation + (2**-25 if out.dtype == torch.float16 else 0.0)
    assert out.shape == want.shape and torch.isfinite(out).all()
    err = (out.double() - want).abs()
    assert (err <= tol).all(), (float(err.max()), (err > tol).nonzero()[:8].tolist())
    empty = [g for g in range(offs.numel()) if int(offs[g]) == (int(offs[g - 1]) if g else 0)]
    assert (out[empty] == 0).all(), "a group with no columns must be exactly zero"


CASES = [  # (columns per group, T, M, N)
    pytest.param([32, 0, 48, 16], 112, 40, 24, id="aligned-with-empty"),
    pytest.param([21, 0, 40, 3], 80, 33, 17, id="groups-inside-blocks-odd-m-n"),  # 21, 61: mid-block starts
    pytest.param([0, 0, 64], 96, 16, 8, id="one-hot-tail"),  # one group; 32 columns past offs[-1]
    pytest.param([16], 16, 1, 1, id="one-block"),
    pytest.param([0, 0], 32, 8, 8, id="all-tail"),  # no group owns any column: all zeros
]


@pytest.mark.parametrize("counts, t, m, n", CASES)
@pytest.mark.parametrize("out_dtype", [BF16, torch.float16, F32])
def test_op_and_reference_match_the_oracle(interpreter, counts, t, m, n, out_dtype):
    args = _operands(counts, t, m, n)
    end = sum(counts)
    if end % 16 == 0 and t > end:  # NaN scale codes past offs[-1]: they must not reach the output
        args[1].view(U8)[:, end // 16:] = 0x7F
        args[4].view(U8)[:, end // 16:] = 0xFF
    out = grouped_mm_nvfp4_wgrad(*args, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    _assert_matches_oracle(out, args)
    _assert_matches_oracle(grouped_mm_nvfp4_wgrad_ref(*args, out_dtype=out_dtype), args)


def _bad(i, value):
    def change(args):
        args = list(args)
        args[i] = value(args[i])
        return args
    return change


ERRORS = [
    (_bad(0, lambda v: v.view(U8)), TypeError, "a_values must be a torch.float4_e2m1fn_x2 tensor"),
    (_bad(4, lambda s: s.view(U8)), TypeError, "b_scales must be a torch.float8_e4m3fn tensor"),
    (_bad(6, lambda o: o.long()), TypeError, "offs must be a torch.int32 tensor"),
    (_bad(3, lambda v: v[:, :-8]), ValueError, "with one T"),
    (_bad(1, lambda s: s[:, :-1]), ValueError, "a_scales must be"),
    (_bad(5, lambda g: g.reshape(1)), ValueError, "b_global must be 0-dim"),
    (_bad(6, lambda o: o[:0]), ValueError, "offs must be 1-D with E >= 1"),
    (_bad(0, lambda v: v[:, :4]), ValueError, "with one T"),
]


@pytest.mark.parametrize("breaks, error, message", ERRORS)
def test_errors_are_identical_on_both_paths(interpreter, breaks, error, message):
    args = breaks(_operands([32, 16], 48, 8, 8))
    messages = []
    for fn in (grouped_mm_nvfp4_wgrad, grouped_mm_nvfp4_wgrad_ref):
        with pytest.raises(error, match=message) as info:
            fn(*args)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_mm_nvfp4_wgrad(*_operands([16], 16, 8, 8), out_dtype=torch.int32)


def _op_args(args, out_dtype=BF16):
    a_v, a_s, a_g, b_v, b_s, b_g, offs = args
    return (a_v.view(U8), a_s.view(U8), a_g, b_v.view(U8), b_s.view(U8), b_g, offs, out_dtype)


def test_custom_op_passes_opcheck(interpreter):
    torch.library.opcheck(_grouped_mm_nvfp4_wgrad_op, _op_args(_operands([20, 0, 28], 64, 16, 8)))


@gpu
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_op_matches_the_oracle_gpu(out_dtype):
    counts = [300, 0, 900, 77, 512, 1, 0, 250]
    args = _operands(counts, 2112, 384, 320, device=DEV)  # 72 columns past offs[-1]
    _assert_matches_oracle(grouped_mm_nvfp4_wgrad(*args, out_dtype=out_dtype), args)


@gpu
def test_no_host_sync_graph_replay_and_compile_gpu():
    """No host sync; captured once and replayed after new operands and new offs are copied in;
    torch.compile with fullgraph."""
    t, m, n = 1024, 256, 192
    args = _operands([200, 300, 0, 400], t, m, n, device=DEV)
    want = grouped_mm_nvfp4_wgrad(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_mm_nvfp4_wgrad(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    compiled = torch.compile(lambda *a: grouped_mm_nvfp4_wgrad(*a) * 2, fullgraph=True)
    assert torch.equal(compiled(*args), want * 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_mm_nvfp4_wgrad(*args)
    new = _operands([0, 512, 100, 300], t, m, n, device=DEV)
    for dst, src in zip(args, new, strict=True):
        (dst.view(U8) if dst.dtype in (FP4, E4M3) else dst).copy_(src.view(U8) if src.dtype in (FP4, E4M3) else src)
    graph.replay()
    _assert_matches_oracle(out, args)
    assert moekit.config.uses_triton(out.device)
