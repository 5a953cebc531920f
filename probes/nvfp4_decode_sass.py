"""The NVFP4 GEMM's weight decode three ways, compiled for sm_90 without a GPU: SASS of the kernel's two
tile forms, with a host check of the bf16 byte-table recipe.

    python probes/nvfp4_decode_sass.py [--variant bits|ptx-f16|prmt-bf16 ...] [--tile swap16|plain128]
        [--maxnreg N] [--prefetch]

- ``bits``: the decode written in Triton ops (``_e2m1_placed``: code bits placed in an fp32 word, two
  exact fp32 multiplies by the block scale, a cast to bf16), the library's ``PTX=False``.
- ``ptx-f16``: the library's inline-PTX decode (``PTX=True``): per packed byte, the magnitudes' f16
  high bytes from one 8-byte ``prmt`` table, a ``prmt`` spreads them into an f16 pair, a ``prmt`` +
  ``lop3`` put the signs in, one ``mul.rn.f16x2`` by the block scale from ``cvt.rn.f16x2.e4m3x2``.
  Its host emulation on every byte is a CPU test (``tests/test_nvfp4_gemm.py``).
- ``prmt-bf16``: the same in bf16 (patched in here, not in the library): the magnitudes need a
  high-byte and a low-byte table, and the scale the library's e4m3 conversion, then a cast.

Tiles: ``swap16`` is the library's tile at <= 16 rows per expert (transposed, 16 x 128 x 128, A decoded
beforehand); ``plain128`` its tile above 64 rows per expert (128 x 128 x 32, 8 warps, both operands
decoded). The compile uses the launch's specializations (16-byte divisibility) and only Triton's
bundled ptxas and cuobjdump.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import moekit._kernels.nvfp4_gemm as gemm  # noqa: E402
from moekit._kernels.nvfp4 import _e4m3_value  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
BF16_HI, BF16_LO = (0x3F3F3F00, 0x40404040), (0xC0800000, 0xC0804000)  # bytes of the 8 magnitudes

PRMT_BF16 = tl.constexpr(f"""{{
.reg .b32 m, h, l, p, s, g, ta, tb, tc, td;
mov.b32 ta, {BF16_HI[0]:#x}; mov.b32 tb, {BF16_HI[1]:#x}; mov.b32 tc, {BF16_LO[0]:#x}; mov.b32 td, {BF16_LO[1]:#x};
and.b32 m, $1, 0x77;
prmt.b32 h, ta, tb, m;
prmt.b32 l, tc, td, m;
prmt.b32 p, l, h, 0x5140;
shl.b32 s, $1, 4;
prmt.b32 g, s, $1, 0x4000;
lop3.b32 p, p, g, 0x80008000, 0xf8;
mul.rn.bf16x2 $0, p, $3;
}}""")

# ---- the host check ---------------------------------------------------------------------------------

def prmt(a: int, b: int, c: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 0xF
        byte = src[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << 8 * i
    return out


def decode_byte(v: int) -> tuple[float, float]:
    """The bf16 recipe before its scale multiply, on one byte: (low-nibble value, high-nibble value)."""
    m = v & 0x77
    p = prmt(prmt(BF16_LO[0], BF16_LO[1], m), prmt(BF16_HI[0], BF16_HI[1], m), 0x5140)
    g = prmt((v << 4) & 0xFFFFFFFF, v, 0x4000)
    p |= g & 0x80008000
    words = np.array([p & 0xFFFF, p >> 16], dtype=np.uint16)
    vals = (words.astype(np.uint32) << 16).view(np.float32)
    return float(vals[0]), float(vals[1])


def check_tables() -> None:
    for v in range(256):
        want = tuple(E2M1[c & 7] * (-1.0 if c & 8 else 1.0) for c in (v & 0xF, v >> 4))
        got = decode_byte(v)
        ok = all(g == w and np.signbit(g) == np.signbit(w) for g, w in zip(got, want, strict=True))
        assert ok, f"bf16: byte {v:#04x} decodes to {got}, want {want}"
    print("host check: the bf16 byte-table decode gives every e2m1 value and sign (-0 included) for all 256 bytes")


# ---- the kernel variants ----------------------------------------------------------------------------

@triton.jit
def _load_prmt_bf16(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, OP_DTYPE: tl.constexpr, PTX: tl.constexpr,
                    PACKED: tl.constexpr = False):
    b = gemm._load_byte_tile(values, row, k // 2, row_end, K // 2, stride_vr, stride_vk, BLOCK_R, BLOCK_K // 2)
    sc = gemm._load_byte_tile(scales, row, k // 16, row_end, K // 16, stride_sr, stride_sk, BLOCK_R, BLOCK_K // 16)
    b2 = tl.reshape(tl.join(b, b), [BLOCK_R, BLOCK_K])  # each byte beside both of its elements
    s = _e4m3_value(sc).to(tl.bfloat16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_R, BLOCK_K // 16, 16]), [BLOCK_R, BLOCK_K])
    return tl.inline_asm_elementwise(PRMT_BF16, "=r,r,r,r", [b2, s], dtype=tl.bfloat16, is_pure=True, pack=2)


LIBRARY_LOAD = gemm._load_nvfp4
VARIANTS = {  # (loader, OP_DTYPE, PTX, W_PACKED)
    "bits": (LIBRARY_LOAD, tl.bfloat16, False, False), "ptx-f16": (LIBRARY_LOAD, tl.float16, True, False),
    "ptx-f16-packed": (LIBRARY_LOAD, tl.float16, True, True),
    "prmt-bf16": (_load_prmt_bf16, tl.bfloat16, False, False),
}
TILES = {  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, SWAP)
    "swap16": (16, 128, 128, 1, 4, True),
    "swap32": (32, 128, 128, 1, 4, True),
    "swap64": (64, 128, 64, 1, 4, True),
    "plain128": (128, 128, 32, 8, 8, False),
    "plain128-k64": (128, 128, 64, 8, 8, False),
}


def compile_variant(name: str, tile: str, maxnreg: int | None = None, prefetch: bool = False) -> dict:
    load, op, ptx, packed = VARIANTS[name]
    bm, bn, bk, group_m, warps, swap = TILES[tile]
    if packed and bk % 64:
        return None
    gemm._load_nvfp4 = load
    gemm._grouped_mm_nvfp4_kernel.hash = None  # the kernel's hash covers its callees: recompute it
    names = ["a_values", "a_scales", "a_global", "w_values", "w_scales", "w_global", "c", "offs_ptr",
             "M", "N", "K", "E", "stride_avm", "stride_avk", "stride_asm", "stride_ask", "stride_wve",
             "stride_wvn", "stride_wvk", "stride_wse", "stride_wsn", "stride_wsk", "stride_wg", "stride_cm"]
    a_type = ("*fp16" if op == tl.float16 else "*bf16") if swap else "*u8"
    types = [a_type, "*u8", "*fp32", "*u8", "*u8", "*fp32", "*bf16", "*i32"]
    sig = dict(zip(names, types + ["i32"] * (len(names) - len(types)), strict=True))
    const = dict(stride_avk=1, stride_ask=1, stride_wvk=1, stride_wsk=1, stride_wg=1, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=group_m, BLOCK_E=64, OP_DTYPE=op, PTX=ptx, W_PACKED=packed, SWAP=swap,
                 A_DECODED=swap, NUM_STAGES=3, W_PREFETCH=prefetch)
    sig.update({n: "constexpr" for n in const})
    aligned = {"a_values", "a_scales", "a_global", "w_values", "w_scales", "w_global", "c", "offs_ptr", "N", "K",
               "stride_avm", "stride_asm", "stride_wve", "stride_wvn", "stride_wse", "stride_wsn", "stride_cm"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
    kernel = triton.compile(ASTSource(gemm._grouped_mm_nvfp4_kernel, sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=3, **({"maxnreg": maxnreg} if maxnreg else {})))
    folder = tempfile.mkdtemp()
    with open(f"{folder}/k.cubin", "wb") as fh:
        fh.write(kernel.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    def dump(flag):
        return subprocess.run([f"{tools}/cuobjdump", flag, f"{folder}/k.cubin"], capture_output=True, text=True).stdout

    sass = dump("-sass")
    ops = [m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)]
    count = {op: ops.count(op) for op in set(ops)}
    res = dump("-res-usage")
    regs, local = re.search(r"REG:(\d+)", res), re.search(r"LOCAL:(\d+)", res)
    return dict(total=len(ops), regs=regs and regs.group(1), spills=local and local.group(1), ops=count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", choices=list(VARIANTS))
    p.add_argument("--tile", action="append", choices=list(TILES))
    p.add_argument("--maxnreg", type=int, help="cap the registers per thread (Triton's maxnreg)")
    p.add_argument("--prefetch", action="store_true",
                   help="the weights' next K step loaded ahead (W_PREFETCH; the library's decode, not --variant's)")
    a = p.parse_args()
    check_tables()
    print(f"triton {triton.__version__}")
    print("| tile | decode | SASS instructions | registers | local bytes | PRMT | LOP3 | FMUL | HMUL2 | IMAD |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tile in a.tile or list(TILES):
        for name in a.variant or list(VARIANTS):
            if a.prefetch and VARIANTS[name][0] is not LIBRARY_LOAD:  # the prefetch runs the library's decode
                continue
            r = compile_variant(name, tile, a.maxnreg, a.prefetch)
            if r is None:  # packed weights need BLOCK_K % 64 == 0
                continue
            o = r["ops"]
            print(f"| {tile} | {name} | {r['total']} | {r['regs']} | {r['spills']} | {o.get('PRMT', 0)} "
                  f"| {o.get('LOP3', 0)} | {o.get('FMUL', 0)} | {o.get('HMUL2', 0)} | {o.get('IMAD', 0)} |")


if __name__ == "__main__":
    main()
