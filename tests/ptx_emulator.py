"""An emulator of the few PTX instructions that moekit's inline-asm strings use, as the PTX ISA defines
them, on Python integers (b16 and b32 registers, predicates as bools). The CPU tests run the kernels'
asm strings through it, since Triton's interpreter runs no PTX."""

import re

import numpy as np
import torch

E4M3 = torch.float8_e4m3fn
U8 = torch.uint8


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): output byte i is byte (sel >> 4i) & 7 of {b, a}; selector bit 3
    replicates that byte's sign bit."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> 4 * i) & 0xF
        byte = src[s & 7]
        out |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << 8 * i
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        i = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> i) & 1) << bit
    return out


def _f16x2(x: int) -> np.ndarray:
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _bf16_is_nan(h: int) -> bool:
    return (h & 0x7FFF) > 0x7F80


def _bf16_value(h: int) -> float:
    return float(np.array([h << 16], dtype=np.uint32).view(np.float32)[0])


def _bf16x2_max(a: int, b: int) -> int:
    """``max.bf16x2``: per half the larger value; a NaN half gives the other operand's, two NaNs the
    canonical NaN 0x7FFF."""
    out = 0
    for sh in (0, 16):
        x, y = (a >> sh) & 0xFFFF, (b >> sh) & 0xFFFF
        if _bf16_is_nan(x) and _bf16_is_nan(y):
            r = 0x7FFF
        elif _bf16_is_nan(x) or _bf16_is_nan(y):
            r = y if _bf16_is_nan(x) else x
        else:
            r = x if _bf16_value(x) >= _bf16_value(y) else y
        out |= r << sh
    return out


def _run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run one of the kernel's asm strings on integers (b16 and b32 registers): the few instructions they
    use, as the PTX ISA defines them. Returns the registers."""
    regs = dict(inputs)
    body = asm.strip()
    body = body[1:-1] if body.startswith("{") else body  # a { } scope, or one bare instruction
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and "{" in rest:  # {lo, hi} <-> b32: unpack or pack two b16
            unpack = re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", rest)
            if unpack:
                lo, hi, src = unpack.groups()
                regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            else:
                d, lo, hi = re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", rest).groups()
                regs[d] = regs[lo] | regs[hi] << 16
            continue
        d, *args = [a.strip() for a in rest.split(",")]
        v = [regs[a] if a in regs else int(a, 0) for a in args]
        if op in ("mov.b32", "cvt.u16.u32"):
            r = v[0] & (0xFFFF if op == "cvt.u16.u32" else 0xFFFFFFFF)
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "add.u32":
            r = (v[0] + v[1]) & 0xFFFFFFFF
        elif op == "sub.u32":
            r = (v[0] - v[1]) & 0xFFFFFFFF
        elif op == "min.u32":
            r = min(v[0], v[1])
        elif op == "setp.eq.u32":
            r = v[0] == v[1]
        elif op == "selp.b32":  # d = p ? a : b
            r = v[0] if v[2] else v[1]
        elif op == "set.num.u32.bf16x2":  # per half: all ones where neither operand's half is NaN
            r = sum((0 if _bf16_is_nan((v[0] >> sh) & 0xFFFF) or _bf16_is_nan((v[1] >> sh) & 0xFFFF) else 0xFFFF) << sh
                    for sh in (0, 16))
        elif op == "max.bf16x2":
            r = _bf16x2_max(v[0], v[1])
        elif op == "max.NaN.bf16x2":  # per half: the canonical NaN 0x7FFF where either half is NaN
            r = sum((0x7FFF if _bf16_is_nan((v[0] >> sh) & 0xFFFF) or _bf16_is_nan((v[1] >> sh) & 0xFFFF)
                     else (_bf16x2_max(v[0], v[1]) >> sh) & 0xFFFF) << sh for sh in (0, 16))
        elif op == "shl.b32":
            r = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "shr.b32":  # unsigned (.b32): zeros shift in
            r = (v[0] & 0xFFFFFFFF) >> v[1]
        elif op == "bfi.b32":  # insert v[0]'s low v[3] bits into v[1] at bit v[2]
            mask = ((1 << v[3]) - 1) << v[2]
            r = (v[1] & ~mask & 0xFFFFFFFF) | ((v[0] << v[2]) & mask)
        elif op == "prmt.b32":
            r = _prmt(*v)
        elif op == "lop3.b32":
            r = _lop3(*v)
        elif op == "mul.rn.f16x2":  # exact products here, so numpy's float16 multiply rounds as PTX would
            r = int((_f16x2(v[0]) * _f16x2(v[1])).view(np.uint16).astype(np.uint32) @ [1, 1 << 16])
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte into the low half
            pair = torch.tensor([v[0] & 0xFF, v[0] >> 8], dtype=U8).view(E4M3).to(torch.float16)
            r = int(pair.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) @ [1, 1 << 16])
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        regs[d] = r
    return regs
