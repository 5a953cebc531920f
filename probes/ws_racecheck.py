"""Probe: does compute-sanitizer's racecheck report hazards on a ``gl.warp_specialize`` kernel whose own
code touches no shared memory at all?

racecheck reported 276 "potential RAW hazards" in ``_grouped_mm_ws_ragged_k_kernel``
(``bench/results/h100/sanitize.md``), all on one shared-memory byte per worker warp, written by a lane
of the default partition and read by the worker warps at kernel entry, both at the
``gl.warp_specialize`` call. This kernel keeps the same partition shape (a default partition of 4
warps, workers of 4 and 1 warps, as the ragged-K kernel) and only stores to global memory, each
partition to its own slice. Hazards here are Triton's warp-specialization hand-off, not moekit's
pipeline.

Run on a Hopper GPU:
    compute-sanitizer --tool racecheck python probes/ws_racecheck.py
The script itself checks the output (every partition wrote its slice, for every program).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

BLOCK = 128


@gluon.jit
def _fill(out, slot: gl.constexpr, BLOCK: gl.constexpr):
    """out[program, slot, :] = program * 10 + slot, from whichever warps run this partition."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    idx = gl.arange(0, BLOCK, layout=layout)
    pid = gl.program_id(0)
    value = gl.zeros([BLOCK], gl.float32, layout) + (pid * 10 + slot).to(gl.float32)
    gl.store(out + (pid * 3 + slot) * BLOCK + idx, value)


@gluon.jit
def _ws_kernel(out, BLOCK: gl.constexpr):
    gl.warp_specialize(
        [
            (_fill, (out, 0, BLOCK)),
            (_fill, (out, 1, BLOCK)),
            (_fill, (out, 2, BLOCK)),
        ],
        [4, 1],
        [232, 40],
    )


def main() -> int:
    programs = 8
    out = torch.full((programs, 3, BLOCK), float("nan"), device="cuda")
    _ws_kernel[(programs,)](out, BLOCK, num_warps=4)
    torch.cuda.synchronize()
    want = (torch.arange(programs, device="cuda")[:, None] * 10 + torch.arange(3, device="cuda")[None, :]).float()
    ok = torch.equal(out, want[:, :, None].expand_as(out))
    print("warp_specialize partitions wrote their slices:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
