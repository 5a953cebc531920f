"""MoE-block benchmark: moekit.MoE against the torchtitan-style block of BENCH.md, and SonicMoE's
block when it can be imported.

Times forward and forward+backward (backward = the difference; implementations interleaved over
rotating rounds) of the whole block (router, dispatch,
experts, combine) and measures saved activations (memory after the forward, minus before, minus the
output), for the gpt-oss shapes at T tokens. SonicMoE runs its own configuration (plain SwiGLU, no
biases; ``baselines.sonicmoe_block``), so its row is a speed reference, not the same computation.
"""

from __future__ import annotations

import torch

from ..layers import MoE
from ..testing import rel_errors
from . import MoEShape, environment, interleaved_ms, run_table
from .baselines import TorchtitanMoE, sonicmoe_block
from .experts import _saved_bytes


def run_shape(shape: MoEShape, device) -> dict:
    torch.manual_seed(0)
    moe = MoE(shape.d, shape.f, shape.e, shape.top_k, device=device, dtype=torch.bfloat16)
    base = TorchtitanMoE(moe)
    x = torch.randn(shape.tokens, shape.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *moe.parameters()]
    row = {"shape": shape.name, "flops": 6.0 * shape.tokens * shape.top_k * shape.d * shape.f}
    impls = [("moekit", moe, params), ("torchtitan", base, params)]
    sonic = sonicmoe_block(shape.d, shape.f, shape.e, shape.top_k, device)
    if sonic is not None:
        impls.append(("sonicmoe", sonic, [x, *sonic.parameters()]))
        torch.autograd.grad(sonic(x), impls[-1][2], dy)  # its first call per shape autotunes
    fns = {}
    for name, mod, ps in impls:
        fns[name, "fwd"] = lambda mod=mod: mod(x)
        fns[name, "step"] = lambda mod=mod, ps=ps: torch.autograd.grad(mod(x), ps, dy)
    ms = interleaved_ms(fns)  # rounds with a rotating order: drift weighs on every implementation alike
    for name, mod, _ in impls:
        fwd_ms, saved = ms[name, "fwd"], _saved_bytes(lambda mod=mod: mod(x))
        row[name] = dict(fwd=fwd_ms, bwd=max(ms[name, "step"] - fwd_ms, 1e-6), saved=saved)
    with torch.no_grad():
        row["err"] = rel_errors(moe(x), base(x))[1]
    return row


def table(rows) -> str:
    out = [
        environment(),
        "",
        "| shape | impl | fwd ms | bwd ms | fwd+bwd ms | expert TF/s fwd | saved GiB | speedup fwd+bwd | saved ratio"
        " | err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base_total = r["torchtitan"]["fwd"] + r["torchtitan"]["bwd"]
        for impl in ("moekit", "torchtitan", "sonicmoe"):
            if impl not in r:
                continue
            m = r[impl]
            total = m["fwd"] + m["bwd"]
            ratio = m["saved"] / r["torchtitan"]["saved"] if r["torchtitan"]["saved"] else float("nan")
            err = f"{r['err']:.1e}" if impl == "moekit" else ""
            out.append(
                f"| {r['shape']} | {impl} | {m['fwd']:.2f} | {m['bwd']:.2f} | {total:.2f} | "
                f"{r['flops'] / m['fwd'] / 1e9:.0f} | {m['saved'] / 2**30:.2f} | {base_total / total:.2f}x | "
                f"{ratio:.2f} | {err} |"
            )
    sonic = [r for r in rows if "sonicmoe" in r]
    if sonic:
        out += ["", "| shape | moekit vs SonicMoE, fwd+bwd (SonicMoE: plain SwiGLU, no biases) |", "|---|---|"]
        for r in sonic:
            total = {i: r[i]["fwd"] + r[i]["bwd"] for i in ("moekit", "sonicmoe")}
            out.append(f"| {r['shape']} | {total['sonicmoe'] / total['moekit']:.2f}x |")
    return "\n".join(out)


def main(shapes, out_md: str | None = None, progress=None) -> str:
    return run_table(run_shape, table, shapes, out_md=out_md, progress=progress)
