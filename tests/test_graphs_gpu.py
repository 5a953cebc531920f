"""CUDA graphs as a training path: ``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs)
over ``moekit.MoE`` in a real training loop, against the same loop in eager mode.

The loop has what training has: gradient accumulation over micro-batches, optimizer steps between
them (parameters updated in place), aux-loss-free balancing (``update_expert_bias``) or the aux loss,
an eval-mode forward now and then, and a change of T that must re-record, not replay a stale graph.
"""

import pytest
import torch

from moekit import MoE

pytestmark = pytest.mark.gpu

D, F, E, K = 256, 128, 8, 2


def _train(mode: str | None, *, aux_loss: bool, steps: int = 20) -> torch.Tensor:
    torch.manual_seed(0)
    moe = MoE(D, F, E, K, bias=False, router_bias=False, activation="swiglu", aux_loss=aux_loss, device="cuda",
              dtype=torch.bfloat16)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    # Gradient accumulation under CUDA graphs: .grad must live outside the graphs' memory pool, or the
    # next micro-batch's replay overwrites the gradient that the first one stored there. Allocated here
    # and zeroed in place, every micro-batch's gradient is added into it.
    for p in moe.parameters():
        p.grad = torch.zeros_like(p)
    fn = moe if mode is None else torch.compile(moe, fullgraph=True, mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(steps):
        tokens = 384 if step < steps // 2 else 320  # a change of T mid-run
        for _ in range(2):  # gradient accumulation over two micro-batches
            x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            target = torch.randn(tokens, D, device="cuda", dtype=torch.float32, generator=gen)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            y = fn(x)
            loss = (y.float() - target).square().mean()
            if aux_loss:
                loss = loss + 0.01 * moe.aux_loss
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=False)
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
