"""Development probe: tile configs of the down-projection dgrad with the dSwiGLU epilogue (one or two
programs per SM), against the plain dgrad GEMM, plus the standalone SwiGLU kernels. Prints ms per
call at gpt-oss-20b (T=24576, top-4, E=32)."""

import torch

from moekit.bench import bench_ms, environment
from moekit.config import TileConfig
from moekit.epilogue import SwiGLU
from moekit.experts import grouped_mm_dswiglu, swiglu_bwd, swiglu_fwd
from moekit.grouped_gemm import grouped_mm_fwd
from moekit.testing import offs_from_counts, routed_counts

T = TileConfig
CONFIGS = {
    "128x128 w8 s4": T(128, 128, 64, group_m=16, num_warps=8, num_stages=4, flatten=True),
    "64x128 w4 s3 x2/SM": T(64, 128, 64, group_m=16, num_warps=4, num_stages=3, flatten=True, programs_per_sm=2),
    "64x128 w4 s2 x2/SM": T(64, 128, 64, group_m=16, num_warps=4, num_stages=2, flatten=True, programs_per_sm=2),
    "64x128 w4 s3 x2/SM noflat": T(64, 128, 64, group_m=16, num_warps=4, num_stages=3, programs_per_sm=2),
}


def main():
    t, e, d, f = 24576, 32, 2880, 2880
    offs = offs_from_counts(routed_counts(t, e, 4), device="cuda")
    m = t * 4
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16).mT / 50  # (E, F, D) view of (E, D, F)
    aux = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16) * 3
    dh = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    print(environment())
    rows = {
        "plain dgrad heuristic (128x256)": lambda: grouped_mm_fwd(dy, w.mT, offs),
        "plain dgrad 64x128 x2/SM": lambda: grouped_mm_fwd(dy, w.mT, offs, cfg=CONFIGS["64x128 w4 s3 x2/SM"]),
        "standalone swiglu fwd (1.7 GB)": lambda: swiglu_fwd(aux, SwiGLU()),
        "standalone swiglu bwd (2.8 GB)": lambda: swiglu_bwd(aux, dh, SwiGLU()),
        "standalone swiglu fwd halves": lambda: swiglu_fwd(aux, SwiGLU(layout="halves")),
    }
    for layout in ("interleaved", "halves"):
        for name, cfg in CONFIGS.items():
            rows[f"fused {layout} {name}"] = (
                lambda cfg=cfg, layout=layout: grouped_mm_dswiglu(dy, w, offs, aux, SwiGLU(layout=layout), cfg=cfg))
    ref = {lay: grouped_mm_dswiglu(dy, w, offs, aux, SwiGLU(layout=lay)) for lay in ("interleaved", "halves")}
    for name, fn in rows.items():
        ms = bench_ms(fn)
        same = ""
        if name.startswith("fused"):
            out = fn()
            lay = name.split()[1]
            same = f"  bitwise equal to default: {all(torch.equal(a, b) for a, b in zip(out, ref[lay], strict=True))}"
        print(f"{name:45s} {ms:7.3f} ms{same}", flush=True)


if __name__ == "__main__":
    main()
