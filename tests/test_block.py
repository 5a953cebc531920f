"""The eager MoE step as one autograd node (``moekit.block``) against the composed ops, bit for bit."""

import pytest
import torch

import moekit
from moekit.layers import MoE

CONFIGS = {
    "plain": dict(bias=False, router_bias=False, activation="swiglu"),
    "gpt-oss": dict(bias=True, router_bias=True, activation="gpt-oss"),
}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _device(device, request):
    if device == "cpu":
        request.getfixturevalue("interpreter")
    return device


def _block(device, config, dtype=torch.bfloat16, d=64, f=32, e=8, k=2, **kw):
    torch.manual_seed(0)
    moe = MoE(d, f, e, k, device=device, dtype=dtype, **CONFIGS[config], **kw)
    with torch.no_grad():  # nonzero biases, so that their gradients and outputs show
        for name, p in moe.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.5)
        moe.expert_bias.normal_(0, 0.1)
    return moe


def _run(moe, x, dy, fused: bool, autocast=False):
    moe.tokens_per_expert.zero_()
    params = [p for p in (x, *moe.parameters()) if p.requires_grad and torch.is_grad_enabled()]
    with moekit.options(fused_block=fused), torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        out = moe(x)
    node = _node(out)
    grads = torch.autograd.grad(out, params, dy, allow_unused=True) if params else ()
    return out, grads, moe.tokens_per_expert.clone(), node


def _node(out):
    """The block's autograd node, under the view that restores a 3-D input's shape."""
    fn = out.grad_fn
    if fn is not None and type(fn).__name__ == "ViewBackward0":
        fn = fn.next_functions[0][0]
    return None if fn is None else type(fn).__name__


