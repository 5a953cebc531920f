"""Benchmarks behind ``python -m moekit bench`` and the scripts in benchmarks/.

Method: the median of ``triton.testing.do_bench`` after warm-up, on random inputs (never zeros),
checked against the baseline in the same run; every ratio compares implementations timed in the same
process, interleaved over rounds in a rotating order, so that clock drift on a shared, power-capped
GPU weighs on all of them alike. FLOPs count 2*M*N*K per GEMM: 6*R*D*F for an expert MLP's forward
(R = T*K routed rows) and twice that for its backward. Saved activations are the memory a forward
leaves allocated, minus its output. Routing: balanced is the top-k of softmax(randn(T, E)); skewed adds
``3 * linspace(0, 1, E)`` to the logits, so that a few experts are hot and some get few or no rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEShape:
    """One MoE configuration: D model dim, F expert hidden dim, E experts, top-k, T tokens."""

    name: str
    d: int
    f: int
    e: int
    top_k: int
    tokens: int = 24576


SHAPES = {
    s.name: s
    for s in (
        MoEShape("gpt-oss-20b", 2880, 2880, 32, 4),
        MoEShape("gpt-oss-120b", 2880, 2880, 128, 4),
        MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8),
        MoEShape("mixtral-8x7b", 4096, 14336, 8, 2),
        MoEShape("small-M", 2880, 2880, 32, 4, tokens=256),
    )
}

# The MoE-block shapes: real models' routed experts, with T chosen so that moekit, the torchtitan-style
# block and SonicMoE each fit an 80 GB H100.
BLOCK_SHAPES = {
    s.name: s
    for s in (
        MoEShape("gpt-oss-20b", 2880, 2880, 32, 4),
        MoEShape("gpt-oss-120b", 2880, 2880, 128, 4),
        MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8, tokens=16384),
        MoEShape("qwen3-235b-a22b", 4096, 1536, 128, 8, tokens=16384),
        MoEShape("olmoe-1b-7b", 2048, 1024, 64, 8, tokens=16384),
        MoEShape("mixtral-8x7b", 4096, 14336, 8, 2, tokens=16384),
        MoEShape("deepseek-v2-lite", 2048, 1408, 64, 6, tokens=16384),
    )
}

# The head line of every CPU table.
CPU_NOTE = ("CPU: moekit runs its pure-PyTorch reference here (the Triton kernels run on a GPU, or slowly on Triton's "
            "CPU interpreter with TRITON_INTERPRET=1).")

# A CPU-sized configuration for the reference path.
CPU_SHAPES = {"tiny-cpu": MoEShape("tiny-cpu", 256, 256, 8, 2, tokens=512)}


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call: CUDA events through do_bench on GPU, a wall clock on CPU."""
    if torch.cuda.is_available():
        import triton

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while time.perf_counter() < deadline or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_ms(fn, *, rep_ms: float = 100) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph (GPU): the kernels' time without
    the host's (Python, checks, descriptors, launches), which eager calls of a sub-millisecond op can
    exceed. ``fn`` must be capturable (no host sync). On CPU, ``bench_ms``."""
    if not torch.cuda.is_available():
        return bench_ms(fn, rep_ms=rep_ms)
    import triton

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def host_us(fn, reps: int = 30) -> float:
    """Median microseconds the host takes to call ``fn`` with the GPU queue drained before each call
    (the host's own time: Python, dispatch and the launches), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


class Timings(dict):
    """Median ms per entry (the dict), with ``spread[name] = (min, max)`` over the rounds' medians."""

    spread: dict


def interleaved_ms(fns: dict, *, rounds: int = 3, rep_ms: float = 100, tolerate_errors: bool = False) -> Timings:
    """Median ms per entry of ``fns`` over ``rounds`` rounds, the order rotating each round, so clock
    drift and neighbours on a shared GPU weigh on every implementation alike; ``.spread`` holds each
    entry's lowest and highest round. With ``tolerate_errors``, an entry that raises reports nan (a
    baseline that cannot run a layout)."""
    names = list(fns)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            try:
                samples[n].append(bench_ms(fns[n], rep_ms=rep_ms))
            except Exception:
                if not tolerate_errors:
                    raise
                samples[n].append(float("nan"))
    out = Timings({n: sorted(v)[len(v) // 2] for n, v in samples.items()})
    out.spread = {n: (min(v), max(v)) for n, v in samples.items()}
    return out


def with_spread(ms: float, spread: tuple[float, float]) -> str:
    """A table cell: the median and the range of the rounds, ``12.34 (11.90-13.02)``."""
    return f"{ms:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"


def paired_ratios(fns: dict, base: str, *, rounds: int, warmup_ms: float = 5, rep_ms: float = 30) -> list[str]:
    """A/B in paired rounds: each round times every entry of ``fns`` in a rotating order, and each
    entry's ratio to ``base`` is taken within the round, which cancels the clock drift that moves
    unpaired medians by 2-5%. Returns one cell per entry: median ms, median ratio [quartiles]."""
    names = list(fns)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            samples[n].append(bench_ms(fns[n], warmup_ms=warmup_ms, rep_ms=rep_ms))
    cells = []
    for n in names:
        ratios = sorted(x / y for x, y in zip(samples[n], samples[base], strict=True))
        q = rounds // 4
        cells.append(f"{n} {sorted(samples[n])[rounds // 2]:.3f} ms x{ratios[rounds // 2]:.3f} "
                     f"[{ratios[q]:.3f}-{ratios[-1 - q]:.3f}]")
    return cells


def cuda_kernels(prof) -> list:
    """The CUDA kernel events of a finished ``torch.profiler.profile``, in launch order."""
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


GEMM_KERNELS = ("_grouped_mm_", "_weight_grad_")  # name prefixes of moekit's grouped GEMM kernels (all precisions)


def step_profile(step, *, gemm_prefixes=GEMM_KERNELS) -> dict:
    """Profile one call of ``step`` (after a warm-up call) and split its GPU time: {"total": ms,
    "gemm": ms in kernels whose name starts with a GEMM prefix, "glue": ms of every other kernel,
    "top": [(name, ms), ...] the ten largest glue kernels (summed over calls of one name)}."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gemm, glue = 0.0, {}
    for e in cuda_kernels(prof):
        ms = e.time_range.elapsed_us() / 1e3
        if e.name.startswith(gemm_prefixes):
            gemm += ms
        else:
            glue[e.name] = glue.get(e.name, 0.0) + ms
    top = sorted(glue.items(), key=lambda kv: -kv[1])[:10]
    return {"total": gemm + sum(glue.values()), "gemm": gemm, "glue": sum(glue.values()), "top": top}


def cuda_graphed(step):
    """``step`` (a function of no arguments) captured in a CUDA graph after two warm-up calls on a side
    stream; returns the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def balanced_offs(m: int, e: int, device="cuda") -> torch.Tensor:
    """(E,) int32 cumulative row ends of m rows in E balanced groups."""
    return torch.linspace(m / e, m, e, device=device).round().to(torch.int32)


def bandwidth_preamble(first_column: str) -> float:
    """The head of a benchmark of bandwidth-bound passes: seeds torch, prints the environment line, the
    device copy bandwidth and the table header (``first_column`` | shape | ms | GB/s | of copy); returns
    the copy bandwidth in GB/s."""
    torch.manual_seed(0)
    print(environment())
    copy = copy_bandwidth_gbs()
    print(f"device copy: {copy:.0f} GB/s (read + write)\n")
    print(f"| {first_column} | shape | ms | GB/s | of copy |\n|---|---|---|---|---|")
    return copy


def geomean(xs) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def environment() -> str:
    """One line naming the date, device and versions, for the head of every result table."""
    import datetime

    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    line = (
        f"{datetime.date.today().isoformat()} | {dev} | torch {torch.__version__} | triton {triton.__version__}"
        f" | CUDA {torch.version.cuda}"
    )
    command = _command()
    return line + (f"\n\nCommand: `{command}`" if command else "")


def _command() -> str | None:
    """The ``python -m moekit ...`` command line of this process, without its ``--out`` folder, or None
    when the process is something else (a script, a test)."""
    import sys

    argv = list(sys.argv)
    if not argv or not argv[0].replace("\\", "/").endswith("moekit/__main__.py"):
        return None
    args = argv[1:]
    if "--out" in args:
        i = args.index("--out")
        del args[i:i + 2]
    return " ".join(["python -m moekit", *args])


def run_table(run_shape, table, shapes, *, out_md: str | None = None, progress=None) -> str:
    """Run ``run_shape(shape, device)`` per shape (names or MoEShape), format with ``table``, and
    write the markdown to ``out_md``. The shared driver of the block and expert benchmarks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    known = {**SHAPES, **CPU_SHAPES}
    shapes = [s if isinstance(s, MoEShape) else known[s] for s in shapes]
    rows = []
    for shape in progress(shapes) if progress else shapes:
        rows.append(run_shape(shape, device))
        if device == "cuda":
            torch.cuda.empty_cache()
        text = table(rows)
        if out_md:  # after every shape, so that a run cut short keeps what it measured
            with open(out_md, "w") as fh:
                fh.write(text + "\n")
    return text
