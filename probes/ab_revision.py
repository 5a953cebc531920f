"""Paired A/B of the warp-specialized GEMMs (``hopper.ws_gemm``, and ``ragged_k`` for the weight
gradients): an older revision of the package against the working tree, in one process, on the gpt-oss
problems.

Setup (on the machine that builds the working tree, before copying it to the GPU)::

    rm -rf .ab/abtest && mkdir -p .ab/abtest && git archive REV src/moekit | tar -x -C .ab/abtest
    mv .ab/abtest/src/moekit .ab/abtest/moekit_old && rm -r .ab/abtest/src
    find .ab/abtest -name '*.py' | xargs sed -i 's/"moekit::/"moekit_old::/g'  # its own custom-op namespace

and carry ``.ab`` to the GPU machine (it is git-ignored).

Then ``python probes/ab_revision.py gpt-oss-20b:dH gpt-oss-120b:up ...`` (problems: down, dH, dX,
up, and the weight gradients dWdown (with db_down's ones row) and dWup (with db_up where D % 128 == 64)).
Each round times every variant for 30 ms in a rotating order; the table gives each variant's median
time and its median ratio to the old revision over the rounds' pairs, with the quartiles.
Pairs within a round cancel the clock drift that makes unpaired medians of one variant move by 2-5%
between runs (docs/design.md, section 10). Variants beyond ``old`` and ``new`` are module
switches of the working tree, edited into ``VARIANTS`` for the question at hand.
"""

import sys

import torch

sys.path.insert(0, ".ab/abtest")
import moekit_old.grouped_gemm as old  # noqa: E402

import moekit.grouped_gemm as new  # noqa: E402
from moekit._kernels.hopper_modes import Epilogue  # noqa: E402
from moekit.bench import SHAPES, environment, paired_ratios  # noqa: E402
from moekit.epilogue import SwiGLU  # noqa: E402
from moekit.testing import offs_from_counts, routed_counts  # noqa: E402

VARIANTS = {}  # name -> {module attribute of moekit.grouped_gemm: value}, e.g. {"wide": {"_WS_NARROW": 0}}
ROUNDS = 15


def _switched(fn, flags):
    def run():
        saved = {k: getattr(new, k) for k in flags}
        for k, v in flags.items():
            setattr(new, k, v)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                setattr(new, k, v)
    return run


def _problem(name, label):
    s = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    offs = offs_from_counts(routed_counts(s.tokens, s.e, s.top_k, generator=gen), device="cuda")
    m, d, f, e = s.tokens * s.top_k, s.d, s.f, s.e
    torch.manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(bf16)

    if label == "down":  # h @ w_down + b_down, weights (E, D, F) viewed as (E, F, D)
        return offs, randn(m, f), randn(e, d, f, scale=f**-0.5).mT, d, dict(bias=randn(e, d))
    if label == "dH":  # dOut @ w_down^T
        return offs, randn(m, d), randn(e, d, f, scale=d**-0.5), f, {}
    if label == "dX":  # d_aux @ w_up^T
        return offs, randn(m, 2 * f), randn(e, 2 * f, d, scale=f**-0.5), d, {}
    if label == "dWdown":  # [h | 1]^T @ dOut: h with its ones column, as the backward hands it over
        h = randn(m, f + 64)[:, : f + 1]
        h[:, f] = 1
        return offs, h, randn(m, d), None, dict(ones_row=True)
    if label == "dWup":  # x^T @ d_aux
        return offs, randn(m, d), randn(m, 2 * f), None, dict(colsum=True)
    if label == "up":  # x @ w_up + b_up with the SwiGLU epilogue
        return (offs, randn(m, d), randn(e, 2 * f, d, scale=d**-0.5).mT, 2 * f,
                dict(bias=randn(e, 2 * f), epilogue=Epilogue.SWIGLU, spec=SwiGLU()))
    raise ValueError(f"unknown problem {label!r}: down, dH, dX or up")


def main(problems):
    print(environment())
    for problem in problems:
        _compare(*problem.split(":"))


def _compare(name, label):
    offs, a, b, n, kw = _problem(name, label)
    outs = {}

    def call(mod, key):
        if n is None:  # a weight gradient: a is the (Kt, M) operand, transposed as autograd hands it over
            def run():
                ragged_k = getattr(mod, "ragged_k", None) or mod._ragged_k  # older revisions: _ragged_k
                outs[key] = ragged_k(a.mT, b, offs, b.dtype, None, **kw)
            return run
        outs[key] = (torch.empty(a.shape[0], n, device="cuda", dtype=a.dtype),
                     torch.empty(a.shape[0], n // 2, device="cuda", dtype=a.dtype))
        c, h = outs[key]
        extra = dict(out2=h) if kw.get("epilogue") == Epilogue.SWIGLU else {}
        return lambda: mod.ws_gemm(a, b, offs, c, **kw, **extra)

    fns = {"old": call(old, "old"), "new": call(new, "new")}
    fns.update({v: _switched(call(new, v), flags) for v, flags in VARIANTS.items()})
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    diff = max((c.float() - outs["old"][0].float()).abs().max().item() for c, _ in outs.values())
    if n is None or kw.get("epilogue") == Epilogue.SWIGLU:  # also the column sums, or h
        diff = max([diff] + [(s.float() - outs["old"][1].float()).abs().max().item()
                             for _, s in outs.values() if s is not None])
    cells = paired_ratios(fns, "old", rounds=ROUNDS)
    print(f"{name} {label}: max |new - old| {diff:.1e} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
