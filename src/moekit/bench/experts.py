"""Expert-MLP benchmark: moekit.GptOssExperts against the torchtitan-style experts of BENCH.md.

For each shape (balanced top-k routing, T tokens), times forward and forward+backward (backward =
the difference; all implementations interleaved over rotating rounds), measures saved activations
(memory allocated after the forward, minus before, minus the output), and the TF/s of dense matmuls
of the same shapes as the practical ceiling.
FLOPs: 6*R*D*F forward, twice that backward (R = T*top_k routed rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import GptOssExperts
from ..testing import rel_errors, routed_counts
from . import CPU_NOTE, MoEShape, environment, interleaved_ms, run_table, with_spread
from .baselines import TorchtitanExperts


@dataclass
class ExpertRow:
    shape: str
    flops_fwd: float
    ms: dict  # (impl, "fwd" | "bwd") -> ms
    saved: dict  # impl -> bytes of saved activations
    err: float
    spread: dict | None = None  # (impl, "fwd" | "step") -> (min, max) ms over the rounds
    tokens: int = 0

    def tflops(self, impl: str, phase: str) -> float:
        flops = self.flops_fwd * (1 if phase == "fwd" else 2)
        return flops / self.ms[impl, phase] / 1e9


def saved_bytes(fn) -> int:
    """Bytes a forward leaves allocated besides its output (0 on CPU, where nothing counts them)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return saved


def dense_calls(x, d, f, device):
    """The GEMMs of one expert MLP step, as single dense matmuls of the same shapes."""
    r = x.shape[0]
    w1 = torch.randn(d, 2 * f, device=device, dtype=x.dtype)
    w2 = torch.randn(f, d, device=device, dtype=x.dtype)
    h = torch.randn(r, f, device=device, dtype=x.dtype)
    dy = torch.randn(r, d, device=device, dtype=x.dtype)
    daux = torch.randn(r, 2 * f, device=device, dtype=x.dtype)

    def fwd():
        return x @ w1, h @ w2

    def bwd():
        return dy @ w2.mT, h.mT @ dy, daux @ w1.mT, x.mT @ daux

    return fwd, bwd


def run_shape(shape: MoEShape, device) -> ExpertRow:
    rows = shape.tokens * shape.top_k
    gen = torch.Generator().manual_seed(0)
    counts = routed_counts(shape.tokens, shape.e, shape.top_k, generator=gen).to(device)
    torch.manual_seed(0)
    ex = GptOssExperts(shape.d, shape.f, shape.e, device=device, dtype=torch.bfloat16)
    base = TorchtitanExperts(ex)
    x = torch.randn(rows, shape.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, shape.d, device=device, dtype=torch.bfloat16)
    fns, saved = {}, {}
    for name, mod in (("moekit", ex), ("torchtitan", base)):

        def fwd(mod=mod):
            return mod(x, counts)

        def step(mod=mod):
            # autograd.grad, not .backward: accumulating into .grad would add a GB-sized add per weight
            torch.autograd.grad(mod(x, counts), [x, *ex.parameters()], dy)

        fns[name, "fwd"], fns[name, "step"] = fwd, step
        saved[name] = saved_bytes(fwd)
    fns["dense", "fwd"], fns["dense", "bwd"] = dense_calls(x.detach(), shape.d, shape.f, device)
    ms = interleaved_ms(fns)  # rounds with a rotating order: drift weighs on every implementation alike
    spread = ms.spread
    for name in ("moekit", "torchtitan"):
        ms[name, "bwd"] = max(ms.pop((name, "step")) - ms[name, "fwd"], 1e-6)
    with torch.no_grad():
        err = rel_errors(ex(x, counts), base(x, counts))[1]
    return ExpertRow(shape.name, 6.0 * rows * shape.d * shape.f, ms, saved, err, spread, shape.tokens)


def cpu_table(rows: list[ExpertRow]) -> str:
    """Without a GPU: the reference's and the baseline's times and their agreement, no speed ratios."""
    out = [environment(), "", CPU_NOTE, "Medians of 3 rounds (their range in brackets).", "",
           "| shape | T | impl | fwd ms | fwd+bwd ms | err vs torchtitan |", "|---|---|---|---|---|---|"]
    for r in rows:
        for impl, label in (("moekit", "moekit (reference)"), ("torchtitan", "torchtitan-style")):
            err = f"{r.err:.1e}" if impl == "moekit" else ""
            step = r.ms[impl, "fwd"] + r.ms[impl, "bwd"]
            fwd = with_spread(r.ms[impl, "fwd"], r.spread[impl, "fwd"])
            out.append(f"| {r.shape} | {r.tokens} | {label} | {fwd} | {with_spread(step, r.spread[impl, 'step'])} "
                       f"| {err} |")
    return "\n".join(out)


def table(rows: list[ExpertRow]) -> str:
    if not torch.cuda.is_available():
        return cpu_table(rows)
    out = [
        f"{environment()}",
        "",
        "| shape | impl | fwd ms | bwd ms | fwd+bwd ms | fwd TF/s | bwd TF/s | saved GiB | speedup fwd+bwd | err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = {i: r.ms[i, "fwd"] + r.ms[i, "bwd"] for i in ("moekit", "torchtitan", "dense")}
        for impl in ("moekit", "torchtitan", "dense"):
            saved = f"{r.saved[impl] / 2**30:.2f}" if impl in r.saved else "-"
            speed = f"{total['torchtitan'] / total[impl]:.2f}x" if impl != "dense" else "-"
            err = f"{r.err:.1e}" if impl == "moekit" else ""
            out.append(
                f"| {r.shape} | {impl} | {r.ms[impl, 'fwd']:.2f} | {r.ms[impl, 'bwd']:.2f} | {total[impl]:.2f} | "
                f"{r.tflops(impl, 'fwd'):.0f} | {r.tflops(impl, 'bwd'):.0f} | {saved} | {speed} | {err} |"
            )
    out += ["", "| shape | fwd+bwd vs torchtitan | fwd vs dense TF/s | bwd vs dense TF/s | saved vs torchtitan |",
            "|---|---|---|---|---|"]
    for r in rows:
        t = {i: r.ms[i, "fwd"] + r.ms[i, "bwd"] for i in ("moekit", "torchtitan")}
        mem = r.saved["moekit"] / r.saved["torchtitan"] if r.saved.get("torchtitan") else float("nan")
        out.append(
            f"| {r.shape} | {t['torchtitan'] / t['moekit']:.2f}x | "
            f"{r.tflops('moekit', 'fwd') / r.tflops('dense', 'fwd'):.2f} | "
            f"{r.tflops('moekit', 'bwd') / r.tflops('dense', 'bwd'):.2f} | {mem:.2f} |"
        )
    return "\n".join(out)


def main(shapes, out_md: str | None = None, progress=None) -> str:
    return run_table(run_shape, table, shapes, out_md=out_md, progress=progress)
