"""Grouped GEMM benchmark (forward, dgrad, wgrad) vs torch._grouped_mm and a dense matmul.

    python benchmarks/bench_grouped_mm.py [--shape gpt-oss-20b ...] [--tokens T] [--out DIR]

Same as ``python -m moekit bench`` for now; the MoE-layer benchmark joins that command later.
"""

import sys

from moekit.__main__ import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
