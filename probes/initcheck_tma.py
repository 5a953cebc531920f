"""Probe: does compute-sanitizer's initcheck count a TMA store (``cp.async.bulk.tensor``) as
initializing the global memory it writes?

initcheck reported reads of ``grouped_mm``'s forward output as uninitialized
(``bench/results/h100/sanitize.md``), although that output is correct. Its rows are written only by
TMA stores. This probe writes one fresh ``torch.empty`` buffer each way, then lets torch read it:
- ``pointer``: ``tl.store`` through pointers;
- ``tma``: a host ``TensorDescriptor`` store (the TMA unit, as moekit's kernels write their tiles);
- ``cublas``: ``torch.mm``'s output (cuBLAS's Hopper kernels also leave by TMA stores).

Run on a Hopper GPU:
    compute-sanitizer --tool initcheck python probes/initcheck_tma.py pointer
    compute-sanitizer --tool initcheck python probes/initcheck_tma.py tma
    compute-sanitizer --tool initcheck python probes/initcheck_tma.py cublas
If only the ``tma`` run reports uninitialized reads, initcheck does not track TMA stores. The script
checks the values itself (every element equals its index).
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROWS, COLS, BM, BN = 256, 128, 64, 64


@triton.jit
def _fill_pointer(out, COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    value = (rows[:, None] * COLS + cols[None, :]).to(tl.float32)
    tl.store(out + rows[:, None] * COLS + cols[None, :], value.to(tl.bfloat16))


@triton.jit
def _fill_tma(out_desc, COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    value = (rows[:, None] * COLS + cols[None, :]).to(tl.float32)
    out_desc.store([tl.program_id(0) * BM, tl.program_id(1) * BN], value.to(tl.bfloat16))


def main(mode: str) -> int:
    out = torch.empty(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    grid = (ROWS // BM, COLS // BN)
    if mode == "pointer":
        _fill_pointer[grid](out, COLS, BM, BN)
    elif mode == "cublas":  # bf16 operands, fp32 output (as moekit's router logits): row * COLS + col
        lhs = torch.zeros(ROWS, 64, device="cuda", dtype=torch.bfloat16)
        lhs[:, 0] = torch.arange(ROWS, device="cuda") * COLS  # exact in bf16 for ROWS <= 256
        lhs[:, 1] = 1
        rhs = torch.zeros(64, COLS, device="cuda", dtype=torch.bfloat16)
        rhs[0] = 1
        rhs[1] = torch.arange(COLS, device="cuda")
        out = torch.mm(lhs, rhs, out_dtype=torch.float32).to(torch.bfloat16)
    else:
        _fill_tma[grid](TensorDescriptor(out, [ROWS, COLS], [COLS, 1], [BM, BN]), COLS, BM, BN)
    want = torch.arange(ROWS * COLS, device="cuda", dtype=torch.float32).view(ROWS, COLS).to(torch.bfloat16)
    ok = torch.equal(out.clone(), want)  # the clone is torch's read of every element
    print(f"{mode} store wrote every element:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "tma"))
