"""Probe: where the host's time goes in one expert GEMM call of the MoE block (qwen3-30b-a3b by
default). Each piece of the down-projection's and the up-projection's launch path is called on its
own with the GPU queue drained, median of ``--reps`` calls, in microseconds: the public op, the
launcher, the TMA descriptors, the tile table kernel, the kernel launch with prebuilt arguments,
and the small helpers on the way.

    python probes/host_launch.py [--shape qwen3-30b-a3b] [--reps 50] [--profile]
"""

import argparse
import cProfile
import pstats

import torch
import triton

from moekit import config
from moekit._kernels import hopper_gemm as hk
from moekit._kernels.experts import _grouped_mm_swiglu_kernel
from moekit.bench import BLOCK_SHAPES, host_us
from moekit.bench.moe import training_step
from moekit.descriptors import TensorDescriptor, row_bounded, weight_descriptor
from moekit.experts import grouped_mm_downproj, grouped_mm_swiglu, grouped_mm_swiglu_fwd
from moekit.grouped_gemm import _ragged_m
from moekit.hopper import WS_GROUP_M, WS_STAGES, WS_TILE, ws_desc, ws_gemm, ws_ok, ws_rows_setup
from moekit.routing import _metadata, _router_op, sorted_weights


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(BLOCK_SHAPES))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="cProfile each public op and launch")
    a = p.parse_args()
    moe, x, _ = training_step(BLOCK_SHAPES[a.shape], "plain")
    ex = moe.experts
    w1, w2 = ex.mlp1_weight_EGD.mT, ex.mlp2_weight_EDF.mT
    with torch.no_grad():
        rt = _router_op(x, moe.router.weight, None, None, moe.top_k, False, True)
        counts, offs, token_idx, row_of = _metadata(rt[1], w1.shape[0])
        scale = sorted_weights(rt[0], row_of)
    spec_kw = {k: v for k, v in ex.swiglu.items()}
    h, aux = grouped_mm_swiglu(x.detach(), w1, offs, token_idx=token_idx, row_of=row_of, row_scale=scale, **spec_kw)
    m, f = h.shape
    dev = x.device
    c = torch.empty(m, w2.shape[2], device=dev, dtype=h.dtype)
    bm, bn, bk = WS_TILE
    a_desc, b_desc, table, programs = ws_rows_setup(h, w2, offs, c, c, box_n=bn)
    c_desc = ws_desc(c, [m, c.shape[1]], [c.stride(0), 1], [bm // 2, bn])
    common = dict(NUM_SMS=config.num_sms(dev), GROUP_M=WS_GROUP_M, STAGES=WS_STAGES, B_TRANS=w2.stride(2) != 1,
                  ALPHA=1.0, LIMIT=None, OFFSET=0.0, maxnreg=168)

    def ws_launch():
        hk._grouped_mm_ws_kernel[(programs,)](
            a_desc, b_desc, c_desc, c, c.stride(0), c, c.stride(0), c, 0, table, c,
            w2.shape[2], f, HAS_BIAS=False, EPILOGUE=0, num_warps=4, **common,
        )

    max_row_tiles = triton.cdiv(m, bm) + w2.shape[0]

    def table_launch():
        hk._tile_table_kernel[(max(triton.cdiv(max_row_tiles, 32), 8),)](
            offs, table, c, c, m, c.shape[1], 0, w2.shape[0], c.stride(0), c.stride(0), max_row_tiles,
            BLOCK_M=bm, BLOCK_E=triton.next_power_of_2(w2.shape[0] + 1), BLOCK_T=32, BLOCK_Z=32, ZERO_TAIL=True,
            num_warps=4,
        )

    from triton.experimental.gluon import language as gl

    rows = []

    def add(name, fn):
        rows.append((name, host_us(fn, a.reps)))

    add("down: grouped_mm_downproj (public, aux given)",
        lambda: grouped_mm_downproj(h, w2, offs, aux_biased_acc=aux, row_scale=scale, **spec_kw))
    add("down: _ragged_m", lambda: _ragged_m(h, w2, offs, h.dtype, None))
    add("down: ws_gemm (output given)", lambda: ws_gemm(h, w2, offs, c))
    add("down: ws_rows_setup (2 descriptors + tile table)", lambda: ws_rows_setup(h, w2, offs, c, c, box_n=bn))
    add("down: tile table launch", table_launch)
    add("down: Gluon kernel launch, prebuilt descriptors", ws_launch)
    add("ws_desc (one Gluon descriptor)", lambda: ws_desc(h, [m, f], [h.stride(0), 1], [bm, bk]))
    add("NVMMASharedLayout.get_default_for", lambda: gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
    add("weight_descriptor (Gluon)", lambda: weight_descriptor(w2, bk, bn, make=ws_desc))
    add("ws_ok", lambda: ws_ok(h, w2, c))
    add("config.empty (R, D)", lambda: config.empty((m, c.shape[1]), dtype=h.dtype, device=dev))
    add("config.num_sms", lambda: config.num_sms(dev))
    xd = x.detach()
    add("up: grouped_mm_swiglu (public, gathered, row scales)",
        lambda: grouped_mm_swiglu(xd, w1, offs, token_idx=token_idx, row_of=row_of, row_scale=scale, **spec_kw))
    spec = __import__("moekit.epilogue", fromlist=["SwiGLU"]).SwiGLU(
        spec_kw["swiglu_alpha"], spec_kw["swiglu_limit"], spec_kw["swiglu_linear_offset"], spec_kw["gate_up_layout"])
    add("up: grouped_mm_swiglu_fwd (launcher)",
        lambda: grouped_mm_swiglu_fwd(xd, w1, offs, None, spec, token_idx=token_idx, row_scale=scale))
    e, d = w1.shape[0], w1.shape[1]
    cfg = config.grouped_mm_config(m // e, 2 * f, d, e, ragged_k=False, tma=True, out_bytes=2, device=dev,
                                   epilogue="swiglu")
    add("up: grouped_mm_config (cached)", lambda: config.grouped_mm_config(
        m // e, 2 * f, d, e, ragged_k=False, tma=True, out_bytes=2, device=dev, epilogue="swiglu"))
    add("row_bounded (Triton descriptor)", lambda: row_bounded(aux, [cfg.block_m, cfg.block_n // 2]))
    add("TensorDescriptor (Triton)", lambda: TensorDescriptor(aux, [m, 2 * f], [aux.stride(0), 1], [128, 64]))
    bm2, bn2, bk2 = cfg.block_m, cfg.block_n, cfg.block_k
    args = (xd, weight_descriptor(w1, bk2, bn2), row_bounded(aux, [bm2, bn2 // 2]), row_bounded(aux, [bm2, bn2 // 2]),
            row_bounded(h, [bm2, bn2 // 4]))
    tiles = (triton.cdiv(m, bm2) + e + 1) * triton.cdiv(f, bn2 // 2)

    def up_launch():
        _grouped_mm_swiglu_kernel[(min(config.num_sms(dev) * cfg.programs_per_sm, tiles),)](
            *args, offs, None, token_idx, scale, m, f, d, e, xd.stride(0), xd.stride(1),
            w1.stride(0), w1.stride(1), w1.stride(2), aux.stride(0), h.stride(0), 0,
            BLOCK_M=bm2, BLOCK_N=bn2, BLOCK_K=bk2, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(e + 1),
            B_TRANS=w1.stride(2) != 1, USE_TMA=True, DOT_F32=False, FLATTEN=cfg.flatten,
            OUT_DTYPE=__import__("triton.language", fromlist=["bfloat16"]).bfloat16, **spec.constexprs(),
            ZERO_TAIL=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    add("up: Triton kernel launch, prebuilt descriptors", up_launch)
    for name, us in rows:
        print(f"{us:8.1f} us  {name}")
    if a.profile:
        named = {
            "down public": lambda: grouped_mm_downproj(h, w2, offs, aux_biased_acc=aux, row_scale=scale, **spec_kw),
            "Gluon launch": ws_launch,
            "Triton launch": up_launch,
            "up public": lambda: grouped_mm_swiglu(xd, w1, offs, token_idx=token_idx, row_of=row_of,
                                                   row_scale=scale, **spec_kw),
        }
        for name, fn in named.items():
            prof = cProfile.Profile()
            for _ in range(a.reps):
                torch.cuda.synchronize()
                prof.enable()
                fn()
                prof.disable()
            print(f"=== {name}: {a.reps} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
