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

T = TileConfig
CANDIDATES = {
    "128x256 s3 g8": T(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
    "128x256 s3 g16 flat": T(128, 256, 64, group_m=16, num_warps=8, num_stages=3, flatten=True),
    "128x256 s4 split g8": T(128, 256, 64, group_m=8, num_warps=8, num_stages=4, split_store=True),
    "128x256 s4 split g16": T(128, 256, 64, group_m=16, num_warps=8, num_stages=4, split_store=True),
    "128x256 s4 split g32": T(128, 256, 64, group_m=32, num_warps=8, num_stages=4, split_store=True),
    "128x256 s4 split g16 flat": T(128, 256, 64, group_m=16, num_warps=8, num_stages=4, flatten=True, split_store=True),
    "128x256 s3 split g16 flat": T(128, 256, 64, group_m=16, num_warps=8, num_stages=3, flatten=True, split_store=True),
    "128x128 s3 split pps2": T(128, 128, 64, group_m=8, num_warps=4, num_stages=3, split_store=True,
                               programs_per_sm=2),
    "128x128 s2 split pps2": T(128, 128, 64, group_m=8, num_warps=4, num_stages=2, split_store=True, programs_per_sm=2),
    "64x128x128 s4 g1": T(64, 128, 128, group_m=1, num_warps=4, num_stages=4),
}

PROBLEMS = [
    ("gpt-oss-20b", "up", "balanced"),
    ("gpt-oss-120b", "up", "skewed"),
    ("gpt-oss-120b", "down", "skewed"),
    ("qwen3-30b-a3b", "up", "balanced"),
    ("mixtral-8x7b", "down", "balanced"),
    ("mixtral-8x7b", "up", "skewed"),
    ("small-M", "up", "balanced"),
]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--problems", nargs="*", type=int, help="indices into PROBLEMS (default: all)")
    parser.add_argument("--ops", nargs="*", default=list(OPS))
    args = parser.parse_args(argv)
    print(environment(), "\n")
    print("| problem | op | torch | " + " | ".join(args.configs) + " |")
    print("|---|---|---|" + "---|" * len(args.configs))
    problems = [PROBLEMS[i] for i in args.problems] if args.problems else PROBLEMS
    for name, proj, routing in problems:
        x, dy, w, offs = _problem(SHAPES[name], proj, routing, "cuda")
        operands = {"fwd": (x, w.mT), "dgrad": (dy, w), "wgrad": (x.mT, dy)}
        for op in args.ops:
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
