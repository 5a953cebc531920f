"""Train a tiny gpt-oss-like MoE language model on the Python standard library's own sources.

Byte-level tokens, pre-norm transformer blocks (causal attention + moekit.MoE), AdamW. The model
trains once through moekit's kernels and once, from the same initial weights and batches, through
the pure-PyTorch reference ops. The script checks that the loss falls and that the two loss curves
agree within bf16 noise. On a machine without a GPU, both runs take the reference path unless
TRITON_INTERPRET=1, which runs the kernels (slowly) on the CPU.

With ``--nvfp4`` the second run instead trains the experts through NVFP4 GEMMs
(``moekit.MoE(..., nvfp4=TrainingRecipe(...))``: NVIDIA's recipe, emulated), from the same initial
weights and batches as the bf16 run, and the script checks that its final loss is within 2% of the
bf16 run's; ``--plot PATH`` draws both loss curves.

    python examples/train_tiny_moe.py [--steps 300] [--layers 2] [--dim 128] [--experts 8] [--top-k 2]
    python examples/train_tiny_moe.py --nvfp4 [--plot curves.png]
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

import moekit


def corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's .py files, concatenated, as byte tokens (the corpus any Python has)."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as fh:
            data += fh.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, dim, heads, hidden, experts, top_k, nvfp4=None, **kw):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim, **kw), nn.RMSNorm(dim, **kw)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, **kw)
        self.proj = nn.Linear(dim, dim, bias=False, **kw)
        self.moe = moekit.MoE(dim, hidden, experts, top_k, nvfp4=nvfp4, **kw)

    def forward(self, x):  # x (B, S, D)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(att)
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, layers, dim, heads, hidden, experts, top_k, nvfp4=False, **kw):
        super().__init__()
        self.embed = nn.Embedding(256, dim, **kw)
        # explicit seeds: a recipe without one would draw it from torch's generator and move the init
        recipes = [moekit.nvfp4.TrainingRecipe(seed=1000 + i) if nvfp4 else None for i in range(layers)]
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, experts, top_k, recipes[i], **kw) for i in range(layers))
        self.norm = nn.RMSNorm(dim, **kw)
        self.head = nn.Linear(dim, 256, bias=False, **kw)

    def forward(self, tokens):  # (B, S) -> logits (B, S, 256)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(args, data, device, *, reference: bool, nvfp4: bool = False) -> list[float]:
    previous = moekit.set_options(reference=reference)
    torch.manual_seed(0)
    kw = dict(device=device, dtype=torch.bfloat16)
    model = TinyMoELM(args.layers, args.dim, args.heads, args.hidden, args.experts, args.top_k, nvfp4, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[i : i + args.seq + 1] for i in starts.tolist()]).to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a host read per step is fine in a training script
    moekit.set_options(**vars(previous))
    return losses


def smooth(xs, n=20):
    return [sum(xs[max(0, i - n + 1) : i + 1]) / len(xs[max(0, i - n + 1) : i + 1]) for i in range(len(xs))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = torch.cuda.is_available()
    parser.add_argument("--steps", type=int, default=300 if on_gpu else 60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nvfp4", action="store_true", help="compare bf16 experts with NVFP4 experts")
    parser.add_argument("--plot", default=None, help="with --nvfp4: write the two loss curves to this image")
    args = parser.parse_args(argv)
    device = "cuda" if on_gpu else "cpu"
    data = corpus(4_000_000)
    print(f"corpus: {data.numel():,} bytes of the standard library; device {device}")
    runs = {}
    configs = ((("bf16", False, False), ("nvfp4", False, True)) if args.nvfp4
               else (("moekit", False, False), ("reference", True, False)))
    for name, reference, nvfp4 in configs:
        t0 = time.perf_counter()
        runs[name] = train(args, data, device, reference=reference, nvfp4=nvfp4)
        print(f"{name:>9}: loss {runs[name][0]:.3f} -> {smooth(runs[name])[-1]:.3f} "
              f"({args.steps} steps, {time.perf_counter() - t0:.1f} s)")
    if args.nvfp4:
        return compare_nvfp4(args, runs)
    a, b = smooth(runs["moekit"]), smooth(runs["reference"])
    gap = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"largest gap between the smoothed curves: {gap:.3f} nats")
    assert a[-1] < 0.7 * runs["moekit"][0], "the loss did not fall"
    assert gap < 0.15, "moekit's loss curve left the reference's by more than bf16 noise"
    print("ok: the loss fell and the two paths agree")


def compare_nvfp4(args, runs) -> None:
    """Final losses (the mean of the last 20 steps) of the bf16 and NVFP4 runs; within 2%, or it fails."""
    a, b = smooth(runs["bf16"]), smooth(runs["nvfp4"])
    gap = (b[-1] - a[-1]) / a[-1]
    print(f"final loss (mean of the last 20 steps): bf16 {a[-1]:.4f}, nvfp4 {b[-1]:.4f} ({100 * gap:+.2f}%)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, dax) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1.4))
        for name, color, style in (("bf16", "C0", "-"), ("nvfp4", "C3", "--")):
            ax.plot(runs[name], color=color, alpha=0.2, lw=0.8)
            ax.plot(smooth(runs[name]), color=color, ls=style, label=f"{name} (final {smooth(runs[name])[-1]:.3f})")
        ax.set(ylabel="loss (nats per byte)", title="tiny MoE LM: bf16 vs NVFP4 experts, same init and batches")
        ax.legend()
        dax.plot([100 * (y - x) / x for x, y in zip(a, b, strict=True)], color="k", lw=1)
        dax.axhline(0, color="0.6", lw=0.8)
        dax.set(xlabel="step", ylabel="nvfp4 vs bf16 (%)\n20-step means")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    assert a[-1] < 0.7 * runs["bf16"][0], "the loss did not fall"
    assert abs(gap) <= 0.02, f"the NVFP4 run's final loss is {100 * gap:+.2f}% off the bf16 run's"
    print("ok: the NVFP4 run's final loss is within 2% of the bf16 run's")


if __name__ == "__main__":
    main()
