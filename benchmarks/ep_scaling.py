"""Expert-parallel weak scaling on one host: the MoE block at EP 1 and EP W, T tokens per rank.

    python benchmarks/ep_scaling.py [--shape qwen3-30b-a3b --shape gpt-oss-120b] [--chunks 1 --chunks 4]
                                    [--sm-margin 0 --sm-margin 16] [--graph] [--profile] [--world 2 --world 4]
                                    [--out table.md]

One process per GPU (NCCL; on a machine without GPUs, gloo over CPU processes and the reference path,
as a smoke test). Every shape runs in its own configuration (``--config auto``: gpt-oss's biases and
SwiGLU for the gpt-oss shapes, the bias-free plain-SwiGLU block for the others) with the shape's T
tokens on every rank, routed by the block's own router (random weights, so about balanced):

- **EP 1**: every rank runs the whole ``moekit.MoE`` (all E experts) on its own tokens, no
  communication: the step a single GPU takes.
- **EP W**: ``ExpertParallelMoE`` over the W ranks (E/W experts each) on the same per-rank tokens,
  for each ``--chunks`` C (C = 1: no overlap; C > 1: a chunk's all-to-alls run under another
  chunk's GEMMs) and each ``--sm-margin`` (SMs the persistent GEMMs leave to NCCL's kernels) with
  host splits, and once with device splits at the largest C and margin; ``--graph`` adds each C and
  margin on device splits with the whole step replayed from a CUDA graph (no host cost), against EP 1
  replayed from a graph too. ``--profile`` adds, from
  one profiled pair of steps on rank 0, how long the NCCL kernels ran and what share of that time a
  compute kernel ran beside them.
- **all-to-all**: the layer's exchanges alone, timed on their own with the sizes of the C = 1 step:
  token rows out and back in the forward and the backward (each token once per rank that holds one
  of its experts), plus their (2K,) fp32 choices out in the forward and back in the backward.

A step is the forward and the gradients of x and every parameter (the router's gradients are not
all-reduced: a data-parallel wrapper does that). Times are the mean of ``--reps`` steps after
``--warmup``, between CUDA events, the slowest rank's. Efficiency = EP 1 step / EP W step; exposed =
EP W step − EP 1 step; hidden = 1 − exposed / all-to-all (the EP 1 step stands in for the EP W step's
compute: the same rows per rank, on half the experts each with twice the rows).

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``, inherited by every rank).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import moekit  # noqa: E402
from moekit import MoE  # noqa: E402
from moekit.bench import BLOCK_SHAPES, CPU_SHAPES, cuda_graphed, environment  # noqa: E402
from moekit.bench.moe import CONFIGS  # noqa: E402
from moekit.distributed import ExpertParallelMoE, send_plan  # noqa: E402
from moekit.routing import topk_router  # noqa: E402

BF16 = torch.bfloat16


def _config(shape, config: str) -> str:
    if config != "auto":
        return config
    return "gpt-oss" if shape.name.startswith("gpt-oss") else "plain"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev, warmup: int, reps: int, collective: bool) -> float:
    """Mean ms of ``fn`` over ``reps`` calls after ``warmup``; the slowest rank's when ``collective``
    (every rank calls ``fn`` the same number of times, so collectives inside stay matched)."""
    import time

    for _ in range(warmup):
        fn()
    _sync(dev)
    if collective:
        dist.barrier()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / reps
    t = torch.tensor([ms], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _alltoall_ms(moe: MoE, x, world: int, dev, warmup: int, reps: int) -> tuple[float, float]:
    """The C = 1 layer's exchanges alone (host splits from this rank's routing), and the MiB of token
    rows this rank sends to other ranks in them."""
    with torch.no_grad():
        r = topk_router(x, moe.router.weight, moe.router.bias, top_k=moe.top_k, score_func=moe.score_func,
                        renormalize=moe.renormalize, expert_bias=moe.expert_bias)
        send = send_plan(r.experts, moe.experts.num_experts // world, world).tokens
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
    send_l, recv_l = send.tolist(), recv.tolist()
    d, k = x.shape[1], moe.top_k
    rows_out, rows_in = x.new_empty(sum(send_l), d), x.new_empty(sum(recv_l), d)
    meta_out = torch.empty(sum(send_l), 2 * k, device=dev)
    meta_in = torch.empty(sum(recv_l), 2 * k, device=dev)

    def exchange(out, inp, out_splits, in_splits):
        dist.all_to_all_single(out, inp, out_splits, in_splits)

    def layer():
        for _ in range(2):  # the forward, then the backward's reverse exchanges of the same sizes
            exchange(rows_in, rows_out, recv_l, send_l)  # tokens to the ranks of their experts
            exchange(meta_in, meta_out, recv_l, send_l)  # their choices there (forward), the weights' gradients
            exchange(rows_out, rows_in, send_l, recv_l)  # each rank's share of the output back

    ms = _timed(layer, dev, warmup, reps, collective=True)
    me = dist.get_rank()
    remote_rows = sum(n for w, n in enumerate(send_l) if w != me) + sum(n for w, n in enumerate(recv_l) if w != me)
    return ms, 2 * remote_rows * d * x.element_size() / 2**20  # forward and backward, each way once


def _intervals_ms(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge (start, end) spans into disjoint ones."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _stream_busy(step, folder: str, rank: int, steps: int = 2, keep: str | None = None) -> dict:
    """One profiled pair of steps (every rank runs them; rank 0's trace is read): per step, the time
    the compute stream's kernels and the NCCL kernels are busy, the time both are (overlap), the
    step's span, and the NCCL kernels' grid (CTAs)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        return {}
    path = f"{folder}/trace.json"
    prof.export_chrome_trace(path)
    if keep:  # --trace-dir: keep rank 0's Chrome trace
        import shutil

        shutil.copy(path, keep)
    trace = json.load(open(path))["traceEvents"]
    events = [e for e in trace if e.get("cat") == "kernel"]
    api = {}  # CUDA runtime and driver calls on the host: where the host waits (syncs, allocations)
    for e in trace:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            api[e["name"]] = api.get(e["name"], 0.0) + e.get("dur", 0.0) / (1e3 * steps)
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in events if "nccl" in e["name"].lower()]
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in events if "nccl" not in e["name"].lower()]
    grids = sorted({tuple(e["args"].get("grid", ())) for e in events if "nccl" in e["name"].lower()})
    nccl_m, comp_m = _intervals_ms(nccl), _intervals_ms(comp)
    both, i, j = 0.0, 0, 0
    while i < len(nccl_m) and j < len(comp_m):  # the intersection of two sorted disjoint span lists
        lo, hi = max(nccl_m[i][0], comp_m[j][0]), min(nccl_m[i][1], comp_m[j][1])
        both += max(0.0, hi - lo)
        if nccl_m[i][1] < comp_m[j][1]:
            i += 1
        else:
            j += 1
    span = max(b for _, b in nccl + comp) - min(a for a, _ in nccl + comp)
    busy = sum(b - a for a, b in _intervals_ms(nccl + comp))
    us = 1e3 * steps  # trace times are microseconds; report ms per step
    return dict(compute=sum(b - a for a, b in comp_m) / us, nccl=sum(b - a for a, b in nccl_m) / us,
                overlap=both / us, span=span / us, idle=(span - busy) / us, grids=[list(g) for g in grids],
                api=sorted(api.items(), key=lambda kv: -kv[1])[:6])


