"""MoE-block benchmark: ``moekit.MoE`` against the torchtitan-style block, SonicMoE and a dense matmul.

Each shape runs the whole block (router, dispatch, experts, combine) in the configuration SonicMoE
computes: plain SwiGLU (``silu(gate) * up``), no expert or router biases, softmax top-k with the
chosen scores renormalized. The gpt-oss shapes also run gpt-oss's own configuration (biases and the
gpt-oss SwiGLU) against the torchtitan-style gpt-oss block. Per implementation: forward and backward
times (backward = a training step minus its forward; implementations interleaved over rotating
rounds), the expert FLOPs' rate, saved activations, and for moekit the share of one profiled step
that is glue (every kernel but the grouped GEMMs). "dense" is one ``torch.matmul`` per expert GEMM of
the same FLOPs: the practical roofline. SonicMoE runs in a child process with a timeout
(``moekit.bench.sonic``); a hang or an error is reported in its row.
"""

from __future__ import annotations

import torch

from ..layers import MoE
from ..testing import rel_errors
from . import CPU_NOTE, MoEShape, environment, interleaved_ms, run_table, step_profile, with_spread
from .baselines import TorchtitanMoE
from .experts import dense_calls, saved_bytes
from .sonic import sonicmoe_block_times

CONFIGS = {
    "plain": dict(bias=False, router_bias=False, activation="swiglu"),
    "gpt-oss": dict(bias=True, router_bias=True, activation="gpt-oss"),
}


def training_step(shape: MoEShape, config: str = "plain", device="cuda", **experts_kw):
    """A seeded ``MoE`` block of ``shape`` in a ``CONFIGS`` configuration (and ``experts_kw``: ``fp8=True``,
    ``nvfp4=True``), bf16 tokens x (T, D) and their output gradient -> (moe, x, step), where ``step()`` runs
    a training step: the forward and the gradients of x and every parameter."""
    torch.manual_seed(0)
    moe = MoE(shape.d, shape.f, shape.e, shape.top_k, device=device, dtype=torch.bfloat16, **CONFIGS[config],
              **experts_kw)
    x = torch.randn(shape.tokens, shape.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *moe.parameters()]

    def step():
        return torch.autograd.grad(moe(x), params, dy)

    return moe, x, step


def _configs(shape: MoEShape) -> list[str]:
    return ["plain", "gpt-oss"] if shape.name.startswith("gpt-oss") else ["plain"]


def _time_config(shape: MoEShape, config: str, device, x, dy) -> dict:
    torch.manual_seed(0)
    moe = MoE(shape.d, shape.f, shape.e, shape.top_k, device=device, dtype=torch.bfloat16, **CONFIGS[config])
    base = TorchtitanMoE(moe)
    params = [x, *moe.parameters()]
    fns = {}
    for name, mod in (("moekit", moe), ("torchtitan", base)):
        fns[name, "fwd"] = lambda mod=mod: mod(x)
        fns[name, "step"] = lambda mod=mod: torch.autograd.grad(mod(x), params, dy)
    if config == "plain":
        fns["dense", "fwd"], fns["dense", "bwd"] = dense_calls(x.detach().repeat(shape.top_k, 1), shape.d,
                                                                shape.f, device)
    ms = interleaved_ms(fns)
    row = {"shape": shape.name, "config": config, "tokens": shape.tokens,
           "flops": 6.0 * shape.tokens * shape.top_k * shape.d * shape.f}
    for name, mod in (("moekit", moe), ("torchtitan", base)):
        fwd = ms[name, "fwd"]
        row[name] = dict(fwd=fwd, bwd=max(ms[name, "step"] - fwd, 1e-6), saved=saved_bytes(lambda mod=mod: mod(x)),
                         spread={"fwd": ms.spread[name, "fwd"], "step": ms.spread[name, "step"]})
    if "dense" in {k[0] for k in ms}:
        row["dense"] = dict(fwd=ms["dense", "fwd"], bwd=ms["dense", "bwd"], saved=None)
    if device == "cuda":
        row["profile"] = step_profile(lambda: torch.autograd.grad(moe(x), params, dy))
    with torch.no_grad():
        row["err"] = rel_errors(moe(x), base(x))[1]
    return row


