"""Per-kernel GPU times of one training step (forward + backward) of SonicMoE's block and of moekit's, on
one shape, in separate processes on the same GPU: where SonicMoE's step is shorter.

    python benchmarks/sonic_kernels.py --impl sonic --shape gpt-oss-20b    # needs sonicmoe importable
    python benchmarks/sonic_kernels.py --impl moekit --shape gpt-oss-20b

Plain SwiGLU, no biases, each block's own router, bf16, T from the benchmark's shape. The step is
profiled (``torch.profiler``) after its first calls (SonicMoE's first call autotunes its GEMMs), and the
kernels are listed by total time per step, with their calls, then the longer ones call by call in launch
order (which GEMM is which). ``--steady S`` then runs steps back to back for S seconds and reports the
time per step with the SM clock and board power that nvidia-smi samples meanwhile.
"""

import argparse
import time

import torch


def _profile(step, top: int, min_ms: float) -> None:
    from torch.profiler import ProfilerActivity, profile

    from moekit.bench import cuda_kernels

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    time.sleep(1.0)  # the clock as after a pause in both processes
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals, calls = {}, {}
    for e in cuda_kernels(prof):
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
        calls[e.name] = calls.get(e.name, 0) + 1
    print(f"kernels: {sum(calls.values())}, GPU time {sum(totals.values()):.2f} ms")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:7.3f} ms  x{calls[name]:<3d} {name[:110]}")
    print(f"in launch order, the kernels of {min_ms} ms or more:")
    for e in cuda_kernels(prof):
        ms = e.time_range.elapsed_us() / 1e3
        if ms >= min_ms:
            print(f"  {ms:7.3f} ms  {e.name[:110]}")


def _steady(step, seconds: float) -> None:
    """Steps back to back for ``seconds`` while nvidia-smi samples the SM clock and the board power every
    100 ms: the time per step, and the medians over the window's last two thirds (the power-capped
    state the benchmark's timed steps run in)."""
    import statistics
    import subprocess

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100", "-i", str(torch.cuda.current_device())],
                           stdout=subprocess.PIPE, text=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps, marks = 0, []
    while time.perf_counter() - t0 < seconds:
        step()
        steps += 1
        if steps % 4 == 0:
            torch.cuda.synchronize()
            marks.append((time.perf_counter() - t0, steps))
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    late = rows[len(rows) // 3:]
    t1, s1 = next((t, n) for t, n in marks if t >= seconds / 3)
    t2, s2 = marks[-1]
    print(f"steady {seconds:.0f} s: {1e3 * (t2 - t1) / max(s2 - s1, 1):.2f} ms per step over its last two thirds, "
          f"SM clock {statistics.median(float(r[0]) for r in late):.0f} MHz, "
          f"power {statistics.median(float(r[1]) for r in late):.0f} W (medians of {len(late)} samples)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["sonic", "moekit"], required=True)
    p.add_argument("--shape", default="gpt-oss-20b")
    p.add_argument("--top", type=int, default=24)
    p.add_argument("--min-ms", type=float, default=0.1, help="list each call of the kernels this long, in order")
    p.add_argument("--steady", type=float, default=0.0,
                   help="then run steps back to back this many seconds, sampling the SM clock and power")
    a = p.parse_args()
    from moekit.bench import BLOCK_SHAPES, environment

    s = BLOCK_SHAPES[a.shape]
    print(environment(), f"| {a.impl} {a.shape} T={s.tokens}", flush=True)
    torch.manual_seed(0)
    x = torch.randn(s.tokens, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    if a.impl == "sonic":
        from sonicmoe import MoE as SonicMoE
        from sonicmoe.enums import ActivationType

        moe = SonicMoE(num_experts=s.e, num_experts_per_tok=s.top_k, hidden_size=s.d, intermediate_size=s.f,
                       activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02).to(
                           device="cuda", dtype=torch.bfloat16)

        def fwd():
            return moe(x)[0]
    else:
        import moekit
        from moekit.bench.moe import CONFIGS

        moe = moekit.MoE(s.d, s.f, s.e, s.top_k, device="cuda", dtype=torch.bfloat16, **CONFIGS["plain"])

        def fwd():
            return moe(x)

    params = [x, *moe.parameters()]

    def step():
        return torch.autograd.grad(fwd(), params, dy)

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    print(f"first call {time.perf_counter() - t0:.1f} s", flush=True)
    _profile(step, a.top, a.min_ms)
    if a.steady:
        _steady(step, a.steady)


if __name__ == "__main__":
    main()