def _host_profile(step, rank: int, steps: int = 3, top: int = 18) -> str:
    """cProfile of ``steps`` steps (every rank runs them; rank 0's profile is kept): the functions with
    the most time of their own, and the host time per step with the GPU drained at its end."""
    import cProfile
    import io
    import pstats
    import time

    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    host = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        return ""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return f"host {host:.2f} ms per step (profiled)\n" + "\n".join(lines[start:])


def _step(mod, x, dy):
    """A training step of ``mod``: the forward and the gradients of x and every parameter."""
    params = [x, *mod.parameters()]
    return lambda: torch.autograd.grad(mod(x), params, dy)


def _rank(rank: int, world: int, folder: str, args: dict) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=dev if cuda else None)
    moekit.set_options(reference=not cuda)
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    known = {**BLOCK_SHAPES, **CPU_SHAPES}
    rows = []
    for name in args["shapes"]:
        shape = known[name]
        config = _config(shape, args["config"])
        tokens = args["tokens"] or shape.tokens
        torch.manual_seed(0)  # the same weights on every rank
        moe = MoE(shape.d, shape.f, shape.e, shape.top_k, device=dev, dtype=BF16, **CONFIGS[config])
        torch.manual_seed(1 + rank)  # each rank's own tokens
        x = torch.randn(tokens, shape.d, device=dev, dtype=BF16, requires_grad=True)
        dy = torch.randn_like(x)

        row = {"shape": name, "config": config, "tokens": tokens, "world": world}
        row["ep1"] = _timed(_step(moe, x, dy), dev, args["warmup"], args["reps"], collective=True)
        if args["graph"] and cuda:  # the yardstick of the graphed EP runs
            replay = cuda_graphed(_step(moe, x, dy))
            row["ep1_graph"] = _timed(replay, dev, args["warmup"], args["reps"], collective=True)
        if args["profile"] and cuda:
            row["ep1_busy"] = _stream_busy(_step(moe, x, dy), folder, rank)
        if args["cprofile"] and cuda:
            row["ep1_host"] = _host_profile(_step(moe, x, dy), rank)
        row["a2a"], row["a2a_mib"] = _alltoall_ms(moe, x.detach(), world, dev, args["warmup"], args["reps"])
        runs = [("host", c, m) for c in args["chunks"] for m in args["margins"]]
        runs.append(("device", max(args["chunks"]), max(args["margins"])))
        if args["graph"] and cuda:
            runs += [("graph", c, m) for c in args["chunks"] for m in args["margins"]]
        row["ep"] = {}
        for splits, chunks, margin in runs:
            ep = ExpertParallelMoE.from_moe(moe, splits="device" if splits == "graph" else splits, chunks=chunks)
            with moekit.options(sm_margin=margin):
                step = _step(ep, x, dy) if splits != "graph" else cuda_graphed(_step(ep, x, dy))
                ms = _timed(step, dev, args["warmup"], args["reps"], collective=True)
                keep = args["trace_dir"] and os.path.join(args["trace_dir"], f"{name}-{splits}-{chunks}-{margin}.json")
                busy = _stream_busy(step, folder, rank, keep=keep) if args["profile"] and cuda else None
                host = _host_profile(step, rank) if args["cprofile"] and cuda and margin == 0 else ""
            row["ep"][f"{splits}-{chunks}-{margin}"] = dict(ms=ms, busy=busy, host=host)
            del ep, step
            if cuda:
                torch.cuda.empty_cache()
        with torch.no_grad():
            counts = moe.tokens_per_expert.new_zeros(shape.e)
            counts += topk_router(x.detach(), moe.router.weight, moe.router.bias, top_k=shape.top_k,
                                  score_func=moe.score_func, renormalize=moe.renormalize,
                                  expert_bias=moe.expert_bias).counts
            dist.all_reduce(counts)
            per_rank = counts.view(world, -1).sum(1)
            row["imbalance"] = float(per_rank.max() / per_rank.float().mean())
        rows.append(row)
        del moe, x, dy
        if cuda:
            torch.cuda.empty_cache()
        if rank == 0:
            with open(f"{folder}/rows.json", "w") as fh:
                json.dump(rows, fh)
    dist.destroy_process_group()


