"""The MoE block's training step in each precision of its experts: bf16, FP8 (DeepSeek-V3's blockwise
recipe, ``moekit.fp8``) and NVFP4 (``moekit.nvfp4``), on the block shapes in the plain configuration.

One bf16 block's weights are loaded into each precision's block, and all of them run the same tokens and
output gradient, interleaved over rotating rounds. Per precision: the forward and the training step
(forward, then the gradients of x and every parameter), the step against bf16's, the bytes the forward
leaves allocated for the backward (saved activations, and FP8's and NVFP4's quantized weight copies),
and the output's relative (Frobenius) error against the bf16 block. The router and the routing stay bf16
in every precision, so all of them route alike.
"""

from __future__ import annotations

import torch

from ..layers import MoE
from . import CPU_NOTE, MoEShape, environment, interleaved_ms, run_table, with_spread
from .experts import saved_bytes
from .moe import CONFIGS

PRECISIONS = {"bf16": {}, "fp8": {"fp8": True}, "nvfp4": {"nvfp4": True}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_shape(shape: MoEShape, device) -> dict:
    """{"shape", "tokens", precision: {"fwd", "step", "spread", "saved", "err"}} for one block shape."""
    torch.manual_seed(0)
    blocks = {name: MoE(shape.d, shape.f, shape.e, shape.top_k, device=device, dtype=torch.bfloat16,
                        **CONFIGS["plain"], **kw) for name, kw in PRECISIONS.items()}
    for name, block in blocks.items():
        if name != "bf16":
            block.load_state_dict(blocks["bf16"].state_dict())
    x = torch.randn(shape.tokens, shape.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    fns = {}
    for name, block in blocks.items():
        params = [x, *block.parameters()]
        fns[name, "fwd"] = lambda block=block: block(x)
        fns[name, "step"] = lambda block=block, params=params: torch.autograd.grad(block(x), params, dy)
    ms = interleaved_ms(fns)
    row = {"shape": shape.name, "tokens": shape.tokens}
    with torch.no_grad():
        want = blocks["bf16"](x)
        for name, block in blocks.items():
            row[name] = dict(fwd=ms[name, "fwd"], step=ms[name, "step"],
                             spread={"fwd": ms.spread[name, "fwd"], "step": ms.spread[name, "step"]},
                             err=_rel(block(x), want))
    for name, block in blocks.items():
        row[name]["saved"] = saved_bytes(lambda block=block: block(x))
    return row


def table(rows) -> str:
    gpu = torch.cuda.is_available()
    out = [environment(), ""] + ([] if gpu else [CPU_NOTE, ""])
    out += ["Medians of 3 interleaved rounds (their range in brackets); saved: what the forward leaves allocated "
            "besides its output (activations, and the quantized weight copies of FP8 and NVFP4); error: the output "
            "against the bf16 block's, relative.", "",
            "| shape | T | precision | fwd ms | step ms | step vs bf16 | saved GiB | error |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = r["bf16"]["step"]
        for name in PRECISIONS:
            m = r[name]
            saved = f"{m['saved'] / 2**30:.3f}" if gpu else "-"
            speed = f"{base / m['step']:.2f}x" if gpu else "-"
            out.append(f"| {r['shape']} | {r['tokens']} | {name} | {with_spread(m['fwd'], m['spread']['fwd'])} | "
                       f"{with_spread(m['step'], m['spread']['step'])} | {speed} | {saved} | {m['err']:.1e} |")
    return "\n".join(out)


def main(shapes, out_md: str | None = None, progress=None) -> str:
    return run_table(run_shape, table, shapes, out_md=out_md, progress=progress)


__all__ = ["PRECISIONS", "main", "run_shape", "table"]
