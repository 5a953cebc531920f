"""grouped_mm benchmark: forward, dgrad and wgrad against torch._grouped_mm and a dense matmul.

For each benchmark shape, both projections (up: K=D, N=2F; down: K=F, N=D) and both routings
(balanced, skewed), time the three GEMMs of a training step. Weights are stored the torchtitan way,
(E, N, K), and passed as ``w.mT`` views, exactly as a model would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import grouped_mm
from ..testing import offs_from_counts, rel_errors, routed_counts
from . import CPU_NOTE, CPU_SHAPES, SHAPES, MoEShape, copy_bandwidth_gbs, environment, geomean, interleaved_ms

OPS = ("fwd", "dgrad", "wgrad")


@dataclass
class Row:
    shape: str
    proj: str
    routing: str
    op: str
    flops: float
    weight_bytes: int
    ms: dict  # impl -> milliseconds (nan where an impl failed)
    err: float  # RMS-relative difference to torch._grouped_mm (or the reference on CPU)

    def tflops(self, impl: str) -> float:
        return self.flops / self.ms[impl] / 1e9

    def speedup(self, impl: str) -> float:
        return self.ms[impl] / self.ms["moekit"]


def _problem(shape: MoEShape, proj: str, routing: str, device):
    k, n = (shape.d, 2 * shape.f) if proj == "up" else (shape.f, shape.d)
    gen = torch.Generator(device="cpu").manual_seed(0)
    counts = routed_counts(shape.tokens, shape.e, shape.top_k, skew=3.0 if routing == "skewed" else 0.0, generator=gen)
    offs = offs_from_counts(counts, device=device)
    rows = shape.tokens * shape.top_k
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(shape.e, n, k, device=device, dtype=torch.bfloat16) / k**0.5  # torchtitan layout
    return x, dy, w, offs


def _calls(x, dy, w, offs, device):
    """impl -> op -> zero-argument callable."""
    calls = {
        "moekit": {
            "fwd": lambda: grouped_mm(x, w.mT, offs),
            "dgrad": lambda: grouped_mm(dy, w, offs),
            "wgrad": lambda: grouped_mm(x.mT, dy, offs),
        },
        "torch": {
            "fwd": lambda: torch._grouped_mm(x, w.mT, offs),
            "dgrad": lambda: torch._grouped_mm(dy, w, offs),
            "wgrad": lambda: torch._grouped_mm(x.mT, dy, offs),
        },
    }
    w0 = w[0]
    calls["dense"] = {
        "fwd": lambda: x @ w0.mT,
        "dgrad": lambda: dy @ w0,
        "wgrad": lambda: x.mT @ dy,
    }
    return calls


def run(
    shape_names, *, routings=("balanced", "skewed"), projs=("up", "down"), rounds: int = 3, progress=None
) -> list[Row]:
    """Time every (shape, projection, routing, op); ``progress`` wraps the problem iterator."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [n if isinstance(n, MoEShape) else {**SHAPES, **CPU_SHAPES}[n] for n in shape_names]
    problems = [(s, p, r) for s in shapes for p in projs for r in routings]
    rows = []
    for shape, proj, routing in progress(problems) if progress else problems:
        x, dy, w, offs = _problem(shape, proj, routing, device)
        calls = _calls(x, dy, w, offs, device)
        (r, k), n = x.shape, dy.shape[1]
        for op in OPS:
            ms = interleaved_ms({impl: fns[op] for impl, fns in calls.items()}, rounds=rounds, rep_ms=40,
                                tolerate_errors=True)
            try:
                err = rel_errors(calls["moekit"][op](), calls["torch"][op]())[1]
            except Exception:
                err = float("nan")
            wbytes = shape.e * k * n * 2
            rows.append(Row(shape.name, proj, routing, op, 2.0 * r * k * n, wbytes, ms, err))
        del x, dy, w, offs, calls
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def cpu_table(rows: list[Row]) -> str:
    """Markdown for a machine without a GPU: the reference's times and its agreement with
    torch._grouped_mm, with no speed ratios (CPU times of the reference say nothing of the kernels)."""
    out = [environment(), "", CPU_NOTE, "",
           "| shape | proj | routing | op | reference ms | err vs torch._grouped_mm |", "|---|---|---|---|---|---|"]
    out += [f"| {r.shape} | {r.proj} | {r.routing} | {r.op} | {r.ms['moekit']:.3f} | {r.err:.1e} |" for r in rows]
    return "\n".join(out)


def table(rows: list[Row], *, copy_gbs: float | None) -> str:
    """Markdown: one line per timing, then the per-op summary the acceptance criteria read."""
    out = [
        f"{environment()}",
        "",
        "| shape | proj | routing | op | moekit ms | torch ms | dense ms | moekit TF/s | vs torch | vs dense | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.shape} | {r.proj} | {r.routing} | {r.op} | {r.ms['moekit']:.3f} | {r.ms['torch']:.3f} | "
            f"{r.ms['dense']:.3f} | {r.tflops('moekit'):.0f} | {r.speedup('torch'):.3f} | "
            f"{r.speedup('dense'):.3f} | {r.err:.1e} |"
        )
    out += ["", "| op | geomean vs torch | min vs torch | geomean vs dense | small-M bytes / copy bandwidth |",
            "|---|---|---|---|---|"]
    for op in OPS:
        sel = [r for r in rows if r.op == op]
        if not sel:
            continue
        small = [r for r in sel if r.shape == "small-M"]
        bw = ""
        if small and copy_gbs:
            fracs = [r.weight_bytes / r.ms["moekit"] / 1e6 / copy_gbs for r in small]
            bw = f"{min(fracs):.2f} (min over {len(fracs)})"
        out.append(
            f"| {op} | {geomean(r.speedup('torch') for r in sel):.3f} | "
            f"{min(r.speedup('torch') for r in sel):.3f} | {geomean(r.speedup('dense') for r in sel):.3f} | {bw} |"
        )
    if copy_gbs:
        out.append(f"\ncopy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    return "\n".join(out)


def plot(rows: list[Row], path: str) -> None:
    """TF/s per problem and implementation, one panel per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(OPS), 1, figsize=(14, 4 * len(OPS)), squeeze=False)
    for ax, op in zip(axes[:, 0], OPS, strict=True):
        sel = [r for r in rows if r.op == op]
        labels = [f"{r.shape}\n{r.proj}/{r.routing}" for r in sel]
        width = 0.27
        for i, impl in enumerate(("moekit", "torch", "dense")):
            xs = [j + (i - 1) * width for j in range(len(sel))]
            ax.bar(xs, [r.tflops(impl) for r in sel], width, label=impl if impl != "torch" else "torch._grouped_mm")
        ax.set_xticks(range(len(sel)), labels, fontsize=7, rotation=35, ha="right")
        ax.set_ylabel("TF/s")
        ax.set_title(f"grouped GEMM {op}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(shapes, out_md: str | None = None, out_png: str | None = None, progress=None) -> str:
    """Run, print-ready markdown back; also written to ``out_md`` and plotted to ``out_png``."""
    shape_names = shapes
    copy_gbs = copy_bandwidth_gbs() if torch.cuda.is_available() else None
    rows = run(shape_names, progress=progress)
    text = table(rows, copy_gbs=copy_gbs) if torch.cuda.is_available() else cpu_table(rows)
    if out_md:
        with open(out_md, "w") as fh:
            fh.write(text + "\n")
    if out_png and torch.cuda.is_available():
        try:
            plot(rows, out_png)
        except ImportError:
            pass
    return text