def _assert_same(moe, x, dy, autocast=False):
    out_f, g_f, counts_f, node_f = _run(moe, x, dy, True, autocast)
    out_c, g_c, counts_c, node_c = _run(moe, x, dy, False, autocast)
    if out_f.grad_fn is not None:
        assert node_f == "_MoEStepFnBackward" and node_c != node_f
    assert torch.equal(out_f, out_c) and out_f.dtype == out_c.dtype and out_f.shape == x.shape
    assert torch.equal(counts_f, counts_c)
    for a, b in zip(g_f, g_c, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    return out_f, g_f


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("t", [1, 37])
def test_fused_step_equals_the_composed_ops(device, config, t, request):
    device = _device(device, request)
    moe = _block(device, config)
    x = torch.randn(t, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    out, grads = _assert_same(moe, x, dy)
    assert out.isfinite().all() and all(g.isfinite().all() for g in grads)
    assert all(g.abs().sum() > 0 for g in grads)  # every gradient reached


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["sigmoid", "no-renormalize", "halves", "float16", "no-grad"])
def test_fused_step_variants(device, variant, request):
    """The router's and the SwiGLU's other settings, fp16, and a forward without autograd (eval)."""
    device = _device(device, request)
    kw = {"sigmoid": dict(score_func="sigmoid"), "no-renormalize": dict(renormalize=False),
          "halves": dict(gate_up_layout="halves")}.get(variant, {})
    dtype = torch.float16 if variant == "float16" else torch.bfloat16
    moe = _block(device, "gpt-oss" if variant == "halves" else "plain", dtype=dtype, **kw)
    x = torch.randn(19, 64, device=device, dtype=dtype, requires_grad=variant != "no-grad")
    if variant == "no-grad":
        with torch.no_grad():
            out = {f: _run(moe, x, None, f)[:3] for f in (True, False)}
        assert out[True][0].grad_fn is None and torch.equal(out[True][0], out[False][0])
        assert torch.equal(out[True][2], out[False][2])
        return
    _assert_same(moe, x, torch.randn_like(x))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_step_with_fp32_master_weights_under_autocast(device, request):
    device = _device(device, request)
    moe = _block(device, "gpt-oss", dtype=torch.float32)
    x = torch.randn(2, 9, 64, device=device, requires_grad=True)
    _, grads = _assert_same(moe, x, torch.randn(2, 9, 64, device=device, dtype=torch.bfloat16), autocast=True)
    assert all(g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frozen", ["router", "experts", "x", "all"])
def test_fused_step_with_some_inputs_frozen(device, frozen, request):
    device = _device(device, request)
    moe = _block(device, "plain" if frozen == "router" else "gpt-oss")
    for name, p in moe.named_parameters():
        p.requires_grad_(frozen not in ("all", name.split(".")[0]))
    x = torch.randn(21, 64, device=device, dtype=torch.bfloat16, requires_grad=frozen not in ("x", "all"))
    _assert_same(moe, x, torch.randn_like(x))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_step_no_tokens_save_h_and_grad_accumulation(device, request):
    device = _device(device, request)
    moe = _block(device, "plain")
    x0 = torch.randn(0, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    _assert_same(moe, x0, torch.randn_like(x0))
    x = torch.randn(13, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    with moekit.options(save_h=True):
        _assert_same(moe, x, torch.randn_like(x))
    grads = {}
    for fused in (True, False):
        moe.zero_grad(set_to_none=True)
        with moekit.options(fused_block=fused):
            for _ in range(2):
                moe(x).float().square().sum().backward()
        grads[fused] = [p.grad for p in moe.parameters()]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_what_the_fused_step_leaves_to_the_composed_ops(device, request):
    """Hooks on the experts (FSDP2 gathers there), the aux loss and a subclass's route compose the ops;
    so does bad input, which raises the ops' errors."""
    device = _device(device, request)
    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    moe = _block(device, "plain")
    assert _node(moe(x)) == "_MoEStepFnBackward"
    handle = moe.experts.register_forward_pre_hook(lambda m, args: None)
    assert _node(moe(x)) != "_MoEStepFnBackward"
    handle.remove()
    assert _node(moe(x)) == "_MoEStepFnBackward"
    aux = _block(device, "plain", aux_loss=True)
    assert _node(aux(x)) != "_MoEStepFnBackward" and aux.aux_loss is not None

    class Routed(MoE):
        def route(self, x2):
            return super().route(x2)

    sub = Routed(64, 32, 8, 2, device=device, dtype=torch.bfloat16, **CONFIGS["plain"])
    assert _node(sub(x)) != "_MoEStepFnBackward"
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        moe(x.float())
    with pytest.raises(ValueError):
        moe(torch.randn(5, 48, device=device, dtype=torch.bfloat16))


def _compiled_step(moe, x, dy, params, autocast, **opts):
    with moekit.options(**opts):
        with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):  # (the forward only, as AMP runs)
            out = moe(x)
        return out, torch.autograd.grad(out, params, dy, allow_unused=True) if params else ()


_COMPILED_CASES = {
    "plain": dict(config="plain"),
    "gpt-oss": dict(config="gpt-oss"),
    "sigmoid, x frozen": dict(config="plain", score_func="sigmoid", frozen="x"),
    "router frozen, save_h": dict(config="gpt-oss", frozen="router", save_h=True),
    "fp32 masters, autocast": dict(config="gpt-oss", dtype=torch.float32, autocast=True),
    "no tokens": dict(config="plain", t=0),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(_COMPILED_CASES))
def test_compiled_step_is_two_ops_and_the_eager_step_bit_for_bit(device, case, request):
    """Under torch.compile(fullgraph=True) the fused step is two custom ops (moekit::moe_step and its
    backward's), not the composed block's sixteen: the traced graphs call nothing else of moekit's, and
    the output, every gradient and the routed counts equal the eager one-node step's bit for bit."""
    from torch._dynamo.backends.common import aot_autograd

    device = _device(device, request)
    kw = dict(_COMPILED_CASES[case])
    config, frozen, t = kw.pop("config"), kw.pop("frozen", None), kw.pop("t", 37)
    dtype, autocast, save_h = kw.pop("dtype", torch.bfloat16), kw.pop("autocast", False), kw.pop("save_h", False)
    moe = _block(device, config, dtype=dtype, **kw)
    x = torch.randn(t, 64, device=device, dtype=dtype, requires_grad=frozen != "x")
    if frozen == "router":
        moe.router.requires_grad_(False)
    dy = torch.randn(t, 64, device=device, dtype=torch.bfloat16)
    params = [p for p in (x, *moe.parameters()) if p.requires_grad]
    called = []

    def record(gm, _):
        called.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "moekit" in str(n.target))
        return gm

    compiled = torch.compile(moe, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    results = []
    for fn in (moe, compiled):
        moe.tokens_per_expert.zero_()
        out, grads = _compiled_step(fn, x, dy, params, autocast, save_h=save_h)
        results.append((out, grads, moe.tokens_per_expert.clone()))
    torch.compiler.reset()
    assert called == ["moekit.moe_step.default", "moekit.moe_step_backward.default"], called
    (out_e, g_e, n_e), (out_c, g_c, n_c) = results
    assert torch.equal(out_e, out_c) and out_c.dtype == out_e.dtype and torch.equal(n_e, n_c)
    for a, b in zip(g_e, g_c, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_compiled_steps_ops_pass_opcheck(config, interpreter):
    """The two ops' schemas, fakes (every output's shape, strides and dtype, absent ones included), autograd
    registration and AOT dispatch (``torch.library.opcheck``)."""
    from moekit import block

    moe = _block("cpu", config)
    x = torch.randn(37, 64, dtype=torch.bfloat16, requires_grad=True)
    r, ex, sw = moe.router, moe.experts, moe.experts.swiglu
    args = (x, r.weight, r.bias, moe.expert_bias, ex.mlp1_weight_EGD, ex.mlp1_bias_EG, ex.mlp2_weight_EDF,
            ex.mlp2_bias_ED, moe.top_k, False, True, float(sw["swiglu_alpha"]), sw["swiglu_limit"],
            float(sw["swiglu_linear_offset"]), sw["gate_up_layout"], config == "gpt-oss")
    assert set(torch.library.opcheck(block._step_op.op, args).values()) == {"SUCCESS"}
