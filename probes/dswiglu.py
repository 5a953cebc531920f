"""The down-projection's dgrad with the SwiGLU backward: the fused kernel (an epilogue partition,
``_kernels/hopper_dswiglu.py``) against the plain dgrad followed by the pass, in one process.

    python probes/dswiglu.py [shape ...] [--rounds 7] [--no-block] [--configs plain gpt-oss] [--layouts d-f f-d]

Per block shape (the block's routing, row scales as the bias-free block passes them), for plain SwiGLU
and gpt-oss's clamped one, and the down weight stored (E, D, F) as the block stores it or (E, F, D):
paired times of ``grouped_mm_dswiglu`` both ways and whether d_aux and h match bit for bit (the row
scales' gradient to fp32 rounding); then paired times of the block's training step with
``fused_dswiglu`` off and on, per block configuration.
"""

import argparse

import torch

import moekit
from moekit import experts, hopper
from moekit.bench import BLOCK_SHAPES, environment, paired_ratios
from moekit.bench.moe import training_step
from moekit.epilogue import SwiGLU
from moekit.testing import offs_from_counts, routed_counts


def _fused(on, fn, step_rows=4):
    def run():
        hopper.WS_DSWIGLU_STEP_ROWS = step_rows  # the epilogue partition's rows per step (a constexpr)
        with moekit.options(fused_dswiglu=on):
            return fn()
    return run


SPECS = {"plain": SwiGLU(), "gpt-oss": SwiGLU(alpha=1.702, limit=7.0, linear_offset=1.0)}


def kernel_ab(shape, spec_name, layout, rounds):
    gen = torch.Generator().manual_seed(0)
    counts = routed_counts(shape.tokens, shape.e, shape.top_k, generator=gen)
    offs = offs_from_counts(counts.tolist(), device="cuda")
    m = shape.tokens * shape.top_k
    torch.manual_seed(0)
    grad = torch.randn(m, shape.d, device="cuda", dtype=torch.bfloat16)
    aux = (torch.randn(m, 2 * shape.f, device="cuda") * 2).to(torch.bfloat16)
    # stored as the block stores it, (E, D, F) (the weight's N-major layout for the dgrad), unless "f-d"
    w = (torch.randn(shape.e, shape.d, shape.f, device="cuda") / shape.d**0.5).to(torch.bfloat16).mT
    if layout == "f-d":
        w = w.contiguous()
    scale = torch.rand(m, device="cuda")
    spec = SPECS[spec_name]
    outs = {}

    def call(key):
        def run():
            outs[key] = experts.grouped_mm_dswiglu(grad, w, offs, aux, spec, scale=scale)
        return run

    fns = {"dgrad + pass": _fused(False, call("base")), "fused": _fused(True, call("fused")),
           "fused, 8-row steps": _fused(True, call("fused8"), step_rows=8)}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for key in ("fused", "fused8")
               for a, b in zip(outs["base"][:2], outs[key][:2], strict=True))
    ds = max((outs["base"][2] - outs[key][2]).abs().max().item() for key in ("fused", "fused8"))
    cells = paired_ratios(fns, "dgrad + pass", rounds=rounds, warmup_ms=30, rep_ms=100)
    print(f"| {shape.name} | kernel, {spec_name} SwiGLU, w {layout} | {' | '.join(cells)} | "
          f"d_aux, h bit-equal: {same}; max |d_scale diff| {ds:.1e} |", flush=True)


def block_ab(shape, config, rounds):
    _, _, step = training_step(shape, config)
    grads = {}

    def keep(key):
        def run():
            grads[key] = step()
        return run

    fns = {"default": _fused(False, keep("base")), "fused_dswiglu": _fused(True, keep("fused"))}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["base"], grads["fused"], strict=True))
    cells = paired_ratios(fns, "default", rounds=rounds, warmup_ms=30, rep_ms=150)
    print(f"| {shape.name} | block step, {config} | {' | '.join(cells)} | | max |grad diff| {diff:.1e} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=list(BLOCK_SHAPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-block", action="store_true")
    p.add_argument("--configs", nargs="*", default=["plain"], help="block configurations (and SwiGLUs) to time")
    p.add_argument("--layouts", nargs="*", default=["d-f"], choices=["d-f", "f-d"],
                   help="the down weight stored (E, D, F) as the block stores it, or (E, F, D)")
    a = p.parse_args()
    print(environment())
    print("| shape | what | base ms | fused ms, ratio [quartiles] | (kernel: fused with 8-row steps) | check |\n"
          "|---|---|---|---|---|---|")
    for name in a.shapes:
        for config in a.configs:
            for layout in a.layouts:
                kernel_ab(BLOCK_SHAPES[name], config, layout, a.rounds)
            if not a.no_block:
                block_ab(BLOCK_SHAPES[name], config, a.rounds)


if __name__ == "__main__":
    main()
