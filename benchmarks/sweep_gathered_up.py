"""Tile-config sweep for the MoE block's up-projection: the Triton kernel that gathers its A rows
through ``token_idx`` (the permute-free dispatch) with the SwiGLU epilogue and row scales, on the
block's routing of each shape (a development tool; results feed ``config.grouped_mm_config``).

    python benchmarks/sweep_gathered_up.py [shape ...] [--configs LABEL ...]

Prints a markdown table of milliseconds and TF/s per config (nan: the config failed to compile or
launch), the heuristic's own choice first.
"""

import argparse
import sys

import torch

from moekit import config
from moekit.bench import BLOCK_SHAPES, bench_ms, environment
from moekit.bench.moe import training_step
from moekit.config import TileConfig as T
from moekit.epilogue import SwiGLU
from moekit.experts import grouped_mm_swiglu_fwd
from moekit.routing import _metadata, router_op, sorted_weights

CANDIDATES = {
    "heuristic": None,
    "128x256x64 g8 s3": T(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
    "128x256x64 g16 s4 flat": T(128, 256, 64, group_m=16, num_warps=8, num_stages=4, flatten=True),
    "128x256x32 g16 s5 flat": T(128, 256, 32, group_m=16, num_warps=8, num_stages=5, flatten=True),
    "128x128x64 g8 s4 w8": T(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    "128x128x64 g8 s4 w4": T(128, 128, 64, group_m=8, num_warps=4, num_stages=4),
    "256x128x64 g8 s3 flat": T(256, 128, 64, group_m=8, num_warps=8, num_stages=3, flatten=True),
    "64x256x64 g16 s4 w4": T(64, 256, 64, group_m=16, num_warps=4, num_stages=4),
}


def _cells(name: str, labels: list[str]) -> list[str]:
    moe, x, _ = training_step(BLOCK_SHAPES[name], "plain")
    x = x.detach()
    ex = moe.experts
    w = ex.mlp1_weight_EGD.mT
    with torch.no_grad():
        weights, experts, _ = router_op(x, moe.router.weight, None, None, moe.top_k, False, True)
        _, offs, token_idx, row_of = _metadata(experts, w.shape[0])
        scale = sorted_weights(weights, row_of)
    kw = ex.swiglu
    spec = SwiGLU(kw["swiglu_alpha"], kw["swiglu_limit"], kw["swiglu_linear_offset"], kw["gate_up_layout"])
    flops = 2.0 * token_idx.numel() * w.shape[1] * w.shape[2]
    cells = []
    for label in labels:
        cfg = CANDIDATES[label]
        try:
            ms = bench_ms(lambda cfg=cfg: grouped_mm_swiglu_fwd(x, w, offs, None, spec, cfg, token_idx, scale),
                          rep_ms=50)
        except Exception as exc:  # out of shared memory etc.
            print(f"# {label}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            ms = float("nan")
        cells.append(f"{ms:.3f} ({flops / ms / 1e9:.0f})")
    return cells


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b", "olmoe-1b-7b"])
    p.add_argument("--configs", nargs="*", default=list(CANDIDATES))
    a = p.parse_args(argv)
    print(environment(), "\n")
    print("| shape | " + " | ".join(a.configs) + " |")
    print("|---|" + "---|" * len(a.configs))
    for name in a.shapes:
        print(f"| {name} | " + " | ".join(_cells(name, a.configs)) + " |", flush=True)
        torch.cuda.empty_cache()
    heuristic = config.grouped_mm_config(1024, 1536, 2048, 128, ragged_k=False, tma=True, out_bytes=2,
                                         device=torch.device("cuda"), epilogue="swiglu")
    print(f"\nheuristic (qwen3-30b-a3b): {heuristic}")


if __name__ == "__main__":
    main()
