"""The kernels (under the interpreter) and the pure-PyTorch reference take the same inputs the same
way: strided inputs and gradients give the same values, bad inputs the same error on both paths.
Each case failed before its fix (a parity audit of the public API)."""

import pytest
import torch

import moekit
from moekit import nvfp4
from moekit.testing import offs_from_counts

BF16 = torch.bfloat16


def _both(fn):
    """fn() on the kernels and on the reference: (kernel result, reference result)."""
    out = []
    for ref in (False, True):
        with moekit.options(reference=ref):
            out.append(fn())
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _column_major(g):
    return g.t().contiguous().t()  # the same values, unit row stride


def test_strided_gradients_reach_the_row_kernels(interpreter):
    """A column-major output gradient (from an einsum, a transposed matmul, ...) into the kernels that
    take only a row stride: the SwiGLU backward pass, the bias column sums, the row gathers."""
    offs = offs_from_counts([8, 8])
    pre = torch.randn(16, 48).to(BF16)
    x = torch.randn(16, 32).to(BF16)
    w1, w2 = torch.randn(2, 32, 48).to(BF16), torch.randn(2, 24, 32).to(BF16)
    b1, b2 = torch.randn(2, 48).to(BF16), torch.randn(2, 32).to(BF16)
    dout = torch.randn(16, 32)

    def swiglu_grad():
        p = pre.clone().requires_grad_()
        y = moekit.swiglu(p)
        y.register_hook(_column_major)
        y.float().mul(torch.ones_like(y, dtype=torch.float32)).sum().backward()
        return p.grad

    def bias_grads():
        leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        h, aux = moekit.grouped_mm_swiglu(leaves[0], leaves[1], offs, bias=leaves[2])
        aux.register_hook(_column_major)  # aux used directly: its gradient arrives column-major
        out = moekit.grouped_mm_downproj(moekit.swiglu(aux), leaves[3], offs, bias=leaves[4])
        out.register_hook(_column_major)
        out.float().mul(dout).sum().backward()
        return [t.grad for t in leaves]

    k, r = _both(swiglu_grad)
    assert _rel(k, r) < 0.02
    for name, k, r in zip(("x", "w1", "b1", "w2", "b2"), *_both(bias_grads), strict=True):
        assert not k.isnan().any() and _rel(k, r) < 0.03, name


def test_strided_tokens_gather_the_right_rows(interpreter):
    x = torch.randn(32, 8).to(BF16).t()  # (8, 32), column-major
    r = moekit.topk_router(x, torch.randn(4, 32), top_k=2)
    k, ref = _both(lambda: moekit.gather_rows(x, r))
    assert torch.equal(k, ref)


def test_one_choice_per_token_ids(interpreter):
    """(T,) expert ids, as a top-1 router gives them: (T,) row_of on both paths."""
    ids = torch.randint(0, 4, (10,))
    for a, b in zip(*_both(lambda: moekit.routing_metadata(ids, 4)), strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_downproj_forward_uses_h_as_given(interpreter):
    """With aux, the forward multiplies h as given on both paths (the reference no longer recomputes it
    from aux), so settings that differ from the up-projection's change only what the backward assumes."""
    offs = offs_from_counts([8, 8])
    plain = dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0)
    h, aux = moekit.grouped_mm_swiglu(torch.randn(16, 32).to(BF16), torch.randn(2, 32, 48).to(BF16), offs, **plain)
    w2 = torch.randn(2, 24, 32).to(BF16)
    k, r = _both(lambda: moekit.grouped_mm_downproj(h, w2, offs, aux_biased_acc=aux))  # gpt-oss's settings here
    assert _rel(k, r) < 0.01


@pytest.mark.parametrize("k, n", [(0, 24), (32, 0)], ids=["K=0", "N=0"])
def test_empty_reductions_and_outputs(interpreter, k, n):
    """K = 0 (zeros) or N = 0 (an empty output), forward and backward: the layout check no longer
    rejects an empty tensor's strides, and both paths agree."""
    offs = offs_from_counts([8, 8])

    def run():
        a = torch.randn(16, k).to(BF16).requires_grad_()
        b = torch.randn(2, k, n).to(BF16).requires_grad_()
        out = moekit.grouped_mm(a, b, offs)
        out.float().sum().backward()
        return out, a.grad, b.grad

    for got, want in zip(*_both(run), strict=True):
        assert got.shape == want.shape and not got.any() and not want.any()
    h, aux = moekit.grouped_mm_swiglu(torch.randn(16, k).to(BF16), torch.randn(2, k, 2 * n).to(BF16), offs)
    assert h.shape == (16, n) and aux.shape == (16, 2 * n)


def test_nvfp4_wgrad_of_no_tokens(interpreter):
    q = nvfp4.quantize(torch.randn(8, 0))
    k, r = _both(lambda: moekit.grouped_mm_nvfp4_wgrad(*q, *q, torch.zeros(2, dtype=torch.int32)))
    assert k.shape == r.shape == (2, 8, 8) and not k.any() and not r.any()


