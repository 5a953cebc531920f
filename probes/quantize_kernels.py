"""Probe: the two NVFP4 activation-quantize kernels (1x16 blocks, round to nearest) on one tensor, in
one process, interleaved: the Gluon kernel (``_kernels/nvfp4_gluon.py``, the ``gluon_quantize``
option) against the Triton kernel (``_quantize_kernel``), with the global scale given and computed on
the device, as GB/s (bytes read + written) and a fraction of the device copy bandwidth. Then both
kernels' outputs, bit for bit.

    python probes/quantize_kernels.py
"""

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


if __name__ == "__main__":
    main()
