"""Expert-MLP benchmark: GptOssExperts vs the torchtitan-style experts (fwd, bwd, saved activations).

    python benchmarks/bench_experts.py [--shape gpt-oss-20b ...] [--tokens T] [--out DIR]
"""

import sys

from moekit.__main__ import main

if __name__ == "__main__":
    main(["bench", "--only", "experts", *sys.argv[1:]])