@pytest.mark.parametrize("offs", [[5, 30], [-3, 20], [20, 5, 12], [140, 150, 300]])
def test_blocked_scales_of_bad_offs(interpreter, offs):
    """offs past M, negative or decreasing (unchecked: that would read the device): the same bytes on
    both paths, and no row read outside the scales."""
    scales = nvfp4.quantize(torch.randn(20, 64))[1]
    k, r = _both(lambda: nvfp4.to_blocked_ragged(scales, torch.tensor(offs, dtype=torch.int32)))
    assert torch.equal(k.view(torch.uint8), r.view(torch.uint8))


def _strided(offs):
    """offs as a stride-2 view of a buffer whose other entries are junk."""
    buf = torch.full((offs.numel(), 2), 7, dtype=torch.int32)
    buf[:, 0] = offs
    return buf[:, 0]


def _strided_offs_cases():
    x, h = torch.randn(12, 32).to(BF16), torch.randn(12, 24).to(BF16)
    w, w_up, w_down = torch.randn(3, 32, 16).to(BF16), torch.randn(3, 32, 48).to(BF16), torch.randn(3, 24, 32).to(BF16)
    a_q, w_q = nvfp4.quantize(torch.randn(12, 64)), nvfp4.quantize_weights(torch.randn(3, 64, 32))
    t_q, dy_q = nvfp4.quantize(torch.randn(8, 48)), nvfp4.quantize(torch.randn(16, 48))
    w_up4 = (torch.randn(3, 32, 64) / 4).to(BF16)  # 2F a multiple of 32 (NVFP4 blocks of 16 per half)
    return {
        "grouped_mm": (lambda o: moekit.grouped_mm(x, w, o), [4, 9, 12]),
        "grouped_mm_swiglu": (lambda o: moekit.grouped_mm_swiglu(x, w_up, o), [4, 9, 12]),
        "grouped_mm_downproj": (lambda o: moekit.grouped_mm_downproj(h, w_down, o), [4, 9, 12]),
        "to_blocked_ragged": (lambda o: nvfp4.to_blocked_ragged(a_q[1], o).view(torch.uint8), [4, 9, 12]),
        "grouped_mm_nvfp4": (lambda o: moekit.grouped_mm_nvfp4(*a_q, *w_q, o), [4, 9, 12]),
        "grouped_mm_nvfp4_wgrad": (lambda o: moekit.grouped_mm_nvfp4_wgrad(*t_q, *dy_q, o), [16, 32, 48]),
        "grouped_mm_swiglu_nvfp4": (
            lambda o: [t.view(torch.uint8)
                       for t in moekit.grouped_mm_swiglu_nvfp4(x, w_up4, o, torch.tensor(0.01))[:2]],
            [4, 9, 12]),
    }


@pytest.mark.parametrize("op", list(_strided_offs_cases()))
def test_strided_offs_read_by_position(interpreter, op):
    """offs as a strided view (a column of a bigger int32 tensor): the kernels read it by position, as
    the reference does (they read junk between the entries and zeroed groups)."""
    fn, ends = _strided_offs_cases()[op]
    offs = torch.tensor(ends, dtype=torch.int32)
    (strided, dense), (ref, _) = _both(lambda: (fn(_strided(offs)), fn(offs)))
    for got, want, r in zip(*(t if isinstance(t, (list, tuple)) else [t] for t in (strided, dense, ref)),
                            strict=True):
        assert torch.equal(got, want)
        assert got.dtype != torch.uint8 or torch.equal(got, r)


def test_strided_routing_indices_read_by_position(interpreter):
    """token_idx and row_of as strided views into the permute-free up-projection: the rows it gathers
    are the ones they name, as on the reference (the kernel read the junk between the entries)."""
    x, w_up = torch.randn(12, 32).to(BF16), torch.randn(3, 32, 48).to(BF16)
    r = moekit.topk_router(x, torch.randn(3, 32), top_k=2)
    token_idx, row_of = _strided(r.token_idx), _strided(r.row_of.reshape(-1)).view(r.row_of.shape)
    (strided, dense), (ref, _) = _both(lambda: (moekit.grouped_mm_swiglu(x, w_up, r.offs, token_idx=token_idx,
                                                                         row_of=row_of)[0],
                                                moekit.grouped_mm_swiglu(x, w_up, r.offs, token_idx=r.token_idx,
                                                                         row_of=r.row_of)[0]))
    assert torch.equal(strided, dense) and _rel(strided, ref) < 0.02


def test_a_block_takes_column_major_tokens(interpreter):
    moe = moekit.MoE(32, 24, 4, 2, dtype=BF16)
    x = torch.randn(32, 8).to(BF16).t()
    for strided, dense in _both(lambda: (moe(x), moe(x.contiguous()))):
        assert torch.equal(strided, dense)


def test_meta_tensors_take_the_reference(interpreter):
    for y in _both(lambda: moekit.swiglu(torch.empty(16, 48, dtype=BF16, device="meta"))):
        assert y.device.type == "meta" and y.shape == (16, 24)


