"""Is a GEMM on the H100 bound by its power cap? Runs each case back to back for ~1.5 s while
nvidia-smi samples the SM clock and the board power, and prints ms per call with the median clock and
power of the steady part. Cases: a dense bf16 matmul with random operands, with A all zeros, and with
half of A's 128-row blocks zero (the rows a grouped GEMM computes past a group's end can be random
rows of the next group or zeros), then the same three on the gpt-oss-120b up-projection shape.

    python probes/power.py
"""

import subprocess
import time

import torch

from moekit.bench import environment


def _sampled(fn, seconds=1.5):
    """(ms per call, median SM clock MHz, median board power W) of ``fn`` run back to back for
    ``seconds``, the clock and power over the steady last two thirds. ``fn=None`` samples the idle GPU
    (ms is nan)."""
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, text=True,
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < seconds:
        if fn is None:
            time.sleep(0.05)
            continue
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / calls if calls else float("nan")
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.strip()]
    steady = rows[len(rows) // 3:] or rows
    clocks = sorted(float(r[0]) for r in steady)
    power = sorted(float(r[1]) for r in steady)
    return ms, clocks[len(clocks) // 2], power[len(power) // 2]


def main():
    print(environment())
    bf16 = torch.bfloat16
    for m, k, n in ((8192, 8192, 8192), (98304, 2880, 5760)):
        b = torch.randn(k, n, device="cuda", dtype=bf16)
        a = torch.randn(m, k, device="cuda", dtype=bf16)
        half = a.clone().view(m // 128, 128, k)
        half[1::2] = 0
        cases = {"random": a, "zero A": torch.zeros_like(a), "half A rows zero": half.view(m, k)}
        for name, x in cases.items():
            ms, clock, power = _sampled(lambda x=x, b=b: torch.mm(x, b))
            tf = 2 * m * k * n / ms / 1e9
            print(f"{m}x{k}x{n} {name}: {ms:.3f} ms, {tf:.0f} TF/s, {clock:.0f} MHz, {power:.0f} W", flush=True)
            time.sleep(1.0)


if __name__ == "__main__":
    main()
