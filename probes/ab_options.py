"""Paired A/B of the expert MLP step (``GptOssExperts`` forward + backward) under two settings of
moekit's options, in one process: ``python probes/ab_options.py save_h=0 [gpt-oss-20b gpt-oss-120b]``
times the default against the options given. Each
round times both in a rotating order; the table gives each one's median step time, its median ratio
to the default over the rounds' pairs (with the quartiles), and the activations its forward saves.
"""

import sys

import torch

import moekit
from moekit import GptOssExperts
from moekit.bench import SHAPES, environment, paired_ratios
from moekit.bench.experts import _saved_bytes
from moekit.testing import routed_counts

ROUNDS = 10


def _with_options(fn, changes):
    def run():
        with moekit.options(**changes):
            return fn()
    return run


def _compare(name, env):
    s = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    counts = routed_counts(s.tokens, s.e, s.top_k, generator=gen).cuda()
    torch.manual_seed(0)
    ex = GptOssExperts(s.d, s.f, s.e, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(s.tokens * s.top_k, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    grads = {}

    def step(key):
        def run():
            grads[key] = torch.autograd.grad(ex(x, counts), [x, *ex.parameters()], dy)
        return run

    fns = {"default": step("default"), "switched": _with_options(step("switched"), env)}
    saved = {"default": _saved_bytes(lambda: ex(x, counts)),
             "switched": _with_options(lambda: _saved_bytes(lambda: ex(x, counts)), env)()}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(grads["default"], grads["switched"], strict=True))
    cells = [f"{cell} saved {saved[k] / 2**30:.2f} GiB"
             for k, cell in zip(fns, paired_ratios(fns, "default", rounds=ROUNDS, warmup_ms=30, rep_ms=150),
                                strict=True)]
    print(f"{name} {env}: max |grad diff| {diff:.1e} | " + " | ".join(cells), flush=True)


def main(args):
    env = {k: v == "1" for k, v in (a.split("=", 1) for a in args if "=" in a)}
    print(environment())
    for name in [a for a in args if "=" not in a] or ["gpt-oss-20b", "gpt-oss-120b"]:
        _compare(name, env)


if __name__ == "__main__":
    main(sys.argv[1:])