def test_no_tokens_give_a_zero_aux_loss(interpreter):
    for r in _both(lambda: moekit.topk_router(torch.randn(0, 32), torch.randn(4, 32), top_k=2, aux_loss=True)):
        assert r.aux_loss.item() == 0


def _router():
    return moekit.topk_router(torch.randn(8, 32).to(BF16), torch.randn(4, 32), top_k=2)


BAD_INPUTS = {
    "gather rows of too few tokens": (ValueError, lambda: moekit.gather_rows(torch.randn(4, 32), _router())),
    "gather rows of 3-d tokens": (ValueError, lambda: moekit.gather_rows(torch.randn(8, 2, 16), _router())),
    "sorted weights of another shape": (
        ValueError, lambda: moekit.sorted_weights(_router().weights[:, :1], _router().row_of)),
    "3-d expert ids": (ValueError, lambda: moekit.routing_metadata(torch.randint(0, 4, (2, 5, 2)), 4)),
    "a tensor expert count": (TypeError, lambda: moekit.routing_metadata(torch.randint(0, 4, (10, 2)),
                                                                         torch.tensor(4))),
    "a tensor top_k": (TypeError, lambda: moekit.topk_router(torch.randn(8, 32), torch.randn(4, 32),
                                                             top_k=torch.tensor(2))),
    "no experts": (ValueError, lambda: moekit.grouped_mm_swiglu(
        torch.randn(16, 32).to(BF16), torch.randn(0, 32, 48).to(BF16), torch.zeros(0, dtype=torch.int32))),
    "column-major aux": (ValueError, lambda: moekit.grouped_mm_downproj(
        torch.randn(16, 24).to(BF16), torch.randn(2, 24, 32).to(BF16), offs_from_counts([8, 8]),
        aux_biased_acc=_column_major(torch.randn(16, 48).to(BF16)))),
    "fp32 aux": (ValueError, lambda: moekit.grouped_mm_downproj(
        torch.randn(16, 24).to(BF16), torch.randn(2, 24, 32).to(BF16), offs_from_counts([8, 8]),
        aux_biased_acc=torch.randn(16, 48))),
    "fp32 tokens into a block": (TypeError, lambda: moekit.MoE(32, 24, 4, 2)(torch.randn(8, 32))),
    "a block with top_k = 0": (ValueError, lambda: moekit.MoE(32, 24, 4, 0)),
    "a block with top_k > E": (ValueError, lambda: moekit.MoE(32, 24, 4, 5)),
    "a block with a relu router": (ValueError, lambda: moekit.MoE(32, 24, 4, 2, score_func="relu")),
    "an int bias": (TypeError, lambda: moekit.grouped_mm_swiglu(
        torch.randn(16, 32).to(BF16), torch.randn(2, 32, 48).to(BF16), offs_from_counts([8, 8]),
        bias=torch.ones(2, 48, dtype=torch.int32))),
    "an int bias into the NVFP4 up-projection": (TypeError, lambda: moekit.grouped_mm_swiglu_nvfp4(
        torch.randn(16, 32).to(BF16), torch.randn(2, 32, 64).to(BF16), offs_from_counts([8, 8]),
        torch.tensor(0.01), bias=torch.ones(2, 64, dtype=torch.int32))),
    "a bool seed": (TypeError, lambda: nvfp4.quantize(torch.randn(4, 32), rounding="stochastic", seed=True)),
    "a bool offset": (TypeError, lambda: nvfp4.quantize(torch.randn(4, 32), rounding="stochastic", offset=False)),
    "interleave of a width not a multiple of 16": (ValueError, lambda: nvfp4.interleave8_ref(torch.randn(4, 24))),
    "interleave of a scalar": (ValueError, lambda: nvfp4.interleave8_ref(torch.tensor(1.0))),
    "deinterleave of a width not a multiple of 16": (ValueError,
                                                     lambda: nvfp4.deinterleave8_ref(torch.randn(4, 24))),
}


def test_nvfp4_up_projection_zeroes_codes_past_offs_end(interpreter):
    """Decreasing offs (out of contract, never read by the host): both paths write zero codes and
    scales for every row at or past offs[-1], and the same bytes before it."""
    x, w = torch.randn(10, 32).to(BF16), (torch.randn(2, 32, 64) / 4).to(BF16)
    offs = torch.tensor([9, 4], dtype=torch.int32)
    (kv, ks, _), (rv, rs, _) = _both(lambda: moekit.grouped_mm_swiglu_nvfp4(x, w, offs, torch.tensor(0.002)))
    for k, r in ((kv, rv), (ks, rs)):
        assert torch.equal(k.view(torch.uint8), r.view(torch.uint8)) and not k.view(torch.uint8)[4:].any()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_the_same_error(interpreter, case):
    error, fn = BAD_INPUTS[case]
    for ref in (False, True):
        with moekit.options(reference=ref), pytest.raises(error):
            fn()
