"""The NVFP4 GEMM's weight decode three ways, compiled for sm_90 without a GPU: SASS of the transposed
(``swap``) tile at 16 rows per expert, and a check of the byte-table decodes on the host.

    python probes/nvfp4_decode_sass.py [--variant bits|prmt-bf16|prmt-f16 ...]

- ``bits``: the library's decode (``_e2m1_placed``: code bits placed in an fp32 word, two exact fp32
  multiplies by the block scale, a cast to bf16).
- ``prmt-bf16``: per packed byte, inline PTX: the magnitudes' bf16 high and low bytes from two 8-byte
  ``prmt`` tables, a third ``prmt`` interleaves them, a ``prmt`` + ``lop3`` put the signs in, and one
  ``mul.rn.bf16x2`` by the block scale (converted as the library does, then to bf16).
- ``prmt-f16``: the same in f16, whose e2m1 magnitudes have a zero low byte (one table), with the
  block scale from ``cvt.rn.f16x2.e4m3x2``. Exact like bf16: value * scale has <= 6 significant bits
  in [2^-10, 2688], normal in f16. The decoded A (``A_DECODED``) would then be f16 as well.

The host check emulates ``prmt`` (PTX ISA: byte select, selector bit 3 replicates the sign) and runs
both asm recipes on all 256 bytes against the e2m1 values. The compile patches the kernel module's
``_load_nvfp4`` (a probe, not the library) and needs only Triton's bundled ptxas and cuobjdump.
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
F16_HI = (0x3E3C3800, 0x46444240)  # f16 magnitudes: high bytes only, the low bytes are 0

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

PRMT_F16 = tl.constexpr(f"""{{
.reg .b32 m, h, p, s, g, ta, tb;
mov.b32 ta, {F16_HI[0]:#x}; mov.b32 tb, {F16_HI[1]:#x};
and.b32 m, $1, 0x77;
prmt.b32 h, ta, tb, m;
prmt.b32 p, h, 0, 0x1404;
shl.b32 s, $1, 4;
prmt.b32 g, s, $1, 0x4000;
lop3.b32 p, p, g, 0x80008000, 0xf8;
mul.rn.f16x2 $0, p, $3;
}}""")

E4M3_TO_F16 = tl.constexpr("""{
.reg .b16 t;
.reg .b32 r;
cvt.u16.u32 t, $1;
cvt.rn.f16x2.e4m3x2 r, t;
mov.b32 {$0, t}, r;
}""")


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


def decode_byte(v: int, half: str) -> tuple[float, float]:
    """The asm recipe before its scale multiply, on one byte: (low-nibble value, high-nibble value)."""
    m = v & 0x77
    if half == "bf16":
        p = prmt(prmt(BF16_LO[0], BF16_LO[1], m), prmt(BF16_HI[0], BF16_HI[1], m), 0x5140)
    else:
        p = prmt(prmt(F16_HI[0], F16_HI[1], m), 0, 0x1404)
    g = prmt((v << 4) & 0xFFFFFFFF, v, 0x4000)
    p |= g & 0x80008000
    words = np.array([p & 0xFFFF, p >> 16], dtype=np.uint16)
    if half == "bf16":
        vals = (words.astype(np.uint32) << 16).view(np.float32)
    else:
        vals = words.view(np.float16).astype(np.float32)
    return float(vals[0]), float(vals[1])


def check_tables() -> None:
    for half in ("bf16", "f16"):
        for v in range(256):
            want = tuple(E2M1[c & 7] * (-1.0 if c & 8 else 1.0) for c in (v & 0xF, v >> 4))
            got = decode_byte(v, half)
            ok = all(g == w and np.signbit(g) == np.signbit(w) for g, w in zip(got, want, strict=True))
            assert ok, f"{half}: byte {v:#04x} decodes to {got}, want {want}"
    print("host check: both byte-table decodes give every e2m1 value and sign (-0 included) for all 256 bytes")


# ---- the kernel variants ----------------------------------------------------------------------------

@triton.jit
def _tile_bytes(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    b = gemm._load_byte_tile(values, row, k // 2, row_end, K // 2, stride_vr, stride_vk, BLOCK_R, BLOCK_K // 2)
    sc = gemm._load_byte_tile(scales, row, k // 16, row_end, K // 16, stride_sr, stride_sk, BLOCK_R, BLOCK_K // 16)
    return tl.reshape(tl.join(b, b), [BLOCK_R, BLOCK_K]), sc  # each byte beside both of its elements


@triton.jit
def _per_element(s, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    return tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_R, BLOCK_K // 16, 16]), [BLOCK_R, BLOCK_K])


@triton.jit
def _load_prmt_bf16(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, OP_DTYPE: tl.constexpr):
    b2, sc = _tile_bytes(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                         BLOCK_R, BLOCK_K)
    s = _per_element(_e4m3_value(sc).to(tl.bfloat16), BLOCK_R, BLOCK_K)
    return tl.inline_asm_elementwise(PRMT_BF16, "=r,r,r,r", [b2, s], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _load_prmt_f16(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, OP_DTYPE: tl.constexpr):
    b2, sc = _tile_bytes(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                         BLOCK_R, BLOCK_K)
    s = tl.inline_asm_elementwise(E4M3_TO_F16, "=h,r", [sc], dtype=tl.float16, is_pure=True, pack=1)
    s = _per_element(s, BLOCK_R, BLOCK_K)
    return tl.inline_asm_elementwise(PRMT_F16, "=r,r,r,r", [b2, s], dtype=tl.float16, is_pure=True, pack=2)


VARIANTS = {"bits": (gemm._load_nvfp4, tl.bfloat16), "prmt-bf16": (_load_prmt_bf16, tl.bfloat16),
            "prmt-f16": (_load_prmt_f16, tl.float16)}


def compile_variant(name: str) -> dict:
    """The kernel with the 16-row transposed tile (the library's config at <= 16 rows per expert)."""
    load, op = VARIANTS[name]
    gemm._load_nvfp4 = load
    gemm._grouped_mm_nvfp4_kernel.hash = None  # the kernel's hash covers its callees: recompute it
    names = ["a_values", "a_scales", "a_global", "w_values", "w_scales", "w_global", "c", "offs_ptr",
             "M", "N", "K", "E", "stride_avm", "stride_avk", "stride_asm", "stride_ask", "stride_wve",
             "stride_wvn", "stride_wvk", "stride_wse", "stride_wsn", "stride_wsk", "stride_wg", "stride_cm"]
    types = ["*fp16" if op == tl.float16 else "*bf16", "*u8", "*fp32", "*u8", "*u8", "*fp32", "*bf16", "*i32"]
    sig = dict(zip(names, types + ["i32"] * (len(names) - len(types)), strict=True))
    const = dict(stride_avk=1, stride_ask=1, stride_wvk=1, stride_wsk=1, stride_wg=1, BLOCK_M=16, BLOCK_N=128,
                 BLOCK_K=128, GROUP_M=1, BLOCK_E=64, OP_DTYPE=op, SWAP=True, A_DECODED=True, NUM_STAGES=3)
    sig.update({n: "constexpr" for n in const})
    aligned = {"a_values", "a_scales", "a_global", "w_values", "w_scales", "w_global", "c", "offs_ptr", "N", "K",
               "stride_avm", "stride_asm", "stride_wve", "stride_wvn", "stride_wse", "stride_wsn", "stride_cm"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
    kernel = triton.compile(ASTSource(gemm._grouped_mm_nvfp4_kernel, sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
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
    a = p.parse_args()
    check_tables()
    print("| decode | SASS instructions | registers | local bytes | PRMT | LOP3 | FMUL | HMUL2 | IMAD |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.variant or list(VARIANTS):
        r = compile_variant(name)
        o = r["ops"]
        print(f"| {name} | {r['total']} | {r['regs']} | {r['spills']} | {o.get('PRMT', 0)} | {o.get('LOP3', 0)} "
              f"| {o.get('FMUL', 0)} | {o.get('HMUL2', 0)} | {o.get('IMAD', 0)} |")


if __name__ == "__main__":
    main()
