"""SonicMoE's gpt-oss-20b MoE block on its own: import and first-call (autotune) times, then forward and
backward. The block benchmark (``python -m moekit bench --only moe``) times it beside moekit; this probe
isolates it when that run misbehaves.

    # with .sonic/sonic.tar.xz from ../shared/tools/sonicmoe_bundle.sh:
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .sonic/sonic.tar.xz
    PYTHONPATH=src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages python3 benchmarks/probe_sonic.py
"""

import os
import time

import torch

from moekit.bench import bench_ms
from moekit.bench.baselines import sonicmoe_block


def main():
    os.environ["MOEKIT_BENCH_SONICMOE"] = "1"
    t0 = time.time()
    blk = sonicmoe_block(2880, 2880, 32, 4, "cuda")
    if blk is None:
        raise SystemExit("SonicMoE is not importable here")
    print(f"import + build: {time.time() - t0:.1f} s", flush=True)
    x = torch.randn(24576, 2880, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *blk.parameters()]
    for what, fn in (("forward", lambda: blk(x)), ("step", lambda: torch.autograd.grad(blk(x), params, dy))):
        t1 = time.time()
        fn()
        torch.cuda.synchronize()
        print(f"first {what}: {time.time() - t1:.1f} s", flush=True)
    fwd = bench_ms(lambda: blk(x))
    step = bench_ms(lambda: torch.autograd.grad(blk(x), params, dy))
    print(f"sonicmoe gpt-oss-20b block: fwd {fwd:.2f} ms, bwd {step - fwd:.2f} ms, total {step:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
