"""``python -m moekit bench | info``.

bench: on a GPU, (1) the gpt-oss-20b MoE block against the torchtitan-style block, (2) the fused
expert MLP (GptOssExperts) against the torchtitan-style experts at the gpt-oss shapes, (3) the
grouped GEMM against torch._grouped_mm and a dense matmul for all the BENCH.md shapes. On a CPU, the
same tables for a small configuration through the pure-PyTorch reference. Prints the tables and
writes them, with a PNG plot, to ``--out`` (default bench/out).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from . import config


def _progress(desc: str):
    try:
        from tqdm import tqdm

        return lambda it: tqdm(it, desc=desc, unit="problem", file=sys.stderr)
    except ImportError:
        return None


EXPERT_SHAPES = ("gpt-oss-20b", "gpt-oss-120b")  # the shapes of the fused expert-MLP criteria


def _bench(args) -> None:
    from .bench import CPU_SHAPES, SHAPES
    from .bench import experts as bench_experts
    from .bench import grouped_mm as bench_grouped_mm
    from .bench import moe as bench_moe
    from .config import uses_triton

    on_gpu = torch.cuda.is_available()
    known = SHAPES if on_gpu else {**SHAPES, **CPU_SHAPES}
    names = args.shape or (list(SHAPES) if on_gpu else list(CPU_SHAPES))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; choose from {sorted(known)}")
    shapes = [known[n] for n in names]
    if args.tokens:
        shapes = [dataclasses.replace(s, tokens=args.tokens) for s in shapes]
    device = torch.device("cuda" if on_gpu else "cpu")
    path = "pure-PyTorch reference"
    if uses_triton(device):
        path = "Triton and Gluon kernels" if config.use_warp_specialized(device) else "Triton kernels"
    os.makedirs(args.out, exist_ok=True)
    written = []
    block_shapes = [s for s in shapes if s.name == "gpt-oss-20b" or not on_gpu] if not args.shape else shapes
    if args.only in (None, "moe"):
        print(f"moekit bench: MoE block through the {path}", file=sys.stderr)
        md = os.path.join(args.out, "moe.md")
        print(bench_moe.main(block_shapes, out_md=md, progress=_progress("moe")), "\n")
        written.append(md)
    if args.only in (None, "experts"):
        print(f"moekit bench: expert MLP through the {path}", file=sys.stderr)
        expert_shapes = [s for s in shapes if s.name in EXPERT_SHAPES or not on_gpu] if not args.shape else shapes
        md = os.path.join(args.out, "experts.md")
        print(bench_experts.main(expert_shapes, out_md=md, progress=_progress("experts")), "\n")
        written.append(md)
    moe_md, experts_md = os.path.join(args.out, "moe.md"), os.path.join(args.out, "experts.md")
    if on_gpu and args.only is None:
        from .bench.plots import plot

        png = os.path.join(args.out, "moe.png")
        try:
            plot({"MoE block": moe_md, "expert MLP": experts_md}, png)
            written.append(png)
        except ImportError:
            pass
    if args.only in (None, "grouped_mm"):
        print(f"moekit bench: grouped_mm through the {path}", file=sys.stderr)
        md = os.path.join(args.out, "grouped_mm.md")
        png = os.path.join(args.out, "grouped_mm.png")
        print(bench_grouped_mm.main(shapes, out_md=md, out_png=png, progress=_progress("grouped_mm")))
        written += [md] + ([png] if os.path.exists(png) else [])
    print(f"\nwrote {', '.join(written)}", file=sys.stderr)


def _info(_args) -> None:
    import triton

    from . import __version__, config

    print(f"moekit {__version__} | torch {torch.__version__} | triton {triton.__version__}")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        print(f"GPU: {torch.cuda.get_device_name()} | SMs {config.num_sms(dev)} | TMA {config.use_tma(dev)}")
    else:
        print("no GPU: ops run the pure-PyTorch reference (TRITON_INTERPRET=1 runs the kernels on CPU)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="moekit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="time moekit against its baselines and print a table")
    bench.add_argument("--shape", action="append", help="a BENCH.md shape name (repeatable); default: all")
    bench.add_argument("--tokens", type=int, help="tokens per rank T (default: the shape's, 24576)")
    bench.add_argument("--out", default=os.path.join("bench", "out"), help="folder for the tables and plot")
    bench.add_argument("--only", choices=["moe", "experts", "grouped_mm"], help="run one of the tables")
    bench.set_defaults(fn=_bench)
    info = sub.add_parser("info", help="versions and the device path moekit will take")
    info.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