def run_shape(shape: MoEShape, device, *, sonicmoe: bool = False, sonic_timeout_s: float = 300.0) -> list[dict]:
    sonic = None
    if sonicmoe and device == "cuda":  # before this process holds the shape's memory
        torch.cuda.empty_cache()
        sonic = sonicmoe_block_times(shape.d, shape.f, shape.e, shape.top_k, shape.tokens, timeout_s=sonic_timeout_s)
    torch.manual_seed(1)
    x = torch.randn(shape.tokens, shape.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rows = [_time_config(shape, config, device, x, dy) for config in _configs(shape)]
    if sonic is not None:
        rows[0]["sonicmoe"] = sonic
    return rows


def _step(m: dict) -> float:
    return m["fwd"] + m["bwd"]


def cpu_table(rows) -> str:
    """Without a GPU: the reference's and the baseline's times and their agreement, no speed ratios."""
    out = [environment(), "", CPU_NOTE, "Medians of 3 rounds (their range in brackets).", "",
           "| shape | T | config | impl | fwd ms | fwd+bwd ms | err vs torchtitan |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for impl, label in (("moekit", "moekit (reference)"), ("torchtitan", "torchtitan-style")):
            m = r[impl]
            err = f"{r['err']:.1e}" if impl == "moekit" else ""
            out.append(f"| {r['shape']} | {r['tokens']} | {r['config']} | {label} | "
                       f"{with_spread(m['fwd'], m['spread']['fwd'])} | "
                       f"{with_spread(m['fwd'] + m['bwd'], m['spread']['step'])} | {err} |")
    return "\n".join(out)


def table(rows) -> str:
    if not torch.cuda.is_available():
        return cpu_table(rows)
    out = [
        environment(),
        "",
        "| shape | T | config | impl | fwd ms | bwd ms | fwd+bwd ms | TF/s | saved GiB | glue % | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for impl in ("moekit", "torchtitan", "sonicmoe", "dense"):
            m = r.get(impl)
            if m is None:
                continue
            head = f"| {r['shape']} | {r['tokens']} | {r['config']} | {impl} |"
            if impl == "sonicmoe" and m.get("status") != "ok":
                out.append(f"{head} {m['status']} | | | | | | |")
                continue
            saved = f"{m['saved'] / 2**30:.3f}" if m.get("saved") is not None else "-"
            glue = f"{100 * r['profile']['glue'] / r['profile']['total']:.0f}" if impl == "moekit" else ""
            err = f"{r['err']:.1e}" if impl == "moekit" else ""
            out.append(f"{head} {m['fwd']:.2f} | {m['bwd']:.2f} | {_step(m):.2f} | "
                       f"{3 * r['flops'] / _step(m) / 1e9:.0f} | {saved} | {glue} | {err} |")
    out += ["", "| shape | config | vs torchtitan | vs SonicMoE | of dense TF/s | saved vs SonicMoE | glue % |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = _step(r["moekit"])
        sonic = r.get("sonicmoe")
        sonic_ok = sonic is not None and sonic.get("status") == "ok"
        vs_sonic = f"{_step(sonic) / t:.2f}x" if sonic_ok else (sonic["status"] if sonic else "-")
        saved = f"{r['moekit']['saved'] / sonic['saved']:.3f}" if sonic_ok and sonic["saved"] else "-"
        dense = f"{_step(r['dense']) / t:.2f}" if "dense" in r else "-"
        glue = 100 * r["profile"]["glue"] / r["profile"]["total"]
        out.append(f"| {r['shape']} | {r['config']} | {_step(r['torchtitan']) / t:.2f}x | {vs_sonic} | {dense} | "
                   f"{saved} | {glue:.0f} |")
    out += ["", "Glue kernels of one profiled moekit step (ms):", ""]
    for r in rows:
        top = ", ".join(f"{name[:48]} {ms:.2f}" for name, ms in r["profile"]["top"])
        p = r["profile"]
        out.append(f"- {r['shape']} ({r['config']}): GEMMs {p['gemm']:.2f} of {p['total']:.2f} ms; {top}")
    return "\n".join(out)


def main(shapes, out_md: str | None = None, progress=None, *, sonicmoe: bool = False,
         sonic_timeout_s: float = 300.0) -> str:
    def run(shape, device):
        return run_shape(shape, device, sonicmoe=sonicmoe, sonic_timeout_s=sonic_timeout_s)

    return run_table(run, lambda rows: table([r for rs in rows for r in rs]), shapes, out_md=out_md,
                     progress=progress)
