"""Why an implementation's timing depends on what ran before it: GptOssExperts' forward (gpt-oss-20b)
timed cool, right after seconds of other work, and after an idle pause, with the SM clock, temperature
and power draw that nvidia-smi reports after each measurement.

    PYTHONPATH=src python3 probes/order.py
"""

import subprocess
import time

import torch

from moekit.bench import SHAPES, bench_ms
from moekit.bench.baselines import TorchtitanExperts
from moekit.bench.experts import _dense_calls
from moekit.layers import GptOssExperts
from moekit.testing import routed_counts


def _busy(fn, secs):
    t = time.time()
    while time.time() - t < secs:
        fn()
    torch.cuda.synchronize()


def _clocks():
    query = ["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip()


def main():
    s = SHAPES["gpt-oss-20b"]
    rows = s.tokens * s.top_k
    counts = routed_counts(s.tokens, s.e, s.top_k).cuda()
    ex = GptOssExperts(s.d, s.f, s.e, device="cuda", dtype=torch.bfloat16)
    base = TorchtitanExperts(ex)
    x = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return ex(x, counts)

    def torchtitan_step():
        return torch.autograd.grad(base(x, counts), [x, *ex.parameters()], dy)

    _, dense_bwd = _dense_calls(x.detach(), s.d, s.f, "cuda")
    fwd()
    torchtitan_step()
    torch.cuda.synchronize()
    print(f"cool: {bench_ms(fwd):.2f} ms | {_clocks()}", flush=True)
    for name, fn in (("torchtitan step", torchtitan_step), ("dense backward", dense_bwd), ("moekit forward", fwd)):
        _busy(fn, 3)
        print(f"after 3 s of {name}: {bench_ms(fwd):.2f} ms | {_clocks()}", flush=True)
    time.sleep(5)
    print(f"after 5 s idle: {bench_ms(fwd):.2f} ms | {_clocks()}", flush=True)


if __name__ == "__main__":
    main()
