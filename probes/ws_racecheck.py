"""Probe: does compute-sanitizer's racecheck report hazards on a ``gl.warp_specialize`` kernel whose own
code touches no shared memory at all?

racecheck reported 276 "potential RAW hazards" in ``_grouped_mm_ws_ragged_k_kernel``
(``bench/results/h100/sanitize.md``), all on one shared-memory byte per worker warp, written by a lane
of the default partition and read by the worker warps at kernel entry, both at the
``gl.warp_specialize`` call. This kernel keeps the same partition shape (a default partition of 4
warps, workers of 4 and 1 warps, as the ragged-K kernel) and only stores to global memory, each
partition to its own slice, so any hazard here is in Triton's warp-specialization hand-off, not in
moekit's pipeline.

Variants (the first argument):
- ``plain``: the partitions as above; the default partition never synchronizes inside itself;
- ``init``: the kernel also initializes an mbarrier before ``gl.warp_specialize``, as every moekit
  kernel does;
- ``barrier``: the default partition calls ``gl.thread_barrier()``, ``bar.sync 0, 128`` (barrier 0,
  the default partition's 128 threads), as moekit's kernels do before each TMA store.
Triton's hand-off is the same in all three: the default warps store one state byte per worker warp,
then every warp meets at barrier 1, then the workers read their byte. On the H100
(compute-sanitizer 2025.3.1) racecheck reports 0 hazards for ``plain`` and ``init`` and 8 for
``barrier``, all on those bytes: its model of a partial-count barrier 0, not a race
(``bench/results/h100/sanitize.md``).

Run on a Hopper GPU:
    compute-sanitizer --tool racecheck --racecheck-report hazard python probes/ws_racecheck.py [plain|init|barrier]
The script itself checks the output (every partition wrote its slice, for every program).
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

BLOCK = 128


@gluon.jit
def _fill(out, slot: gl.constexpr, BLOCK: gl.constexpr, SYNC: gl.constexpr):
    """out[program, slot, :] = program * 10 + slot, from whichever warps run this partition."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    idx = gl.arange(0, BLOCK, layout=layout)
    pid = gl.program_id(0)
    value = gl.zeros([BLOCK], gl.float32, layout) + (pid * 10 + slot).to(gl.float32)
    if SYNC:
        gl.thread_barrier()
    gl.store(out + (pid * 3 + slot) * BLOCK + idx, value)


@gluon.jit
def _ws_kernel(out, BLOCK: gl.constexpr, INIT: gl.constexpr, SYNC: gl.constexpr):
    if INIT:
        bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=1)
    gl.warp_specialize(
        [
            (_fill, (out, 0, BLOCK, SYNC)),
            (_fill, (out, 1, BLOCK, False)),
            (_fill, (out, 2, BLOCK, False)),
        ],
        [4, 1],
        [232, 40],
    )


def main(variant: str) -> int:
    programs = 8
    out = torch.full((programs, 3, BLOCK), float("nan"), device="cuda")
    _ws_kernel[(programs,)](out, BLOCK, variant == "init", variant == "barrier", num_warps=4)
    torch.cuda.synchronize()
    want = (torch.arange(programs, device="cuda")[:, None] * 10 + torch.arange(3, device="cuda")[None, :]).float()
    ok = torch.equal(out, want[:, :, None].expand_as(out))
    print(f"{variant}: warp_specialize partitions wrote their slices:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "plain"))
