"""Probe: the two NVFP4 activation-quantize kernels (1x16 blocks, round to nearest) on one tensor, in
one process, interleaved: the Gluon kernel (``_kernels/nvfp4_gluon.py``, the ``gluon_quantize``
option) against the Triton kernel (``_quantize_kernel``), with the global scale given and computed on
the device, as GB/s (bytes read + written) and a fraction of the device copy bandwidth. Then both
kernels' outputs, bit for bit, and a sweep of the Gluon kernel's tile (rows, columns, warps, programs
per SM, register cap), each checked bit for bit; with ``_before/gluon_before.py`` present (a copy of an
earlier version of the kernel), that version too.

    python probes/quantize_kernels.py
"""

import importlib.util
import os

import torch

import moekit
from moekit import nvfp4
from moekit.bench import bench_ms, copy_bandwidth_gbs, environment


def main():
    print(environment())
    copy = copy_bandwidth_gbs()
    m, k = 24576 * 4, 2880
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = nvfp4.quantize(x)[2]
    nbytes = 2 * m * k + m * k // 2 + m * k // 16
    for _ in range(2):
        for gluon in (False, True):
            with moekit.options(gluon_quantize=gluon):
                ms = bench_ms(lambda: nvfp4.quantize(x, g))
                ms_device = bench_ms(lambda: nvfp4.quantize(x))
            print(f"quantize {'gluon ' if gluon else 'triton'} given scale {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s "
                  f"{nbytes / ms / 1e6 / copy:.2f} of copy ({copy:.0f}); scale on device {ms_device:.3f} ms")
    with moekit.options(gluon_quantize=False):
        a = nvfp4.quantize(x, g)[:2]
    b = nvfp4.quantize(x, g)[:2]
    same = all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(a, b, strict=True))
    print("kernels bit-equal:", same)
    tiles(x, g, nbytes, copy, b)
    swiglu_tiles(g, copy)


def tiles(x, g, nbytes, copy, want):
    """The Gluon kernel's tile: rows per program, blocks per row (NB), warps; each checked bit for bit."""
    import triton

    from moekit._kernels.nvfp4_gluon import _quantize_rows_kernel

    m, k = x.shape
    values = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, k // 16, dtype=torch.uint8, device=x.device)
    before = os.path.join(os.path.dirname(__file__), "_before", "gluon_before.py")
    if os.path.exists(before):  # an earlier version of the kernel, when copied there, timed in the same process
        spec = importlib.util.spec_from_file_location("gluon_before", before)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)

        def run_before():
            mod._quantize_rows_kernel[(triton.cdiv(m, 32), triton.cdiv(k, 128), 1)](
                x, values, scales, g, m, k, 0, x.stride(0), x.stride(1), 0, BLOCK_M=32, NB=8, TPW_B=8, num_warps=4)
        _time_checked("gluon before 32x128 4 warps", run_before, (values, scales), want, nbytes, copy)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for words in (True, False):  # bf16 read as 32-bit words (the default for bf16) or as elements
        for bm, nb, warps, per_sm, maxnreg in (
                (128, 8, 16, 1, None), (128, 8, 16, 2, None), (64, 8, 16, 1, None), (64, 8, 16, 2, None),
                (64, 8, 8, 2, None), (64, 8, 8, 3, None), (64, 8, 8, 4, None), (32, 8, 4, 8, None),
                (128, 8, 16, 1, 64), (64, 8, 8, 4, 80)):
            tiles_k = triton.cdiv(k, 16 * nb)
            if words:  # persistent over all tiles
                grid = (min(triton.cdiv(m, bm) * tiles_k, sms * per_sm), 1, 1)
            else:  # persistent along the rows of each column tile
                grid = (max(1, min(triton.cdiv(m, bm), sms * per_sm // tiles_k)), tiles_k, 1)

            def run(bm=bm, nb=nb, warps=warps, grid=grid, maxnreg=maxnreg, words=words):
                _quantize_rows_kernel[grid](
                    x, values, scales, g, m, k, 0, x.stride(0), x.stride(1), 0, BLOCK_M=bm, NB=nb, TPW_B=nb,
                    WORDS=words, num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
            _time_checked(f"gluon {'words' if words else 'elements'} tile {bm}x{nb * 16} {warps} warps {per_sm} "
                          f"programs/SM maxnreg {maxnreg}", run, (values, scales), want, nbytes, copy)


def _time_checked(label, run, outs, want, nbytes, copy):
    """One launch into poisoned outputs, compared with ``want`` bit for bit, then timed."""
    outs[0].fill_(0xFF)
    run()
    same = all(torch.equal(o, w.view(torch.uint8)) for o, w in zip(outs, want[:2], strict=True))
    ms = bench_ms(run)
    print(f"{label}: {ms:.3f} ms {nbytes / ms / 1e6 / copy:.2f} of copy, bit-equal {same}")


def swiglu_tiles(g, copy):
    """The Gluon SwiGLU -> NVFP4 pass against the Triton one (98304 x 2 * 2880 bf16, each layout), and
    its tile sweep on the interleaved8 layout, each checked bit for bit."""
    import triton

    from moekit._kernels.nvfp4_gluon import _swiglu_quantize_rows_kernel
    from moekit.nvfp4 import swiglu as ns

    m, f = 24576 * 4, 2880
    pre = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * m * 2 * f + m * f // 2 + m * f // 16
    for layout in ("interleaved", "halves", "interleaved8"):
        for gluon in (False, True):
            with moekit.options(gluon_quantize=gluon):
                ms = bench_ms(lambda layout=layout: ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout))
            print(f"swiglu_quantize {layout} {'gluon ' if gluon else 'triton'} {ms:.3f} ms "
                  f"{nbytes / ms / 1e6 / copy:.2f} of copy")
    with moekit.options(gluon_quantize=False):
        want = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout="interleaved8")
    values = torch.empty(m, f // 2, dtype=torch.uint8, device="cuda")
    scales = torch.empty(m, f // 16, dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for words in (True, False):  # bf16 h quantized as 32-bit words (the default) or element by element
        for bm, nb, warps, per_sm in ((64, 8, 16, 1), (64, 8, 16, 2), (64, 8, 16, 3), (64, 8, 8, 4),
                                      (32, 8, 8, 8), (128, 8, 16, 1), (128, 8, 16, 2), (32, 8, 4, 8)):
            tiles_f = triton.cdiv(f, 16 * nb)
            programs = max(1, min(triton.cdiv(m, bm), sms * per_sm // tiles_f))

            def run(bm=bm, nb=nb, warps=warps, programs=programs, tiles_f=tiles_f, words=words):
                _swiglu_quantize_rows_kernel[(programs, tiles_f)](
                    pre, values, scales, g, m, f, pre.stride(0), ALPHA=1.702, LIMIT=7.0, OFFSET=1.0,
                    LAYOUT="interleaved8", BLOCK_M=bm, NB=nb, TPW_B=nb, WORDS=words, num_warps=warps)
            _time_checked(f"swiglu gluon {'words' if words else 'elements'} tile {bm}x{nb * 16} {warps} warps "
                          f"{per_sm} programs/SM", run, (values, scales), want, nbytes, copy)


if __name__ == "__main__":
    main()
