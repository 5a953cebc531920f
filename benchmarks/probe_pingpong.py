"""Probe: the warp-specialized ping-pong Gluon GEMM against the Triton kernel, torch and dense.

Checks the ping-pong kernel against the fp32 reference on edge-case shapes, then times the ragged-M
GEMMs of a gpt-oss expert step (forward up / down, dgrad) with every implementation interleaved.
A development tool: the committed tables come from ``python -m moekit bench``.
"""

import sys

import torch

from moekit import config
from moekit.bench import SHAPES, environment, interleaved_ms
from moekit.bench.grouped_mm import _problem
from moekit.grouped_gemm import _ragged_m, _ragged_m_pingpong
from moekit.reference import grouped_mm_ref
from moekit.testing import assert_close, offs_from_counts

CASES = [  # (counts, M, K, N, b_trans, bias): reason
    ([300, 0, 517, 180], 1100, 200, 296, True, True),  # empty expert, K and N tails, rows past offs[-1]
    ([300, 0, 517, 180], 1100, 200, 296, False, True),  # the same, weights (E, K, N) row-major
    ([0, 0, 999, 0], 999, 64, 128, True, False),  # every row on one expert
    ([1, 2, 3, 4, 5], 15, 136, 264, False, True),  # groups smaller than a tile
    ([4096, 3000, 5000, 4192], 16288, 2880, 2880, True, True),  # full-size K and N, partial tiles
]


def check():
    gen = torch.Generator().manual_seed(0)
    for counts, m, k, n, b_trans, has_bias in CASES:
        e = len(counts)
        offs = offs_from_counts(counts, device="cuda")
        a = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        if b_trans:
            b = torch.randn(e, n, k, generator=gen).to("cuda", torch.bfloat16).mT
        else:
            b = torch.randn(e, k, n, generator=gen).to("cuda", torch.bfloat16)
        bias = torch.randn(e, n, generator=gen).to("cuda", torch.bfloat16) if has_bias else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        _ragged_m_pingpong(a, b, offs, out, bias)
        ref = grouped_mm_ref(a.double(), b.double(), offs)
        if bias is not None:
            rows = torch.repeat_interleave(torch.arange(e, device="cuda"), torch.tensor(counts, device="cuda"))
            ref[: sum(counts)] += bias.double()[rows]
        assert not out.isnan().any(), f"unwritten elements in case {counts, m, k, n}"
        assert_close(out, ref, torch.bfloat16, what=f"pingpong {counts} {m}x{k}x{n} trans={b_trans}")
        print(f"ok  {counts} M={m} K={k} N={n} b_trans={b_trans} bias={has_bias}")


CONFIGS = {  # label -> (tile, stages)
    "pp128x128s5": ((128, 128, 64), 5),
    "pp64x256s4": ((64, 256, 64), 4),
}


def bench(names=("gpt-oss-20b", "gpt-oss-120b"), configs=tuple(CONFIGS)):
    for name in names:
        shape = SHAPES[name]
        for proj in ("up", "down"):
            x, dy, w, offs = _problem(shape, proj, "balanced", "cuda")
            m = x.shape[0]
            ops = {"fwd": (x, w.mT), "dgrad": (dy, w)} if proj == "down" else {"fwd": (x, w.mT)}
            for op, (a, b) in ops.items():
                n, k = b.shape[2], b.shape[1]
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                w0 = b[0]
                fns = {
                    label: (lambda a=a, b=b, out=out, c=CONFIGS[label]: _ragged_m_pingpong(a, b, offs, out, None, *c))
                    for label in configs
                }
                fns.update({
                    "triton": lambda a=a, b=b: _ragged_m(a, b, offs, torch.bfloat16, None),
                    "torch": lambda a=a, b=b: torch._grouped_mm(a, b, offs),
                    "dense": lambda a=a, w0=w0: a @ w0,
                })
                ref = torch._grouped_mm(a, b, offs)
                errs = []
                for label in configs:
                    out.fill_(float("nan"))
                    _ragged_m_pingpong(a, b, offs, out, None, *CONFIGS[label])
                    errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
                ms = interleaved_ms(fns, rounds=3, rep_ms=100)
                tf = 2 * m * n * k / 1e9
                cells = " ".join(f"{impl} {t:.3f} ms ({tf / t:.0f})" for impl, t in ms.items())
                print(f"{name} {proj} {op} M={m} K={k} N={n} err={max(errs):.1e}: {cells}", flush=True)


if __name__ == "__main__":
    print(environment())
    assert config.use_pingpong(torch.device("cuda")), "needs an sm_90 GPU"
    if "bench" not in sys.argv[1:]:
        check()
    if "check" not in sys.argv[1:]:
        configs = [c for c in sys.argv[1:] if c in CONFIGS] or list(CONFIGS)
        bench(configs=configs)
