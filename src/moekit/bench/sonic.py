"""SonicMoE, the peer MoE block that moekit is benchmarked against, timed in a child process.

SonicMoE (package ``sonicmoe`` 0.1.2.post1, CuTe-DSL kernels from Tri Dao's lab) runs in its own Python
process with a wall-clock timeout, because:

- run in the same process after moekit's kernels, it can hang for over 9 minutes;
- its first call per shape autotunes each of the block's six QuACK GEMMs, compiling every candidate
  configuration in worker processes: 30-140 s per GEMM on an H100 machine's 16 cores, so minutes per
  shape unless QuACK's cache (``QUACK_CACHE_DIR``, which ``benchmarks/run_gpu.sh`` sets) already holds
  the shape's results.

A hang or a crash therefore becomes a row status (``"timeout after N s"``, ``"error: ..."``), never a hung
benchmark. What is compared: SonicMoE's whole ``MoE`` block with plain SwiGLU, no biases and its own
softmax top-k router, in bf16. Forward and backward are timed with ``triton.testing.do_bench`` (median),
backward = forward+backward minus forward, and saved activations are the memory allocated by a forward
minus its output. If ``sonicmoe`` is not importable in this Python environment the row reads
``"not installed"``; install the package into the same environment to enable it.

The child is ``python -m moekit.bench.sonic --d D --f F --e E --top-k K --tokens T``; it prints one line
``MOEKIT_SONIC_JSON {...}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

MARKER = "MOEKIT_SONIC_JSON "
_SRC_DIR = Path(__file__).resolve().parents[2]  # .../src, so the child finds moekit without an install


def available() -> bool:
    """Whether ``sonicmoe`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("sonicmoe") is not None


def sonicmoe_block_times(d: int, f: int, e: int, top_k: int, tokens: int, *, timeout_s: float = 300.0) -> dict:
    """Time SonicMoE's MoE block on one shape in a child process.

    Returns ``{"status": "ok", "fwd": ms, "bwd": ms, "saved": bytes, "compile_s": s}`` on success, else
    ``{"status": "timeout after N s" | "error: ..." | "not installed"}``.
    """
    args = ["--d", d, "--f", f, "--e", e, "--top-k", top_k, "--tokens", tokens]
    cmd = [sys.executable, "-m", "moekit.bench.sonic", *map(str, args)]
    return _run_child(cmd, timeout_s)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(_SRC_DIR) + (os.pathsep + path if path else "")
    # SonicMoE's tvm-ffi JIT-builds a torch C++ extension (the DLPack exchange addon) on first import
    # where no prebuilt one matches the torch version; one cache for all children builds it once.
    env.setdefault("TVM_FFI_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tvm-ffi"))
    return env


def _run_child(cmd: list[str], timeout_s: float) -> dict:
    """Run ``cmd`` in its own process group and parse its result line; kill the whole group on timeout."""
    # The child leads its own process group, so killpg also reaches compiler/autotune grandchildren.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(), start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _, stderr = _kill_group(proc)
        last = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
        # where it was (the child prints its phases; ``--trace-every`` adds stack dumps)
        print("\n".join(["sonicmoe child timed out; the end of its stderr:", *last[-40:]]), file=sys.stderr)
        seen = f" (its last line: {last[-1][:80].replace('|', '/')})" if last else " (it printed nothing)"
        return {"status": f"timeout after {timeout_s:g} s{seen}"}
    except BaseException:  # e.g. Ctrl-C in the parent: do not leave a GPU-holding orphan behind
        _kill_group(proc)
        raise
    result = _parse_result(stdout)
    if proc.returncode != 0 or result is None:
        return {"status": "error: " + _last_line(stderr, proc.returncode)}
    return result


def _kill_group(proc: subprocess.Popen) -> tuple[str, str]:
    """Kill the child's process group; return what it had printed (stdout, stderr)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone
    try:
        return proc.communicate(timeout=10)  # reap it and drain the pipes
    except subprocess.TimeoutExpired:  # a grandchild that left the group still holds a pipe
        proc.wait()
        return "", ""


def _parse_result(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                result = json.loads(line[len(MARKER) :])
            except json.JSONDecodeError:
                return None
            return result if isinstance(result, dict) and "status" in result else None
    return None


def _last_line(stderr: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    msg = lines[-1] if lines else f"exit code {returncode}, no result line"
    return msg[:120]


# ---------------------------------------------------------------------------------------------- child


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moekit.bench.sonic", description="Time SonicMoE's MoE block once.")
    for name in ("--d", "--f", "--e", "--top-k", "--tokens"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--trace-every", type=float, metavar="S",
                   help="dump this process's Python stacks to stderr every S seconds, to see where a hang sits "
                        "(faulthandler reads other threads' frames unlocked and can crash the process)")
    p.add_argument("--wait-for", metavar="PATH",
                   help="after the first (compiling) call, wait until PATH exists before timing: the compile can "
                        "then overlap other work without disturbing the timings")
    return p.parse_args(argv)


def _emit(result: dict) -> None:
    print(MARKER + json.dumps(result), flush=True)


def _median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _child(args: argparse.Namespace) -> None:
    start = time.perf_counter()

    def phase(what: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    if args.trace_every:
        import faulthandler

        faulthandler.dump_traceback_later(args.trace_every, repeat=True, file=sys.stderr)
    try:
        from sonicmoe import MoE as SonicMoE
        from sonicmoe.enums import ActivationType
    except Exception:  # a broken install (missing CUDA libs, etc.) is reported like a missing one
        _emit({"status": "not installed"})
        return
    phase("imported sonicmoe")

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("SonicMoE benchmark needs CUDA")
    torch.manual_seed(0)
    moe = SonicMoE(
        num_experts=args.e,
        num_experts_per_tok=args.top_k,
        hidden_size=args.d,
        intermediate_size=args.f,
        activation_function=ActivationType.SWIGLU,
        add_bias=False,
        std=0.02,
    ).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # A real dy: a stride-0 gradient (as from y.sum().backward()) trips an assertion in SonicMoE's quack dependency.
    dy = torch.randn_like(x)
    params = [x, *moe.parameters()]
    phase("built the block")

    def fwd() -> torch.Tensor:
        return moe(x)[0]

    def step() -> tuple:
        return torch.autograd.grad(fwd(), params, dy)

    # The first call per shape autotunes and compiles; report it apart so it does not pollute the timings.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    phase(f"first call (compile and autotune) took {compile_s:.1f} s")
    if args.trace_every:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.5)

    # Alternate rounds so clock/thermal drift hits forward and step alike.
    fwd_ms, step_ms = [], []
    for _ in range(3):
        fwd_ms.append(_median_ms(fwd))
        step_ms.append(_median_ms(step))
    fwd_t, step_t = statistics.median(fwd_ms), statistics.median(step_ms)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fwd()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()

    _emit(
        {
            "status": "ok",
            "fwd": fwd_t,
            "bwd": max(step_t - fwd_t, 1e-6),
            "saved": int(saved),
            "compile_s": compile_s,
        }
    )


if __name__ == "__main__":
    _child(_parse_args())
