"""Development probe: the down-projection dgrad with the dSwiGLU epilogue, four ways to read aux,
against the plain dgrad GEMM and the unfused alternative (plain dgrad + elementwise SwiGLU backward).
Prints ms per call at gpt-oss-20b (T=24576, top-4, E=32)."""

import torch

from moekit.bench import bench_ms, environment
from moekit.config import TileConfig
from moekit.epilogue import SwiGLU
from moekit.experts import grouped_mm_dswiglu, swiglu_bwd, swiglu_fwd
from moekit.grouped_gemm import grouped_mm_fwd
from moekit.testing import offs_from_counts, routed_counts


def main():
    t, e, d, f = 24576, 32, 2880, 2880
    offs = offs_from_counts(routed_counts(t, e, 4), device="cuda")
    m = t * 4
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16).mT / 50  # (E, F, D) view of (E, D, F)
    aux = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16) * 3
    spec = SwiGLU()
    c128 = TileConfig(128, 128, 64, group_m=16, num_warps=8, num_stages=4, flatten=True)
    print(environment())
    rows = {
        "plain dgrad 128x128 (no epilogue)": lambda: grouped_mm_fwd(dy, w.mT, offs, cfg=c128),
        "plain dgrad heuristic (128x256)": lambda: grouped_mm_fwd(dy, w.mT, offs),
        "unfused: dgrad + swiglu_bwd + swiglu": lambda: (
            swiglu_bwd(aux, grouped_mm_fwd(dy, w.mT, offs), spec), swiglu_fwd(aux, spec)),
    }
    for pre in (False, True):
        for aux_tma in (True, False):
            rows[f"fused prefetch={pre} aux_tma={aux_tma}"] = (
                lambda pre=pre, aux_tma=aux_tma: grouped_mm_dswiglu(
                    dy, w, offs, aux, spec, AUX_PREFETCH=pre, AUX_TMA=aux_tma))
    ref = grouped_mm_dswiglu(dy, w, offs, aux, spec, AUX_PREFETCH=False, AUX_TMA=True)
    for name, fn in rows.items():
        ms = bench_ms(fn)
        same = ""
        if name.startswith("fused"):
            out = fn()
            same = f"  same as baseline variant: {all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))}"
        print(f"{name:45s} {ms:7.3f} ms{same}", flush=True)


if __name__ == "__main__":
    main()
