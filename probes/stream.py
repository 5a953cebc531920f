"""Where does a grouped GEMM's energy go: moving its operands from L2 into shared memory, or the
tensor-core math? (docs/design.md, section 8: the GEMMs run at the H100's power cap.)

On the up-projection shape of each gpt-oss config (x (R, D) @ w_up (E, D, 2F), balanced routing,
no epilogue), runs back to back for ~1.5 s each, with nvidia-smi sampling clock and power:

* ``gemm``: the warp-specialized rows-ragged GEMM (``ws_gemm``, plain epilogue);
* ``stream``: the same kernel's loader streaming every A and B box through the ring, consumers idle
  (``probes/hopper_kernels.py``);
* ``mma``: the same wgmma loop over every tile on stages loaded once, no loads and no stores;
* ``dense``: cuBLAS on one (R, D) @ (D, 2F) matmul, whose kernel name is printed.

Energy per call is power x time; ``above idle`` subtracts the idle board power measured first.

    python probes/stream.py [shape ...]
"""

import sys
import time

import hopper_kernels as hp
import torch
from power import _sampled
from torch.profiler import ProfilerActivity, profile

from moekit.bench import SHAPES, cuda_kernels, environment
from moekit.hopper import WS_GROUP_M, WS_STAGES, WS_TILE, ws_desc, ws_gemm, ws_rows_setup
from moekit.testing import routed_counts


def _launchers(x, b, offs, c):
    (m, k), n = x.shape, b.shape[2]
    bm, bn, _ = WS_TILE
    c_desc = ws_desc(c, [m, n], [c.stride(0), 1], [bm // 2, bn])
    b_trans = b.stride(2) != 1
    scratch = torch.empty(bm * bn, dtype=torch.bfloat16, device=x.device)

    def stream():
        a_desc, b_desc, table, programs = ws_rows_setup(x, b, offs, c, c, box_n=bn)
        hp._ws_stream_kernel[(programs,)](a_desc, b_desc, c_desc, table, k, n, NUM_SMS=programs,
                                          GROUP_M=WS_GROUP_M, STAGES=WS_STAGES, B_TRANS=b_trans,
                                          num_warps=4, maxnreg=168)

    def mma():
        a_desc, b_desc, table, programs = ws_rows_setup(x, b, offs, c, c, box_n=bn)
        hp._ws_mma_kernel[(programs,)](a_desc, b_desc, c_desc, scratch, table, k, n, NUM_SMS=programs,
                                       STAGES=WS_STAGES, B_TRANS=b_trans, num_warps=4, maxnreg=168)

    return stream, mma


def _probe(name, idle):
    s = SHAPES[name]
    rows = s.tokens * s.top_k
    counts = routed_counts(s.tokens, s.e, s.top_k, generator=torch.Generator().manual_seed(0)).cuda()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16)  # (R, D)
    w = torch.randn(s.e, 2 * s.f, s.d, device="cuda", dtype=torch.bfloat16)  # (E, 2F, D), torchtitan's
    w_dense = torch.randn(s.d, 2 * s.f, device="cuda", dtype=torch.bfloat16)  # (D, 2F)
    c = torch.empty(rows, 2 * s.f, device="cuda", dtype=torch.bfloat16)  # (R, 2F)
    b = w.transpose(1, 2)  # (E, D, 2F), unit stride along D
    stream, mma = _launchers(x, b, offs, c)
    cases = {"gemm": lambda: ws_gemm(x, b, offs, c), "stream": stream, "mma": mma,
             "dense": lambda: torch.mm(x, w_dense)}
    for fn in cases.values():  # compile and warm up
        fn()
    torch.cuda.synchronize()
    energy = {}
    for case, fn in cases.items():
        ms, clock, watts = _sampled(fn)
        energy[case] = (watts * ms, (watts - idle) * ms)
        print(f"{name} {case}: {ms:.3f} ms, {clock:.0f} MHz, {watts:.0f} W, {energy[case][0]:.0f} mJ "
              f"({energy[case][1]:.0f} mJ above idle)", flush=True)
        time.sleep(1.0)
    for case in ("stream", "mma"):
        print(f"{name} {case} / gemm energy: {energy[case][0] / energy['gemm'][0]:.2f} "
              f"({energy[case][1] / energy['gemm'][1]:.2f} above idle)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cases["dense"]()
        torch.cuda.synchronize()
    names = {e.name for e in cuda_kernels(prof)}
    print(f"{name} dense kernel: {' | '.join(sorted(names))}")


def main():
    print(environment())
    idle = _sampled(None, seconds=1.0)[2]
    print(f"idle board power {idle:.0f} W")
    for name in sys.argv[1:] or ["gpt-oss-20b", "gpt-oss-120b"]:
        _probe(name, idle)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
