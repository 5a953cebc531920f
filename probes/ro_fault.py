"""Probe: the fault of torch.compile's reduce-overhead step in the token-count sweep (open question: whose
bug, and which access faults).

On an H200 (2026-11-30) the sweep's row at mixtral-8x7b T = 4096 (and olmoe-1b-7b T = 4096) faulted with an
illegal address / unspecified launch failure while timing the steps interleaved, when the eager step had
been captured by hand first and the reduce-overhead step was among them. It did not fault under
CUDA_LAUNCH_BLOCKING=1, without the hand capture, or with compile's default mode instead. This runs that
row (``bench.sweep.run_shape``) with parts switched off, one variant per process:

    python probes/ro_fault.py --shape mixtral-8x7b --tokens 4096 [--no-capture] [--no-graphed] [--steps-only]
    MOEKIT_PLANS=0 python probes/ro_fault.py ...     # the launch plans off
    compute-sanitizer --tool memcheck python probes/ro_fault.py ...   # which kernel, which address

``--steps-only`` runs each step five times with a sync after each (no interleaved timing).
"""

import argparse

import torch

from moekit.bench import BLOCK_SHAPES, graph_ms, interleaved_ms, sweep


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--no-capture", action="store_true", help="skip the hand capture of the eager step")
    p.add_argument("--no-graphed", action="store_true", help="leave moekit.graphed's step out")
    p.add_argument("--steps-only", action="store_true")
    a = p.parse_args()
    _, steps = sweep._steps(BLOCK_SHAPES[a.shape], a.tokens, ("reduce-overhead",))
    if a.no_graphed:
        steps.pop("graphed")
    for _ in range(3):
        steps["moekit"]()
    if not a.no_capture:
        print("hand capture:", graph_ms(steps["moekit"]), "ms", flush=True)
    for name, step in steps.items():
        for _ in range(5 if a.steps_only else 3):
            step()
            if a.steps_only:
                torch.cuda.synchronize()
        print("ran", name, flush=True)
    torch.cuda.synchronize()
    if not a.steps_only:
        for r in range(3):
            print("interleaved round", r, interleaved_ms(steps), flush=True)
        print("host ms", {n: sweep.host_ms(s) for n, s in steps.items()}, flush=True)
    print("no fault")


if __name__ == "__main__":
    main()