def table(rows: list[dict], command: str) -> str:
    out = [environment(), "", f"`{command}`", "",
           "| shape | config | T/rank | EP | splits | chunks | SM margin | step ms | efficiency | exposed ms "
           "| a2a ms | hidden | NCCL busy ms | under compute | compute busy ms | GPU idle ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['shape']} | {r['config']} | {r['tokens']} |"
        b1 = r.get("ep1_busy") or {}
        comp1 = f"{b1['compute']:.2f} | {b1['idle']:.2f}" if b1 else "- | -"
        out.append(f"{head} 1 | - | - | - | {r['ep1']:.2f} | 1.00 | - | - | - | - | - | {comp1} |")
        if "ep1_graph" in r:
            out.append(f"{head} 1 | graph | - | - | {r['ep1_graph']:.2f} | 1.00 | - | - | - | - | - | - | - |")
        for key, m in r["ep"].items():
            splits, chunks, margin = key.split("-")
            base = r["ep1_graph"] if splits == "graph" else r["ep1"]  # graphed EP against graphed EP 1
            exposed = m["ms"] - base
            hidden = 1 - exposed / r["a2a"] if r["a2a"] > 0 else float("nan")
            busy = m.get("busy") or {}
            nccl = f"{busy['nccl']:.2f}" if busy else "-"
            under = f"{busy['overlap'] / busy['nccl']:.0%}" if busy and busy["nccl"] > 0 else "-"
            comp = f"{busy['compute']:.2f} | {busy['idle']:.2f}" if busy else "- | -"
            eff = base / m["ms"]
            hidden = f"{min(max(hidden, 0.0), 1.0):.0%}"
            out.append(f"{head} {r['world']} | {splits} | {chunks} | {margin} | {m['ms']:.2f} | {eff:.2f} "
                       f"| {exposed:.2f} | {r['a2a']:.2f} | {hidden} | {nccl} | {under} | {comp} |")
    out += ["", "all-to-all: the C = 1 layer's four token-row exchanges and two of the tokens' choices, "
            "alone; MiB sent to other ranks per rank, and the routed rows' imbalance over ranks (max / mean). "
            "NCCL busy: rank 0's NCCL kernels per profiled step; under compute: the share of that time "
            "during which a compute kernel ran too.", ""]
    for r in rows:
        gbs = r["a2a_mib"] * 2**20 / (r["a2a"] * 1e6)
        grids = sorted({tuple(g) for m in r["ep"].values() for g in ((m.get("busy") or {}).get("grids") or [])})
        out.append(f"- {r['shape']}: {r['a2a_mib']:.0f} MiB sent, {gbs:.0f} GB/s per rank, "
                   f"imbalance {r['imbalance']:.3f}; NCCL grids {grids or '-'}")
    out += ["", "Host: the CUDA API calls that took the most host time per profiled step (rank 0, ms):", ""]
    for r in rows:
        for key, m in [("EP 1", {"busy": r.get("ep1_busy")}), *r["ep"].items()]:
            api = (m.get("busy") or {}).get("api")
            if api:
                out.append(f"- {r['shape']} {key}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in api))
    for r in rows:
        if r.get("ep1_host"):
            out += ["", f"Host profile, {r['shape']} EP 1 (rank 0, cProfile):", "", "```", r["ep1_host"], "```"]
        for key, m in r["ep"].items():
            if m.get("host"):
                out += ["", f"Host profile, {r['shape']} {key} (rank 0, cProfile):", "", "```", m["host"], "```"]
    return "\n".join(out)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", dest="shapes", choices=sorted({**BLOCK_SHAPES, **CPU_SHAPES}))
    p.add_argument("--config", default="auto", choices=["auto", *CONFIGS])
    p.add_argument("--chunks", action="append", type=int)
    p.add_argument("--sm-margin", action="append", type=int, dest="margins",
                   help="SMs the persistent GEMMs leave to NCCL in the EP runs (moekit's sm_margin option)")
    p.add_argument("--profile", action="store_true", help="profile one pair of steps per EP run (GPUs)")
    p.add_argument("--graph", action="store_true",
                   help="also time each chunk count on device splits with the whole step replayed from a CUDA graph")
    p.add_argument("--trace-dir", help="with --profile: keep rank 0's Chrome trace of each EP run here")
    p.add_argument("--cprofile", action="store_true", help="rank 0's host profile of each EP run with margin 0")
    p.add_argument("--world", type=int, action="append", dest="worlds",
                   help="ranks, repeatable, one table (default: 2 and every GPU; 2 CPU processes without GPUs)")
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the shape's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", help="write the markdown table here")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if cuda else 2
    worlds = a.worlds or sorted({min(2, n), n})
    args = dict(shapes=a.shapes or (["qwen3-30b-a3b", "gpt-oss-120b"] if cuda else ["tiny-cpu"]),
                config=a.config, chunks=a.chunks or [1, 4], margins=a.margins or [0],
                profile=a.profile, cprofile=a.cprofile, graph=a.graph, trace_dir=a.trace_dir, tokens=a.tokens,
                warmup=a.warmup, reps=a.reps)
    rows = []
    for world in worlds:  # (one process group per world size, in turn)
        with tempfile.TemporaryDirectory() as folder:
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_rank, args=(r, world, folder, args)) for r in range(world)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            rows += json.load(open(f"{folder}/rows.json")) if os.path.exists(f"{folder}/rows.json") else []
        if any(proc.exitcode for proc in procs):
            print(f"a rank failed at world {world}: exit codes {[proc.exitcode for proc in procs]}", file=sys.stderr)
    gpus = ""
    if cuda:
        try:
            gpus = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            gpus = ""
    text = table(rows, "python benchmarks/ep_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    if gpus:
        text += "\n\nGPU links (`nvidia-smi topo -m`):\n\n```\n" + gpus.strip() + "\n```"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
