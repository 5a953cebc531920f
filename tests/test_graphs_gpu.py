"""CUDA graphs as a training path, in a real training loop against the same loop in eager mode:
``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs) over ``moekit.MoE``, and
``moekit.graphed`` for loops that do not compile.

The loop has what training has: gradient accumulation over micro-batches, optimizer steps between
them (parameters updated in place), aux-loss-free balancing (``update_expert_bias``) or the aux loss,
an eval-mode forward now and then, and a change of T that must re-record, not replay a stale graph.
"""

import pytest
import torch

import moekit
from moekit import MoE

pytestmark = pytest.mark.gpu

D, F, E, K = 256, 128, 8, 2


def _train(mode: str | None, *, aux_loss: bool, steps: int = 20, set_to_none: bool = False,
           x_grad: bool = False) -> torch.Tensor:
    torch.manual_seed(0)
    moe = MoE(D, F, E, K, bias=False, router_bias=False, activation="swiglu", aux_loss=aux_loss, device="cuda",
              dtype=torch.bfloat16)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    # Gradient accumulation under CUDA graphs: .grad must live outside the graphs' memory pool, or the
    # next micro-batch's replay overwrites the gradient that the first one stored there. Allocated here
    # and zeroed in place, every micro-batch's gradient is added into it.
    for p in moe.parameters():
        p.grad = torch.zeros_like(p)
    if mode == "graphed":
        fn = moekit.graphed(moe)
    else:
        fn = moe if mode is None else torch.compile(moe, fullgraph=True, mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(steps):
        tokens = 384 if step < steps // 2 else 320  # a change of T mid-run
        for _ in range(2):  # gradient accumulation over two micro-batches
            x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=x_grad)
            target = torch.randn(tokens, D, device="cuda", dtype=torch.float32, generator=gen)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            y = fn(x)
            loss = (y.float() - target).square().mean()
            if aux_loss:
                loss = loss + 0.01 * moe.aux_loss
            loss.backward()
            losses.append(loss.detach().clone())
            if x_grad:
                losses.append(x.grad.float().square().sum())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if not aux_loss:
            moe.update_expert_bias(1e-2)
        if step % 5 == 4:  # an eval-mode forward, without gradients
            moe.eval()
            with torch.no_grad():
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                losses.append(fn(x).float().square().mean().clone())
            moe.train()
    return torch.stack(losses).cpu()


@pytest.mark.parametrize("aux_loss", [False, True], ids=["expert-bias", "aux-loss"])
def test_reduce_overhead_trains_like_eager(aux_loss):
    """Within 1e-3 of eager, not bit for bit: under torch.compile the torch ops inside moekit's backward
    formulas (the router's softmax backward, the aux loss) are traced into Inductor's own kernels."""
    eager = _train(None, aux_loss=aux_loss)
    graphed = _train("reduce-overhead", aux_loss=aux_loss)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-5)
    assert not torch.equal(graphed, torch.zeros_like(graphed))


@pytest.mark.parametrize("aux_loss", [False, True], ids=["expert-bias", "aux-loss"])
@pytest.mark.parametrize("set_to_none, x_grad", [(False, False), (True, True)], ids=["zeroed", "none-x-grad"])
def test_graphed_trains_like_eager(aux_loss, set_to_none, x_grad):
    """moekit.graphed replays the eager kernels in the eager order: the same losses (and input
    gradients), bit for bit, with the gradients zeroed in place or set to None between optimizer steps."""
    eager = _train(None, aux_loss=aux_loss, x_grad=x_grad)
    graphed = _train("graphed", aux_loss=aux_loss, set_to_none=set_to_none, x_grad=x_grad)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)


def test_graphed_state_matches_eager():
    """After a few steps the buffers and gradients of a graphed block are the eager block's (gpt-oss:
    biases, clamped SwiGLU)."""
    blocks = []
    for graph in (False, True):
        torch.manual_seed(0)
        moe = MoE(D, F, E, K, device="cuda", dtype=torch.bfloat16)
        fn = moekit.graphed(moe) if graph else moe
        gen = torch.Generator(device="cuda").manual_seed(3)
        for _ in range(3):
            x = torch.randn(200, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
            fn(x).float().square().sum().backward()
        blocks.append((moe, x.grad))
    (a, ga), (b, gb) = blocks
    torch.testing.assert_close(gb, ga, rtol=0, atol=0)
    torch.testing.assert_close(b.tokens_per_expert, a.tokens_per_expert, rtol=0, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=0)
        assert pb.grad.stride() == pa.grad.stride() == pa.stride()  # eager AccumulateGrad's layout


def test_graphed_captures_while_an_eager_graph_of_the_block_is_alive():
    """An eager step's autograd graph kept alive (a loss held for logging) holds the parameters'
    gradient accumulators, made on the default stream; the captures must not reach them."""
    moe = MoE(D, F, E, K, device="cuda", dtype=torch.bfloat16)
    kept = moe(torch.randn(64, D, device="cuda", dtype=torch.bfloat16)).float().sum()
    fn = moekit.graphed(moe)
    for tokens in (128, 96):
        fn(torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    kept.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.parameters())


def test_graphed_refuses_a_second_forward_before_backward():
    moe = moekit.graphed(MoE(D, F, E, K, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(128, D, device="cuda", dtype=torch.bfloat16)
    y = moe(x)
    with pytest.raises(RuntimeError, match="second forward"):
        moe(x)
    y.float().sum().backward()
    moe(x).float().sum().backward()  # after the backward: fine
    moe(x)  # an output dropped without a backward does not block the next forward
    moe(x)
