"""Test and benchmark helpers: error metrics, ragged offsets, input generators."""

from __future__ import annotations

import torch

# Max-relative and RMS-relative error bounds against a float64 reference, per output dtype. A bf16
# output carries 2**-8 relative rounding; the accumulation order of a K ~ 3k dot adds a little.
TOLERANCES = {
    torch.bfloat16: (2e-2, 6e-3),
    torch.float16: (4e-3, 1.5e-3),
    torch.float32: (2e-3, 5e-4),
}


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, ||out - ref|| / ||ref||), in float64; NaN anywhere gives inf."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf"), float("inf")
    diff = (out64 - ref64).abs()
    scale_max = ref64.abs().max().clamp_min(1e-30)
    scale_rms = ref64.norm().clamp_min(1e-30)
    return float(diff.max() / scale_max), float(diff.norm() / scale_rms)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, *, what: str = "") -> None:
    """Assert shape match, all-finite, and max/RMS relative error within ``TOLERANCES[dtype]``.

    An exact-zero reference (an empty group) demands an exact-zero output.
    """
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    if not ref.detach().any():
        assert not out.detach().any(), f"{what}: expected exact zeros, max |out| = {out.abs().max()}"
        return
    max_tol, rms_tol = TOLERANCES[dtype or out.dtype]
    e_max, e_rms = rel_errors(out, ref)
    assert e_max <= max_tol and e_rms <= rms_tol, (
        f"{what}: max-rel {e_max:.3g} (tol {max_tol}), rms-rel {e_rms:.3g} (tol {rms_tol})"
    )


def offs_from_counts(counts, device=None) -> torch.Tensor:
    """Cumulative row ends (E,) int32 from per-group counts (a list or a tensor)."""
    counts = torch.as_tensor(counts, dtype=torch.int64, device=device)
    return torch.cumsum(counts, 0).to(torch.int32)


def routed_counts(
    tokens: int, experts: int, top_k: int, *, skew: float = 0.0, generator=None, device=None
) -> torch.Tensor:
    """Per-expert row counts (E,) of top-k routing of ``softmax(randn(T, E) + skew * linspace(0, 1, E))``.

    ``skew=0`` is the balanced case of BENCH.md, ``skew=3`` its skewed one.
    """
    logits = torch.randn(tokens, experts, generator=generator, device=device)
    logits = logits + skew * torch.linspace(0, 1, experts, device=device)
    ids = logits.softmax(-1).topk(top_k, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=experts)


def random_counts(total: int, groups: int, *, generator=None) -> list[int]:
    """A random split of ``total`` rows into ``groups`` counts, some of which may be zero."""
    if groups == 1:
        return [total]
    cuts = torch.randint(0, total + 1, (groups - 1,), generator=generator).sort().values.tolist()
    edges = [0, *cuts, total]
    return [edges[i + 1] - edges[i] for i in range(groups)]


def assert_within_baseline(
    out: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor, *, factor: float = 2.0, what: str = ""
) -> None:
    """Assert out's error against a float64 oracle is at most ``factor`` x a baseline's, plus a floor.

    ``baseline`` is the same computation done by PyTorch in the same precision (the reference run on
    the bf16 inputs), so a chain of bf16 roundings is held to PyTorch's own error, not a guess.
    """
    assert out.shape == oracle.shape, f"{what}: shape {tuple(out.shape)} != {tuple(oracle.shape)}"
    if oracle.numel() == 0 or not oracle.detach().any():
        assert not out.detach().any(), f"{what}: expected exact zeros"
        return
    (o_max, o_rms), (b_max, b_rms) = rel_errors(out, oracle), rel_errors(baseline, oracle)
    assert o_rms <= factor * b_rms + 1e-3 and o_max <= factor * b_max + 4e-3, (
        f"{what}: max-rel {o_max:.3g} vs baseline {b_max:.3g}, rms-rel {o_rms:.3g} vs baseline {b_rms:.3g}"
    )


def reference_run(fn, inputs, grad_out, dtype):
    """Run ``fn(*leaves)`` on ``inputs`` cast to ``dtype`` (NaN -> 0; None stays None), backpropagate
    ``grad_out`` through its last output, and return (outputs, input gradients).

    With ``dtype=float64`` this is the oracle; with the inputs' own dtype it is the PyTorch baseline
    that ``assert_within_baseline`` holds a kernel's error to."""
    leaves = [None if t is None else torch.nan_to_num(t.detach()).to(dtype).requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    outputs[-1].backward(grad_out.to(dtype))
    return outputs, [None if t is None else t.grad for t in leaves]


def assert_run_within_reference(ref_fn, inputs, grad_out, outputs, grads, *, names) -> None:
    """Hold a kernel run to its reference: ``outputs`` and the input ``grads`` (None: outputs only)
    against ``ref_fn`` in float64, each allowed ``assert_within_baseline``'s multiple of the error of
    ``ref_fn`` run in the inputs' own dtype. ``names``: one per output, then one per input."""
    dtype = next(t.dtype for t in inputs if t is not None)
    (r64, g64), (r16, g16) = (reference_run(ref_fn, inputs, grad_out, dt) for dt in (torch.float64, dtype))
    got, oracle, base = list(outputs), list(r64), list(r16)
    if grads is not None:
        got, oracle, base = got + list(grads), oracle + list(g64), base + list(g16)
    for name, g, o, b in zip(names[: len(got)], got, oracle, base, strict=True):
        assert_within_baseline(g, o, b, what=name)
