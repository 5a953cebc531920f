"""SwiGLU fused with NVFP4 quantization: the standalone kernel and the up-projection GEMM, bit for bit
against their references and against the unfused path (SwiGLU kernel, then the quantizer) on CPU
tensors under the interpreter; on a CUDA GPU (``-m gpu``) at larger sizes, with no host sync and
under CUDA-graph capture. Every output starts NaN-poisoned (conftest), so bit equality also shows
that each byte was written."""

import re

import pytest
import torch

import moekit
from moekit import nvfp4
from moekit.nvfp4 import swiglu as ns

BF16 = torch.bfloat16
DEV = "cuda"
gpu = pytest.mark.gpu
LAYOUTS = ["interleaved", "halves", "interleaved8"]
VARIANTS = {
    "gpt-oss": dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0),
    "silu": dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0),
}


def _assert_bit_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (i, a.dtype, b.dtype, a.shape, b.shape)
        bad = a.view(torch.uint8) != b.view(torch.uint8) if a.element_size() == 1 else a != b
        assert not bad.any(), (i, int(bad.sum()), bad.nonzero()[:8].tolist())


def _unfused(pre, g, layout, kw):
    """The two-kernel path: moekit.swiglu (its "halves" on deinterleaved columns for interleaved8), then
    nvfp4.quantize; the fused kernel must give its bits."""
    if layout == "interleaved8":
        pre, layout = nvfp4.deinterleave8_ref(pre), "halves"
    return nvfp4.quantize(moekit.swiglu(pre, gate_up_layout=layout, **kw), g)


# --------------------------------------------------------------------------------------------------
# the standalone kernel
# --------------------------------------------------------------------------------------------------

