"""The benchmark's plumbing on CPU: the SonicMoE child-process runner (result, timeout, error) and the
CPU tables, which carry no speed ratios."""

import sys

import pytest
import torch

import moekit
from moekit.bench import CPU_SHAPES, sonic
from moekit.bench import moe as bench_moe


def _child(code: str, timeout_s: float = 20.0) -> dict:
    return sonic._run_child([sys.executable, "-c", code], timeout_s)


def test_sonic_child_result_timeout_and_error():
    ok = _child(f"print('noise'); print({sonic.MARKER!r} + '{{\"status\": \"ok\", \"fwd\": 1.5}}')")
    assert ok == {"status": "ok", "fwd": 1.5}
    hung = _child("import sys, time; print('compiling | kernel 3', file=sys.stderr, flush=True); time.sleep(60)", 1)
    assert hung["status"] == "timeout after 1 s (its last line: compiling / kernel 3)"
    assert _child("import time; time.sleep(60)", 1)["status"] == "timeout after 1 s (it printed nothing)"
    failed = _child("raise ValueError('bad shape')")
    assert failed["status"].startswith("error: ValueError: bad shape")
    assert _child("print('no result line')")["status"] == "error: exit code 0, no result line"


def test_cpu_block_table_has_no_ratios(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("describes a CPU-only machine")
    with moekit.options(reference=True):  # the CPU bench's path without TRITON_INTERPRET
        text = bench_moe.main(list(CPU_SHAPES.values()), out_md=str(tmp_path / "moe.md"))
    assert "CPU: moekit runs its pure-PyTorch reference" in text and "moekit (reference)" in text
    assert "nan" not in text and "TF/s" not in text and "x |" not in text
    assert (tmp_path / "moe.md").read_text().strip() == text.strip()


def test_sweep_table_and_plot_from_rows(tmp_path):
    """The token-count sweep's table and plot from rows shaped as ``run_shape`` returns them (the
    timings themselves need a GPU): every column, and the ratios against the torchtitan-style block."""
    pytest.importorskip("matplotlib")
    from moekit.bench import sweep

    names = ["moekit", "torchtitan", "graphed", "compiled:default", "compiled:reduce-overhead"]
    rows = [{"shape": "qwen3-30b-a3b", "tokens": t, "ms": dict(zip(names, [4.0, 6.0, 1.5, 4.2, 1.6], strict=True)),
             "host": dict(zip(names, [4.1, 5.0, 0.4, 4.3, 0.9], strict=True)), "graph": 1.4} for t in (1024, 4096)]
    text = sweep.table(rows)
    head = text.splitlines()[2]
    assert "moekit.graphed ms (host)" in head and "graphed vs torchtitan" in head and "reduce-overhead ms" in head
    line = text.splitlines()[4]
    assert "| 1.50 (0.40) |" in line and "| 4.00x |" in line and "| 1.50x |" in line
    sweep.plot(rows, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_balanced_offs():
    from moekit.bench import balanced_offs

    offs = balanced_offs(1000, 3, "cpu")
    assert offs.dtype == torch.int32 and offs.tolist() == [333, 667, 1000]
    assert balanced_offs(7, 7, "cpu").tolist() == list(range(1, 8))


def test_precision_table_on_the_reference(tmp_path):
    """``--only precision``: bf16, FP8 and NVFP4 experts on one block's weights and tokens, each output
    against bf16's (on a CPU: the reference path, no ratios, no memory)."""
    if torch.cuda.is_available():
        pytest.skip("describes a CPU-only machine")
    from moekit.bench import MoEShape, precision

    with moekit.options(reference=True):
        row = precision.run_shape(MoEShape("tiny", 128, 64, 4, 2, tokens=64), "cpu")
    assert row["bf16"]["err"] == 0 and 0 < row["fp8"]["err"] < 0.15 and 0 < row["nvfp4"]["err"] < 0.4
    text = precision.table([row])
    assert all(f"| tiny | 64 | {p} |" in text for p in precision.PRECISIONS) and "x |" not in text
