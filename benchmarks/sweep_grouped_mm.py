"""Tile-config sweep for the grouped GEMM heuristic (a development tool; results feed config.py).

Times every candidate config on representative problems for each op and prints a markdown table of
milliseconds (nan: the config does not fit or failed), with torch._grouped_mm alongside.
"""

import argparse
import sys

import torch

from moekit.bench import SHAPES, bench_ms, environment
from moekit.bench.grouped_mm import OPS, _problem
from moekit.config import TileConfig
from moekit.grouped_gemm import grouped_mm_fwd

CANDIDATES = {
    "128x256x64 w8 s3": TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
    "128x256x64 w8 s3 flat": TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, flatten=True),
    "128x256x64 w8 s3 g16": TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3),
    "256x128x64 w8 s3": TileConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3),
    "128x128x64 w8 s4": TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    "128x128x64 w4 s4": TileConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=4),
    "64x256x64 w4 s4": TileConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4),
    "64x128x128 w4 s4": TileConfig(64, 128, 128, group_m=1, num_warps=4, num_stages=4),
    "64x256x128 w4 s3": TileConfig(64, 256, 128, group_m=1, num_warps=4, num_stages=3),
}

PROBLEMS = [
    ("gpt-oss-20b", "up", "balanced"),
    ("gpt-oss-120b", "down", "skewed"),
    ("qwen3-30b-a3b", "up", "balanced"),
    ("mixtral-8x7b", "down", "balanced"),
    ("small-M", "up", "balanced"),
]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", default=list(CANDIDATES))
    args = parser.parse_args(argv)
    print(environment(), "\n")
    print("| problem | op | torch | " + " | ".join(args.configs) + " |")
    print("|---|---|---|" + "---|" * len(args.configs))
    for name, proj, routing in PROBLEMS:
        x, dy, w, offs = _problem(SHAPES[name], proj, routing, "cuda")
        operands = {"fwd": (x, w.mT), "dgrad": (dy, w), "wgrad": (x.mT, dy)}
        for op in OPS:
            a, b = operands[op]
            cells = [f"{bench_ms(lambda a=a, b=b, o=offs: torch._grouped_mm(a, b, o), rep_ms=50):.3f}"]
            for label in args.configs:
                cfg = CANDIDATES[label]
                try:
                    ms = bench_ms(lambda a=a, b=b, o=offs, cfg=cfg: grouped_mm_fwd(a, b, o, cfg=cfg), rep_ms=50)
                except Exception as exc:  # out of shared memory etc.
                    print(f"# {label} {op}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                    ms = float("nan")
                cells.append(f"{ms:.3f}")
            print(f"| {name} {proj} {routing} | {op} | " + " | ".join(cells) + " |", flush=True)
        del x, dy, w, offs, operands
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
