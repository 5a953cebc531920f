"""``python -m moekit bench | info``.

bench: on a GPU, (1) the MoE block on seven real models' shapes against the torchtitan-style block,
a dense matmul of the same FLOPs and, with ``--sonicmoe``, SonicMoE; (1b) the block's token-count sweep
(T = 1k-16k: eager, host, CUDA-graph and torch.compile steps against the torchtitan-style block's eager
step, ``bench/sweep.py``); (2) the fused gpt-oss expert MLP
against the torchtitan-style experts; (3) the grouped GEMM against torch._grouped_mm and a dense
matmul; and with ``--only precision`` (not in the default run), the block's step with bf16, FP8 and NVFP4
experts (``bench/precision.py``). On a CPU, the same tables for a small configuration through the
pure-PyTorch reference, without speed ratios. Prints the tables and writes them, with plots, to
``--out`` (default bench/out).
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


EXPERT_SHAPES = ("gpt-oss-20b", "gpt-oss-120b")  # the expert-MLP table's shapes


def _bench(args) -> None:
    if args.ep_model:
        from .bench import ep_model

        print(ep_model.main(tokens=args.tokens, link=args.link, link_gbs=args.link_gbs, link_us=args.link_us,
                            tflops=args.tflops))
        return
    from .bench import BLOCK_SHAPES, CPU_SHAPES, SHAPES
    from .bench import experts as bench_experts
    from .bench import grouped_mm as bench_grouped_mm
    from .bench import moe as bench_moe

    on_gpu = torch.cuda.is_available()
    known = {**SHAPES, **BLOCK_SHAPES} if on_gpu else {**SHAPES, **BLOCK_SHAPES, **CPU_SHAPES}
    unknown = [n for n in args.shape or [] if n not in known]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; choose from {sorted(known)}")

    def pick(table: dict, default) -> list:
        """The shapes of one table: --shape's (taken from this table where it has them), else the default."""
        if not on_gpu and not args.shape:
            shapes = list(CPU_SHAPES.values())
            return [dataclasses.replace(s, tokens=args.tokens) for s in shapes] if args.tokens else shapes
        names = args.shape or default
        shapes = [table.get(n, known[n]) for n in names]
        return [dataclasses.replace(s, tokens=args.tokens) for s in shapes] if args.tokens else shapes

    print(f"moekit bench: {_path()}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.only in (None, "moe"):
        md = os.path.join(args.out, "moe.md")
        text = bench_moe.main(pick(BLOCK_SHAPES, list(BLOCK_SHAPES)), out_md=md, progress=_progress("moe"),
                              sonicmoe=args.sonicmoe, sonic_timeout_s=args.sonic_timeout)
        print(text, "\n")
        written.append(md)
    if args.only in (None, "experts"):
        md = os.path.join(args.out, "experts.md")
        print(bench_experts.main(pick(SHAPES, EXPERT_SHAPES), out_md=md, progress=_progress("experts")), "\n")
        written.append(md)
    if on_gpu and args.only is None:
        from .bench.plots import plot

        png = os.path.join(args.out, "moe.png")
        try:
            plot({"MoE block": written[0], "expert MLP": written[1]}, png)
            written.append(png)
        except ImportError:
            pass
    if on_gpu and args.only in (None, "sweep"):
        from .bench import sweep

        md, png = os.path.join(args.out, "sweep.md"), os.path.join(args.out, "sweep.png")
        tokens = [int(t) for t in args.sweep_tokens.split(",")] if args.sweep_tokens else sweep.TOKENS
        modes = () if args.no_compile else ("default", "reduce-overhead") if args.reduce_overhead else ("default",)
        print(sweep.main(pick(BLOCK_SHAPES, list(BLOCK_SHAPES)), tokens, compile_modes=modes, out_md=md, out_png=png,
                         progress=_progress("sweep")), "\n")
        written += [md] + ([png] if os.path.exists(png) else [])
    if args.only == "precision":
        from .bench import precision

        md = os.path.join(args.out, "precision.md")
        print(precision.main(pick(BLOCK_SHAPES, list(BLOCK_SHAPES)), out_md=md, progress=_progress("precision")))
        written.append(md)
    if args.only in (None, "grouped_mm"):
        md = os.path.join(args.out, "grouped_mm.md")
        png = os.path.join(args.out, "grouped_mm.png")
        text = bench_grouped_mm.main(pick(SHAPES, list(SHAPES)), out_md=md, out_png=png,
                                     progress=_progress("grouped_mm"))
        print(text)
        written += [md] + ([png] if os.path.exists(png) else [])
    print(f"\nwrote {', '.join(written)}", file=sys.stderr)


def _info(_args) -> None:
    import triton

    from . import __version__

    print(f"moekit {__version__} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"options: {config.get_options()}")
    print(f"path: {_path()}")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        print(f"GPU: {torch.cuda.get_device_name()} | SMs {config.num_sms(dev)} | TMA {config.use_tma(dev)} | "
              f"warp-specialized Gluon kernels {config.use_warp_specialized(dev)}")


def _path() -> str:
    """Which implementation ops on this machine's default device run, in words."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not config.uses_triton(device):
        why = "the reference option is on" if config.get_options().reference else "no GPU, TRITON_INTERPRET unset"
        return f"the pure-PyTorch reference ({why})"
    if device.type == "cpu":
        return "the Triton kernels on Triton's CPU interpreter (TRITON_INTERPRET=1): correct, and slow"
    if config.use_warp_specialized(device):
        return "the Triton kernels, and the warp-specialized Gluon kernels for the bf16 GEMMs they cover"
    return "the Triton kernels"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="moekit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="time moekit against its baselines and print a table")
    bench.add_argument("--shape", action="append", help="a shape name (repeatable); default: each table's own")
    bench.add_argument("--tokens", type=int, help="tokens per rank T (default: each shape's own)")
    bench.add_argument("--out", default=os.path.join("bench", "out"),
                       help="folder for the tables (and, on a GPU, their plots)")
    bench.add_argument("--only", choices=["moe", "sweep", "experts", "grouped_mm", "precision"],
                       help="run one of the tables (precision: bf16, FP8 and NVFP4 experts; only when named)")
    bench.add_argument("--sweep-tokens", help="the token-count sweep's T values, comma-separated "
                       "(default 1024,2048,4096,8192,16384; GPU only)")
    bench.add_argument("--no-compile", action="store_true",
                       help="leave torch.compile out of the token-count sweep")
    bench.add_argument("--reduce-overhead", action="store_true",
                       help="also time torch.compile's reduce-overhead mode in the sweep (off: beside the sweep's hand "
                       "capture it faulted at mixtral-8x7b and olmoe-1b-7b, T = 4096, on an H200; an open defect)")
    bench.add_argument("--sonicmoe", action="store_true",
                       help="also time SonicMoE's block (in a child process per shape; needs the sonic-moe package)")
    bench.add_argument("--sonic-timeout", type=float, default=300.0, help="seconds per SonicMoE shape (default 300)")
    ep = bench.add_argument_group("expert-parallel cost model (--ep-model: prints a model, runs nothing)")
    ep.add_argument("--ep-model", action="store_true",
                    help="print the all-to-all vs expert-GEMM cost model at EP 2, 4, 8 for the block shapes")
    ep.add_argument("--link", action="append", choices=["nvlink4", "ib-400g"],
                    help="a link preset (repeatable; default both: NVLink 4 450 GB/s 5 us, IB 50 GB/s 10 us)")
    ep.add_argument("--link-gbs", type=float, help="a custom link's bandwidth, GB/s per direction")
    ep.add_argument("--link-us", type=float, default=5.0, help="the custom link's latency per all-to-all, us")
    ep.add_argument("--tflops", type=float, default=600.0, help="sustained expert-GEMM TF/s (default 600)")
    bench.set_defaults(fn=_bench)
    info = sub.add_parser("info", help="versions and the device path moekit will take")
    info.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
