"""moekit.dispatch.custom_op: eager calls run the implementation (and an autograd.Function built from
the registered formula) without torch.library dispatch; compiling, fake tensors and dispatch modes go
through the registered op. Both give the same values and gradients."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moekit.dispatch import custom_op

CALLS = []


@custom_op("moekit_test::scaled_sum")
def _scaled_sum(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    CALLS.append("impl")
    return x * alpha + y


@_scaled_sum.register_fake
def _(x, y, alpha=2.0):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.alpha = inputs[2]


def _backward(ctx, grad):
    CALLS.append("backward")
    return grad * ctx.alpha if ctx.needs_input_grad[0] else None, grad if ctx.needs_input_grad[1] else None, None


_scaled_sum.register_autograd(_backward, setup_context=_setup)


@custom_op("moekit_test::no_autograd")
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x):
    return torch.empty_like(x)


def test_eager_calls_skip_the_dispatcher_and_match_the_op():
    x, y = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    CALLS.clear()
    out = _scaled_sum(x, y)  # the default alpha is filled in for setup_context
    assert type(out.grad_fn).__name__ == "ScaledSumFnBackward"
    out.sum().backward()
    assert CALLS == ["impl", "backward"]
    grads = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    ref = _scaled_sum.op(x, y, 2.0)  # through the dispatcher
    assert "moekit_test_scaled_sum" in type(ref.grad_fn).__name__
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(grads[0], x.grad) and torch.equal(grads[1], y.grad)
    with torch.no_grad():
        assert _scaled_sum(x, y, 3.0).grad_fn is None


def test_tracing_goes_through_the_op():
    with FakeTensorMode():
        x = torch.empty(4)
        CALLS.clear()
        out = _scaled_sum(x, x)
    assert CALLS == [] and out.shape == (4,)  # the fake ran, not the implementation
    compiled = torch.compile(lambda a, b: _scaled_sum(a, b, 0.5), backend="aot_eager", fullgraph=True)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    compiled(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((3,), 0.5))


def test_without_a_formula_the_op_decides_and_arity_is_checked():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(_double(x), x * 2)
    with pytest.raises(RuntimeError, match="no autograd"):  # torch.library's behaviour, unchanged
        _double(x).sum().backward()
    with pytest.raises(TypeError, match="takes 3 positional arguments, got 1"):
        _scaled_sum(x)
