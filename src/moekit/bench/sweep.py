"""Token-count sweep of the MoE block: where the host, not the GPU, bounds a training step.

A training run puts T = 1k-8k tokens per GPU through a layer per micro-batch. There a step's GPU work
is a few milliseconds and the host's time to enqueue it can exceed it. Per block shape (plain SwiGLU,
no biases, bf16) and T, one training step (forward, and the gradients of x and every parameter):

- **eager**: ``do_bench`` median of the step as a user calls it;
- **host**: with the GPU queue drained, the host's wall time to enqueue ``HOST_STEPS`` steps, per
  step, with no sync inside (Python, dispatch, checks and launches);
- **graph**: the same step captured once in a CUDA graph and replayed (the GPU's own time);
- **eager / graph**: 1.0 means the GPU bounds the eager step;
- **compiled**: the step under ``torch.compile(fullgraph=True)``; **reduce-overhead** (only where asked:
  ``--reduce-overhead``; timed beside the hand capture it faulted at two shapes, an open defect): under
  ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (Inductor's CUDA graphs);
- **moekit.graphed**: a second block with the same weights under :func:`moekit.graphed`, its
  gradients set to None before each step, so that its backward graph writes them as ``.grad`` (as a
  training step's first micro-batch does);
- the torchtitan-style block's eager step and host time, in the same process.

Implementations are interleaved over rotating rounds (``interleaved_ms``); host times are medians of
``HOST_ROUNDS`` rounds.
"""

from __future__ import annotations

import time

import torch

from ..graphs import graphed
from ..layers import MoE
from . import BLOCK_SHAPES, MoEShape, environment, graph_ms, interleaved_ms
from .baselines import TorchtitanMoE
from .moe import CONFIGS

TOKENS = (1024, 2048, 4096, 8192, 16384)
HOST_STEPS = 10
HOST_ROUNDS = 5


def host_ms(step, *, steps: int = HOST_STEPS, rounds: int = HOST_ROUNDS) -> float:
    """Median over ``rounds`` of the host's wall time to enqueue ``steps`` calls of ``step``, per call,
    the GPU queue drained before each round and no sync inside it."""
    step()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def _steps(shape: MoEShape, tokens: int, compile_modes: tuple[str, ...]):
    torch.manual_seed(0)
    moe = MoE(shape.d, shape.f, shape.e, shape.top_k, device="cuda", dtype=torch.bfloat16, **CONFIGS["plain"])
    base = TorchtitanMoE(moe)
    torch.manual_seed(1)
    x = torch.randn(tokens, shape.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *moe.parameters()]

    def make(mod, mark=False):
        def step():
            if mark:  # a new step of Inductor's CUDA-graph trees: the last step's outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            return torch.autograd.grad(mod(x), params, dy)

        return step

    steps = {"moekit": make(moe), "torchtitan": make(base)}
    torch.manual_seed(0)
    twin = graphed(MoE(shape.d, shape.f, shape.e, shape.top_k, device="cuda", dtype=torch.bfloat16,
                       **CONFIGS["plain"]))

    def graphed_step():
        twin.zero_grad(set_to_none=True)
        return torch.autograd.grad(twin(x), [x], dy)

    steps["graphed"] = graphed_step
    for mode in compile_modes:
        kw = {} if mode == "default" else {"mode": mode}
        steps[f"compiled:{mode}"] = make(torch.compile(moe, fullgraph=True, **kw), mark=mode == "reduce-overhead")
    return moe, steps


def run_shape(shape: MoEShape, tokens: int, compile_modes: tuple[str, ...] = ("default",)) -> dict:
    moe, steps = _steps(shape, tokens, compile_modes)
    for _ in range(3):
        steps["moekit"]()
    # The eager step's CUDA graph first (it captures the step itself): after the compiled steps had run, its
    # capture failed on the H200 ("operation would make the legacy stream depend on a capturing blocking
    # stream"), torch warning that an AccumulateGrad node made before, on the default stream, was kept alive.
    graph = graph_ms(steps["moekit"])
    for step in steps.values():  # compile (Triton and Inductor) and warm up outside the timings
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    ms = interleaved_ms(steps)
    row = {"shape": shape.name, "tokens": tokens, "ms": ms, "graph": graph}
    row["host"] = {name: host_ms(steps[name]) for name in steps}
    del steps
    torch.compiler.reset()  # this row's compiled graphs and CUDA-graph trees go before the next row's
    return row


def table(rows) -> str:
    modes = [k.split(":", 1)[1] for k in rows[0]["ms"] if k.startswith("compiled:")] if rows else []
    head = ["shape", "T", "eager ms", "host ms", "graph ms", "eager / graph", "moekit.graphed ms (host)"]
    head += [f"{m} ms (host)" for m in modes]
    head += ["torchtitan eager ms (host)", "eager vs torchtitan", "graphed vs torchtitan"]
    head += [f"{m} vs torchtitan" for m in modes]
    out = [environment(), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms, host = r["ms"], r["host"]
        tt = ms["torchtitan"]
        cells = [r["shape"], str(r["tokens"]), f"{ms['moekit']:.2f}", f"{host['moekit']:.2f}", f"{r['graph']:.2f}",
                 f"{ms['moekit'] / r['graph']:.2f}", f"{ms['graphed']:.2f} ({host['graphed']:.2f})"]
        cells += [f"{ms['compiled:' + m]:.2f} ({host['compiled:' + m]:.2f})" for m in modes]
        cells += [f"{tt:.2f} ({host['torchtitan']:.2f})", f"{tt / ms['moekit']:.2f}x", f"{tt / ms['graphed']:.2f}x"]
        cells += [f"{tt / ms['compiled:' + m]:.2f}x" for m in modes]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows, path: str) -> None:
    """One panel per shape: step ms against T for moekit eager, its CUDA graph, each compile mode and the
    torchtitan-style block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.6), squeeze=False)
    for ax, name in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if r["shape"] == name]
        ts = [r["tokens"] for r in rs]
        series = {"moekit eager": [r["ms"]["moekit"] for r in rs], "moekit graph": [r["graph"] for r in rs],
                  "moekit.graphed": [r["ms"]["graphed"] for r in rs],
                  "torchtitan eager": [r["ms"]["torchtitan"] for r in rs]}
        for k in rs[0]["ms"]:
            if k.startswith("compiled:"):
                series[f"moekit {k.split(':', 1)[1]}"] = [r["ms"][k] for r in rs]
        for label, ys in series.items():
            ax.plot(ts, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("fwd + bwd step, ms")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(shapes=None, tokens=TOKENS, *, compile_modes=("default",), out_md=None, out_png=None,
         progress=None) -> str:
    """Run the sweep on the GPU over ``shapes`` (names or MoEShape; default every block shape) and
    ``tokens``; write the table to ``out_md`` after every row and the plot to ``out_png``."""
    shapes = [BLOCK_SHAPES[s] if isinstance(s, str) else s for s in (shapes or list(BLOCK_SHAPES))]
    problems = [(s, t) for s in shapes for t in tokens]
    rows = []
    for shape, t in progress(problems) if progress else problems:
        rows.append(run_shape(shape, t, tuple(compile_modes)))
        torch.cuda.empty_cache()
        text = table(rows)
        if out_md:
            with open(out_md, "w") as fh:
                fh.write(text + "\n")
    if out_png and rows:
        try:
            plot(rows, out_png)
        except ImportError:  # matplotlib is the [bench] extra
            pass
    return table(rows)