SWIGLU_CASES = [  # (M, F, scale of pre, global scale), why
    pytest.param(19, 48, 4.0, 0.004, id="odd-rows-partial-f-tile"),  # F = 32 + 16: a partial column tile
    pytest.param(1, 16, 1.0, 0.001, id="one-row-one-block"),
    pytest.param(0, 32, 1.0, 0.001, id="m0"),
    pytest.param(17, 32, 30.0, 1e-5, id="saturating"),  # |pre| >> limit; block scales clamp at 448, codes at 6
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy: exp of a large -x, on purpose
@pytest.mark.parametrize("m, f, spread, g", SWIGLU_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_swiglu_quantize_kernel(interpreter, m, f, spread, g, layout, variant):
    kw = VARIANTS[variant]
    pre = (torch.randn(m, 2 * f) * spread).to(BF16)
    g = torch.tensor(g)
    got = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout, **kw)
    assert got[0].shape == (m, f // 2) and got[1].shape == (m, f // 16)
    _assert_bit_equal(got, ns.swiglu_quantize_nvfp4_ref(pre, g, gate_up_layout=layout, **kw))
    _assert_bit_equal(got, _unfused(pre, g, layout, kw))
    if spread > 4:
        assert (got[1].float() == 448).any() and ((nvfp4.unpack_ref(got[0]) & 7) == 7).any()


def test_swiglu_quantize_kernel_fp32_and_strided_rows(interpreter):
    """fp32 pre (h is not rounded: the unfused h is fp32 too) and a row stride wider than 2F."""
    pre = torch.randn(9, 96) * 3
    g = torch.tensor(0.003)
    for p in (pre, pre.to(BF16)[:, :64]):
        got = ns.swiglu_quantize_nvfp4(p, g, gate_up_layout="halves")
        _assert_bit_equal(got, ns.swiglu_quantize_nvfp4_ref(p, g, gate_up_layout="halves"))


# --------------------------------------------------------------------------------------------------
# the up-projection GEMM with the SwiGLU -> NVFP4 epilogue
# --------------------------------------------------------------------------------------------------


def _exact(shape, device="cpu"):
    """Multiples of 1/4 in [-2, 2]: every product and partial sum of a short K is exact in fp32, so
    any accumulation order gives the reference's pre, and the comparison can be bit for bit."""
    return (torch.randint(-8, 9, shape, device=device).float() / 4).to(BF16)


def _gemm_inputs(counts, extra, d, f, *, k_major=False, device="cpu"):
    e = len(counts)
    x = _exact((sum(counts) + extra, d), device)
    w = _exact((e, 2 * f, d), device).mT if k_major else _exact((e, d, 2 * f), device)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return x, w, _exact((e, 2 * f), device), offs


GEMM_CASES = [  # (counts per expert, rows past offs[-1]), why
    pytest.param([10, 0, 20], 7, id="empty-expert-and-tail-rows"),
    pytest.param([0, 0, 33], 0, id="one-hot-expert"),
    pytest.param([1], 0, id="one-row"),
    pytest.param([0, 0], 0, id="m0"),
]


def _check_gemm(x, w, offs, bias, g, layout, kw):
    got = ns.grouped_mm_swiglu_nvfp4(x, w, offs, g, bias=bias, gate_up_layout=layout, **kw)
    want = ns.grouped_mm_swiglu_nvfp4_ref(x, w, offs, g, bias=bias, gate_up_layout=layout, **kw)
    (_assert_bit_equal if x.device.type == "cpu" else _close_to_ref)(got, want)
    if layout == "interleaved8":  # the bf16 fused GEMM on the same columns in halves order
        w, bias, layout = nvfp4.deinterleave8_ref(w), nvfp4.deinterleave8_ref(bias), "halves"
    h, _ = moekit.grouped_mm_swiglu(x, w, offs, bias=bias, gate_up_layout=layout, **kw)
    _assert_bit_equal(got, nvfp4.quantize(h, g))
    return got


@pytest.mark.parametrize("counts, extra", GEMM_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_mm_swiglu_nvfp4(interpreter, counts, extra, layout):
    x, w, bias, offs = _gemm_inputs(counts, extra, 32, 32)
    values, scales, _ = _check_gemm(x, w, offs, bias, torch.tensor(0.002), layout, VARIANTS["gpt-oss"])
    tail = slice(int(offs[-1]) if len(counts) else 0, None)
    assert not values[tail].view(torch.uint8).any() and not scales[tail].view(torch.uint8).any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_mm_swiglu_nvfp4_pointer_path_k_major_silu(interpreter, layout):
    """The plain-pointer loads, a K-major weight (w.mT) and plain silu(gate) * up, two column tiles."""
    x, w, bias, offs = _gemm_inputs([5, 12], 3, 48, 32, k_major=True)
    with moekit.options(tma=False):
        _check_gemm(x, w, offs, bias, torch.tensor(0.01), layout, VARIANTS["silu"])


# --------------------------------------------------------------------------------------------------
# custom ops, errors
# --------------------------------------------------------------------------------------------------


def test_custom_ops_pass_opcheck(interpreter):
    pre = torch.randn(5, 64).to(BF16)
    g = torch.ones(1)
    torch.library.opcheck(ns._swiglu_quantize_op, (pre, g, 1.702, 7.0, 1.0, "interleaved8"))
    x, w, bias, offs = _gemm_inputs([3, 2], 1, 16, 16)
    torch.library.opcheck(ns._grouped_mm_swiglu_nvfp4_op, (x, w, offs, bias, g, 1.0, None, 0.0, "halves"))


def _error_cases():
    pre, g = torch.randn(4, 64).to(BF16), torch.tensor(0.01)
    x, w, _, offs = _gemm_inputs([2, 2], 0, 16, 16)
    return [  # op, args, kwargs, exception, message fragment
        ("swiglu_quantize_nvfp4", (pre[:, :48], g), {}, ValueError, "multiple of 16"),
        ("swiglu_quantize_nvfp4", (pre.int(), g), {}, TypeError, "bfloat16, float16 or float32"),
        ("swiglu_quantize_nvfp4", (pre.mT.contiguous().mT, g), {}, ValueError, "unit column stride"),
        ("swiglu_quantize_nvfp4", (pre, torch.ones(1)), {}, ValueError, "0-dim"),
        ("swiglu_quantize_nvfp4", (pre, 0.5), {}, TypeError, "floating-point tensor"),
        ("swiglu_quantize_nvfp4", (pre, g), {"gate_up_layout": "blocks"}, ValueError, "gate_up_layout"),
        ("swiglu_quantize_nvfp4", (pre, g), {"swiglu_limit": -1.0}, ValueError, "limit"),
        ("grouped_mm_swiglu_nvfp4", (x, w[..., :16], offs, g), {}, ValueError, "multiple of 16"),
        ("grouped_mm_swiglu_nvfp4", (x, w, offs.long(), g), {}, TypeError, "int32"),
        ("grouped_mm_swiglu_nvfp4", (x, w, offs, g.reshape(1)), {}, ValueError, "0-dim"),
        ("grouped_mm_swiglu_nvfp4", (x, w, offs, g), {"gate_up_layout": "blocks"}, ValueError, "gate_up_layout"),
    ]


def test_bad_inputs_raise_the_same_errors_from_kernel_and_reference():
    for name, args, kwargs, exc, fragment in _error_cases():
        messages = []
        for fn in (getattr(ns, name), getattr(ns, f"{name}_ref")):
            with pytest.raises(exc, match=re.escape(fragment)) as info:
                fn(*args, **kwargs)
            messages.append(str(info.value))
        assert messages[0] == messages[1], (name, messages)


# --------------------------------------------------------------------------------------------------
# on a CUDA GPU: larger sizes, no host sync, CUDA-graph capture
# --------------------------------------------------------------------------------------------------


def _differ(a, b) -> float:
    return (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()


def _close_to_ref(got, want):
    """Against the torch reference a GPU kernel may round a few h differently (its exp is approximate,
    module docstring of moekit.nvfp4.swiglu): few bytes may differ, never the global scale."""
    assert _differ(got[0], want[0]) < 1e-3 and _differ(got[1], want[1]) < 1e-3
    _assert_bit_equal(got[2:], want[2:])


BAD_GLOBAL_SCALES = (-0.01, -0.0, float("nan"), 0.0, float("inf"))


def _check_bad_global_scales(device):
    """Global scales outside the format (nvfp4.quantize's rule): all-zero values, the reference's bytes
    from the SwiGLU pass and the fused up-projection."""
    pre = (torch.randn(19, 96, device=device) * 3).to(BF16)
    x, w, bias, offs = _gemm_inputs([5, 0, 9], 3, 32, 48, device=device)
    for g in BAD_GLOBAL_SCALES:
        g = torch.tensor(g, device=device)
        got = ns.swiglu_quantize_nvfp4(pre, g)[:2]  # (the global scale is returned as given: NaN != NaN)
        _assert_bit_equal(got, ns.swiglu_quantize_nvfp4_ref(pre, g)[:2])
        assert not got[0].view(torch.uint8).any()
        got = ns.grouped_mm_swiglu_nvfp4(x, w, offs, g, bias=bias)[:2]
        _assert_bit_equal(got, ns.grouped_mm_swiglu_nvfp4_ref(x, w, offs, g, bias=bias)[:2])
        _check_fused_bad_scale(got, x, w, offs, bias, g)


def _check_fused_bad_scale(got, x, w, offs, bias, g):
    """The fused up-projection's (values, scales): nvfp4.quantize's bytes of its h on the experts' rows,
    all-zero bytes past offs[-1] (the documented tail, whatever the global scale)."""
    end = int(offs[-1])
    want = nvfp4.quantize(moekit.grouped_mm_swiglu(x, w, offs, bias=bias)[0], g)[:2]
    _assert_bit_equal([t[:end] for t in got], [t[:end] for t in want])
    assert not got[0].view(torch.uint8).any() and not got[1][end:].view(torch.uint8).any()


def test_bad_global_scales(interpreter):
    _check_bad_global_scales("cpu")


@gpu
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_bad_global_scales_gpu(gluon):
    """The same on the GPU kernels: the Gluon or Triton pass, and the fused up-projection (warp-specialized
    on Hopper at these sizes when the layout allows, else Triton)."""
    with moekit.options(gluon_quantize=gluon):
        _check_bad_global_scales(DEV)
    x, w, bias, offs = _gemm_inputs([200, 0, 333], 40, 256, 512, device=DEV)
    for g in BAD_GLOBAL_SCALES:
        g = torch.tensor(g, device=DEV)
        _check_fused_bad_scale(ns.grouped_mm_swiglu_nvfp4(x, w, offs, g, bias=bias)[:2], x, w, offs, bias, g)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_swiglu_quantize_gpu(layout, variant, gluon):
    """Both kernels of the standalone pass (the Gluon one on Hopper and newer, the ``gluon_quantize``
    option), bit for bit against the unfused path, on a row count and an F that leave partial tiles."""
    kw = VARIANTS[variant]
    pre = (torch.randn(4099, 2 * 2880, device=DEV) * 3).to(BF16)
    g = torch.tensor(0.002, device=DEV)
    with moekit.options(gluon_quantize=gluon):
        assert moekit.config.use_gluon_quantize(pre.device) == (gluon and torch.cuda.get_device_capability()[0] >= 9)
        got = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout, **kw)
    _assert_bit_equal(got, _unfused(pre, g, layout, kw))
    _close_to_ref(got, ns.swiglu_quantize_nvfp4_ref(pre, g, gate_up_layout=layout, **kw))


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_swiglu_quantize_gpu_odd_shapes_and_dtypes(layout):
    """The Gluon pass on a few rows and F = 48 (a partial block row per tile), fp32 and fp16 pre, and
    rows strided wider than 2F: bit for bit against the Triton pass."""
    g = torch.tensor(0.003, device=DEV)
    base = torch.randn(37, 160, device=DEV) * 3
    for pre in (base[:, :96], base[:, :96].half(), base.to(BF16)[:, :96], base.to(BF16)[:1, :32]):
        got = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout)
        with moekit.options(gluon_quantize=False):
            want = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout)
        _assert_bit_equal(got, want)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_mm_swiglu_nvfp4_gpu(layout):
    counts = torch.randint(0, 300, (8,)).tolist()
    counts[2], counts[5] = 0, 0
    x, w, bias, offs = _gemm_inputs(counts, 77, 512, 720, device=DEV)
    g = torch.tensor(0.01, device=DEV)
    with moekit.options(warp_specialized=False):  # the Triton bf16 kernel: the same tiles and K order
        _check_gemm(x, w, offs, bias, g, layout, VARIANTS["gpt-oss"])


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_mm_swiglu_nvfp4_ws_gpu(variant):
    """The warp-specialized up-projection with the SwiGLU -> NVFP4 epilogue (interleaved, bf16) on
    Hopper: bit for bit against ``nvfp4.quantize`` of the warp-specialized bf16 up-projection's h, with
    empty groups, group ends inside row tiles, rows past offs[-1], a partial last column tile
    (2F = 1440 = 5 x 256 + 160), and an ordinary and an fp32-subnormal-divisor global scale."""
    from moekit.hopper import ws_swiglu_nvfp4_ok

    counts = torch.randint(0, 300, (8,)).tolist()
    counts[2], counts[5] = 0, 0
    x, w, bias, offs = _gemm_inputs(counts, 77, 512, 720, device=DEV)
    if not ws_swiglu_nvfp4_ok(x, w):
        pytest.skip("needs the warp-specialized Hopper kernels")
    for g in (0.01, 2.0**-140):
        values, scales, _ = _check_gemm(x, w, offs, bias, torch.tensor(g, device=DEV), "interleaved",
                                        VARIANTS[variant])
        tail = slice(int(offs[-1]), None)
        assert not values[tail].view(torch.uint8).any() and not scales[tail].view(torch.uint8).any()


def _every_op(pre, x, w, bias, offs, g):
    return [*ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout="interleaved8"),
            *ns.grouped_mm_swiglu_nvfp4(x, w, offs, g, bias=bias)]


