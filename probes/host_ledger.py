"""Probe: the host's time per piece of an eager ``moekit.MoE`` training step, each piece called with
the GPU queue drained (so the time is the host's alone: Python, dispatch and the launches), median
of ``--reps`` calls, in microseconds. The pieces follow ``MoE.forward`` and the backward; beside them,
the price of single launches: an empty Triton kernel, a small torch op, ``torch.empty``.

    python probes/host_ledger.py [--shape qwen3-30b-a3b] [--reps 30]
"""

import argparse
import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl

from moekit.bench import BLOCK_SHAPES, host_us
from moekit.bench.moe import training_step
from moekit.routing import _metadata, _router_op, _split_bf16, combine, sorted_weights


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, n, mask=pid < 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(BLOCK_SHAPES))
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    moe, x, step = training_step(BLOCK_SHAPES[a.shape], "plain")
    dy = torch.randn_like(x)
    params = [x, *moe.parameters()]
    for _ in range(3):
        step()
    w = moe.router.weight
    r = moe.router
    rt = _router_op(x, w, r.bias, moe.expert_bias, moe.top_k, False, True)
    counts, _, token_idx, row_of = _metadata(rt[1], w.shape[0])
    scale = sorted_weights(rt[0], row_of)
    ex = moe.experts
    ys = ex(x, counts, token_idx, row_of, scale)
    small = torch.zeros(128, device="cuda")
    rows = []

    def add(name, fn):
        fn()
        rows.append((name, host_us(fn, a.reps)))

    add("empty Triton kernel (3 args)", lambda: _empty_kernel[(1,)](small, 1, BLOCK=1))
    add("torch.empty", lambda: torch.empty(1024, device="cuda"))
    add("small torch add", lambda: small + 1)
    add("_split_bf16", lambda: _split_bf16(w))
    add("router op (logits, softmax, top-k)", lambda: _router_op(x, w, r.bias, moe.expert_bias, moe.top_k, False, True))
    add("routing metadata (3 kernels)", lambda: _metadata(rt[1], w.shape[0]))
    add("tokens_per_expert += counts", lambda: moe.tokens_per_expert.add_(counts))
    add("sorted_weights", lambda: sorted_weights(rt[0], row_of))
    add("experts (cumsum, up, down)", lambda: ex(x, counts, token_idx, row_of, scale))
    add("offs cumsum", lambda: torch.cumsum(counts, dim=0, dtype=torch.int32))
    add("combine", lambda: combine(ys, None, row_of))
    add("block forward", lambda: moe(x))

    def backward():
        out = moe(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.autograd.grad(out, params, dy)
        return (time.perf_counter() - t0) * 1e6

    bwd = sorted(backward() for _ in range(a.reps))[a.reps // 2]
    rows.append(("block backward (autograd.grad)", bwd))
    add("block step", step)
    for name, us in rows:
        print(f"{us:9.1f} us  {name}")
    from torch.profiler import ProfilerActivity, profile

    out = moe(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        torch.autograd.grad(out, params, dy)
    nodes = [e for e in tprof.events() if e.name.startswith("autograd::engine::evaluate_function")]
    print(f"backward nodes (host us, profiled): {sum(e.cpu_time_total for e in nodes):.0f} in all")
    for e in nodes:
        print(f"{e.cpu_time_total:9.1f} us  {e.name.split(': ', 1)[-1]}")
    prof = cProfile.Profile()
    for _ in range(5):
        out = moe(x)
        torch.cuda.synchronize()
        prof.enable()
        torch.autograd.grad(out, params, dy)
        prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats("moekit|autograd|triton", 45)
    stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
