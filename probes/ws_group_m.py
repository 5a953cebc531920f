"""Paired A/B of the warp-specialized rows-ragged GEMM's GROUP_M (row tiles walked together inside a
group) on the block's rows-ragged GEMMs with big groups: a GROUP_M that covers a whole group reads each
weight panel once per group instead of once per band. Outputs compared bit for bit.

    python probes/ws_group_m.py [shape ...] [--group-m 8 16 32 64] [--rounds 7]
"""

import argparse

import torch

from moekit import grouped_mm, hopper
from moekit.bench import BLOCK_SHAPES, environment, paired_ratios
from moekit.testing import offs_from_counts, routed_counts


def _with_group_m(fn, group_m):
    def run():
        saved, hopper.WS_GROUP_M = hopper.WS_GROUP_M, group_m
        try:
            return fn()
        finally:
            hopper.WS_GROUP_M = saved
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["gpt-oss-20b", "mixtral-8x7b"])
    p.add_argument("--group-m", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    print(environment())
    for name in a.shapes:
        s = BLOCK_SHAPES[name]
        counts = routed_counts(s.tokens, s.e, s.top_k, generator=torch.Generator().manual_seed(0)).tolist()
        offs = offs_from_counts(counts, device="cuda")
        m = int(sum(counts))
        for gemm, k, n in (("up", s.d, 2 * s.f), ("down", s.f, s.d)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(s.e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).mT
            outs = {}

            def call(g, x=x, w=w, outs=outs, offs=offs):
                def run():
                    outs[g] = grouped_mm(x, w, offs)
                return run

            fns = {f"G{g}": _with_group_m(call(g), g) for g in a.group_m}
            for fn in fns.values():
                fn()
            first = outs[a.group_m[0]]
            equal = all(torch.equal(first, o) for o in outs.values())
            cells = paired_ratios(fns, f"G{a.group_m[0]}", rounds=a.rounds, warmup_ms=10, rep_ms=60)
            print(f"{name} {gemm} (M={m} K={k} N={n}, {m // s.e} rows per expert) bit-equal={equal} | "
                  + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
