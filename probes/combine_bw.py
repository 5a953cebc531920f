"""How close the block's combine and its backward (the plain-sum form the bias-free block runs) come to
the copy bandwidth, and which program shape gets there.

    PYTHONPATH=src python probes/combine_bw.py [--shapes qwen3-30b-a3b gpt-oss-20b]

For each shape: balanced routing (top-k of softmax(randn)), y (T*K, D) bf16 random; the package's
``combine_fwd`` / ``combine_bwd`` against variants of the same gather-reduce and scatter-copy with other
tiles, warps and load orders (each checked bit for bit against the package's output), and a device
copy of the same bytes. GB/s counts bytes read plus written.
"""

import argparse

import torch
import triton
import triton.language as tl

from moekit import routing
from moekit.routing import combine_bwd, combine_fwd

SHAPES = {  # D, E, K, T
    "qwen3-30b-a3b": (2048, 128, 8, 16384),
    "gpt-oss-20b": (2880, 32, 4, 24576),
    "qwen3-235b-a22b": (4096, 128, 8, 16384),
}


@triton.jit
def _combine_v(y, row_of, out, T, D, stride_y, stride_out,
               K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_FIRST: tl.constexpr,
               D_LOOP: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    if ROWS_FIRST:  # every choice's row in one [BLOCK_T, K] load, before any y load
        ks = tl.arange(0, K)
        rows2 = tl.load(row_of + tok[:, None] * K + ks[None, :], mask=tok_ok[:, None], other=-1)
    d_start = 0 if D_LOOP else tl.program_id(1) * BLOCK_D
    d_end = D if D_LOOP else d_start + BLOCK_D
    for d0 in range(d_start, d_end, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = tok_ok[:, None] & (cols[None, :] < D)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for k in tl.static_range(K):
            if ROWS_FIRST:
                rows = tl.sum(tl.where(tl.arange(0, K)[None, :] == k, rows2, 0), 1)
            else:
                rows = tl.load(row_of + tok * K + k, mask=tok_ok, other=-1)
            here = mask & (rows[:, None] >= 0)
            vals = tl.load(y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], mask=here, other=0.0)
            acc += vals.to(tl.float32)
        tl.store(out + tok[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=mask)


@triton.jit
def _scatter_v(dout, row_of, dy, T, D, stride_dout, stride_dy,
               K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, D_LOOP: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    d_start = 0 if D_LOOP else tl.program_id(1) * BLOCK_D
    d_end = D if D_LOOP else d_start + BLOCK_D
    for d0 in range(d_start, d_end, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = tok_ok[:, None] & (cols[None, :] < D)
        g = tl.load(dout + tok[:, None].to(tl.int64) * stride_dout + cols[None, :], mask=mask, other=0.0)
        for k in tl.static_range(K):
            rows = tl.load(row_of + tok * K + k, mask=tok_ok, other=-1)
            tl.store(dy + rows[:, None].to(tl.int64) * stride_dy + cols[None, :], g,
                     mask=mask & (rows[:, None] >= 0))


def bench(fn, reps=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps // 10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 10)
    times.sort()
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    for name in args.shapes:
        shape(name, dev)


def shape(name, dev):
    d, e, k, t = SHAPES[name]
    torch.manual_seed(0)
    experts = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, -1).indices.to(torch.int32)
    _, _, _, row_of = routing.routing_metadata(experts, e)
    r = t * k
    y = torch.randn(r, d, device=dev, dtype=torch.bfloat16)
    dout = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    gb = (r * d + t * d) * 2 / 1e9
    ref = combine_fwd(y, None, row_of)
    ref_dy, _ = combine_bwd(dout, None, None, row_of, False, rows=r)
    big = torch.empty(r * d + t * d, device=dev, dtype=torch.bfloat16)
    big2 = torch.empty_like(big)
    ms = bench(lambda: big2.copy_(big))
    copy_bw = 2 * big.numel() * 2 / 1e9 / (ms / 1e3)
    print(f"\n## {name}: T={t} D={d} K={k}; {gb:.3f} GB read+written; copy of the same bytes {ms:.3f} ms "
          f"({copy_bw:.0f} GB/s)")
    ms = bench(lambda: combine_fwd(y, None, row_of))
    print(f"fwd package (8x256, 4 warps): {ms:.3f} ms  {gb / (ms / 1e3):.0f} GB/s  "
          f"{gb / (ms / 1e3) / copy_bw:.2f} of copy")
    out = torch.empty(t, d, device=dev, dtype=torch.bfloat16)
    for bt, bd, nw, rows_first, d_loop in [
        (8, 256, 4, False, False), (8, 256, 4, True, False), (16, 256, 4, True, False),
        (4, 512, 4, True, False), (8, 512, 8, True, False), (16, 512, 8, True, False),
        (2, 1024, 4, True, False), (4, 1024, 8, True, False), (8, 256, 4, True, True),
        (4, 512, 4, True, True), (16, 128, 4, True, False), (32, 128, 8, True, False),
    ]:
        grid = (triton.cdiv(t, bt), 1 if d_loop else triton.cdiv(d, bd))

        def run(grid=grid, bt=bt, bd=bd, nw=nw, rows_first=rows_first, d_loop=d_loop):
            _combine_v[grid](y, row_of, out, t, d, y.stride(0), out.stride(0), K=k, BLOCK_T=bt,
                             BLOCK_D=bd, ROWS_FIRST=rows_first, D_LOOP=d_loop, num_warps=nw)
        out.fill_(float("nan"))
        run()
        ok = torch.equal(out, ref)
        ms = bench(run)
        print(f"fwd {bt}x{bd} {nw}w rows_first={int(rows_first)} d_loop={int(d_loop)}: {ms:.3f} ms  "
              f"{gb / (ms / 1e3):.0f} GB/s  {gb / (ms / 1e3) / copy_bw:.2f} of copy  equal={ok}")
    ms = bench(lambda: combine_bwd(dout, None, None, row_of, False, rows=r))
    print(f"bwd package (8x256, 4 warps, D loop): {ms:.3f} ms  {gb / (ms / 1e3):.0f} GB/s  "
          f"{gb / (ms / 1e3) / copy_bw:.2f} of copy")
    dy = torch.empty(r, d, device=dev, dtype=torch.bfloat16)
    for bt, bd, nw, d_loop in [
        (8, 256, 4, True), (8, 256, 4, False), (4, 512, 4, False), (8, 512, 8, False), (16, 256, 4, False),
        (2, 1024, 4, False), (4, 1024, 8, False), (16, 512, 8, False), (32, 128, 8, False),
    ]:
        grid = (triton.cdiv(t, bt), 1 if d_loop else triton.cdiv(d, bd))

        def run(grid=grid, bt=bt, bd=bd, nw=nw, d_loop=d_loop):
            _scatter_v[grid](dout, row_of, dy, t, d, dout.stride(0), dy.stride(0), K=k, BLOCK_T=bt,
                             BLOCK_D=bd, D_LOOP=d_loop, num_warps=nw)
        dy.fill_(float("nan"))
        run()
        ok = torch.equal(dy, ref_dy)
        ms = bench(run)
        print(f"bwd {bt}x{bd} {nw}w d_loop={int(d_loop)}: {ms:.3f} ms  {gb / (ms / 1e3):.0f} GB/s  "
              f"{gb / (ms / 1e3) / copy_bw:.2f} of copy  equal={ok}")


if __name__ == "__main__":
    main()
