"""Probe: what the expert-parallel receiving rank pays for device splits, on one GPU.

With ``splits="device"`` (``moekit.distributed``) a rank runs its experts over every slot row it can
receive, W * T tokens with K choices each; the choices of other ranks' experts keep a row past
``offs[-1]``. With host splits only the local choices get rows. This probe builds one receiving rank's
inputs for qwen3-30b-a3b (or another shape) at EP W without any process group and times the experts
plus the combine, forward and backward, three ways:

- ``host``: the rows cut to the local choices (as host splits do, P read on the host beforehand);
- ``device``: every choice keeps a row (today's device splits);
- ``device-absent``: the same buffers, with the dropped choices marked absent (-1) in ``row_of`` by a
  comparison with ``offs[-1]`` on the device, so the combine and its backward skip them;
- ``device-unwritten``: what device splits run now: also the routing weights scattered through the
  absent-marked ``row_of``, and the experts with ``tail="unwritten"`` (no zeros written past
  ``offs[-1]``, the SwiGLU backward pass stopping there).

    PYTHONPATH=src python probes/ep_capacity.py [--shape qwen3-30b-a3b] [--world 2 4] [--tokens 16384]
        [--profile]

``--profile`` lists the kernels of one profiled step of each way, so the kernels whose time follows the
slot rows rather than the local choices show up side by side.
"""

import argparse
import functools

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from moekit import MoE
from moekit.bench import BLOCK_SHAPES
from moekit.routing import combine, routing_metadata, sorted_weights


def inputs(t, e, k, world, d, dev):
    """One rank's received slots: W * t tokens, their K choices over all E experts (random), the local
    ids (the first E / W experts) or -1, and their routing weights."""
    n = world * t
    experts = torch.rand(n, e, device=dev).argsort(1)[:, :k]
    ids = torch.where(experts < e // world, experts, -1).to(torch.int32)
    weights = torch.rand(n, k, device=dev).softmax(-1)
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    return x, ids, weights


def step(experts, x, counts, token_idx, row_of, scale, tail, grad):
    y = experts(x, counts, token_idx, row_of, scale, tail=tail)
    part = combine(y, None, row_of)
    part.backward(grad)
    return part


def ways(x, ids, weights, el):
    counts, offs, token_idx, row_of = routing_metadata(ids, el)
    scale = sorted_weights(weights, row_of)
    p = int(offs[-1])  # host splits know it from the exchanged counts
    host = (counts, token_idx[:p], torch.where(row_of < p, row_of, -1), scale[:p], "zeros")
    device = (counts, token_idx, row_of, scale, "zeros")
    marked = torch.where(row_of < offs[-1], row_of, -1)
    absent = (counts, token_idx, marked, scale, "zeros")
    unwritten = (counts, token_idx, marked, sorted_weights(weights, marked), "unwritten")
    return {"host": host, "device": device, "device-absent": absent, "device-unwritten": unwritten}, p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    s = BLOCK_SHAPES[a.shape]
    dev = "cuda"
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), f"| {a.shape}: D={s.d} F={s.f} E={s.e} K={s.top_k} T={a.tokens}")
    for world in a.world:
        el = s.e // world
        moe = MoE(s.d, s.f, el, min(s.top_k, el), bias=False, activation="swiglu").to(dev, torch.bfloat16)
        experts = moe.experts
        x, ids, weights = inputs(a.tokens, s.e, s.top_k, world, s.d, dev)
        x.requires_grad_(True)
        grad = torch.randn_like(x)
        cases, p = ways(x, ids, weights, el)
        print(f"\nEP {world}: {x.shape[0]} slot tokens, {ids.numel()} slot choices, {p} local "
              f"({p / ids.numel():.2f}), {el} local experts")
        outs = {}
        for name, args in cases.items():
            fn = functools.partial(step, experts, x, *args, grad)
            outs[name] = fn().float()
            ms = triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")
            print(f"  {name:14s} experts + combine, fwd + bwd: {ms:.3f} ms")
        print("  outputs equal to host's: " + ", ".join(
            f"{name} {torch.equal(outs['host'], outs[name])}" for name in cases if name != "host"))
        if a.profile:
            for name, args in cases.items():
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step(experts, x, *args, grad)
                    torch.cuda.synchronize()
                rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                               if e.device_time_total > 0), key=lambda r: -r[1])
                total = sum(r[1] for r in rows)
                print(f"  {name}: {total:.3f} ms of kernels; " + ", ".join(
                    f"{key[:40]} {ms:.3f} ({n})" for key, ms, n in rows[:12]))


if __name__ == "__main__":
    main()