@gpu
def test_no_host_sync_gpu():
    pre = torch.randn(1000, 1024, device=DEV).to(BF16)
    x, w, bias, offs = _gemm_inputs([100, 0, 300], 5, 256, 512, device=DEV)
    g = torch.tensor(0.01, device=DEV)
    want = _every_op(pre, x, w, bias, offs, g)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _every_op(pre, x, w, bias, offs, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_bit_equal(got, want)


@gpu
def test_cuda_graph_capture_and_replay_with_new_inputs():
    """Captured once; replayed on new pre, new routing (offs) and a new global scale."""
    pre = torch.randn(1000, 1024, device=DEV).to(BF16)
    x, w, bias, offs = _gemm_inputs([100, 0, 300], 5, 256, 512, device=DEV)
    g = torch.tensor(0.01, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _every_op(pre, x, w, bias, offs, g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _every_op(pre, x, w, bias, offs, g)
    pre.copy_(torch.randn_like(pre, dtype=torch.float32))
    offs.copy_(torch.tensor([0, 250, 400], dtype=torch.int32, device=DEV))
    g.fill_(0.02)
    graph.replay()
    want = _every_op(pre, x, w, bias, offs, g)
    _assert_bit_equal(out, want)


@gpu
def test_custom_ops_pass_opcheck_gpu():
    pre = torch.randn(300, 512, device=DEV).to(BF16)
    g = torch.ones(1, device=DEV)
    torch.library.opcheck(ns._swiglu_quantize_op, (pre, g, 1.702, 7.0, 1.0, "interleaved"))
    x, w, bias, offs = _gemm_inputs([100, 0, 50], 3, 128, 256, device=DEV)
    torch.library.opcheck(ns._grouped_mm_swiglu_nvfp4_op, (x, w, offs, bias, g, 1.702, 7.0, 1.0, "interleaved8"))
