"""The README's Python examples run as written: each block, in order, after a prelude that makes the
inputs its comments describe (small sizes; on the CPU suite the kernels run under the interpreter)."""

import re
import types
from pathlib import Path

import pytest
import torch

import moekit

README = Path(__file__).resolve().parents[1] / "README.md"
E, M, K, N, D, F, T, TOP_K = 4, 48, 32, 16, 32, 16, 24, 2


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _gemm_inputs():
    bf = dict(dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 30, 41], dtype=torch.int32)
    return dict(
        x=torch.randn(M, K, **bf, requires_grad=True), w=torch.randn(E, N, K, **bf, requires_grad=True), offs=offs,
        dy=torch.randn(M, N, **bf), a3=torch.randn(E, 8, K, **bf), b3=torch.randn(E, K, N, **bf),
        grad=torch.randn(M, N, **bf),
    )


def _expert_inputs():
    bf = dict(dtype=torch.bfloat16)
    return dict(
        x=torch.randn(M, D, **bf, requires_grad=True), offs=torch.tensor([10, 10, 30, 41], dtype=torch.int32),
        w_up=torch.randn(E, D, 2 * F, **bf, requires_grad=True), b_up=torch.randn(E, 2 * F, **bf),
        w_down=torch.randn(E, F, D, **bf, requires_grad=True), b_down=torch.randn(E, D, **bf),
        grad=torch.randn(M, D, **bf), pre=torch.randn(M, 2 * F, **bf),
    )


def _layer_inputs():
    bf = dict(dtype=torch.bfloat16)
    counts = torch.tensor([3, 0, 5, 4])
    r = moekit.topk_router(torch.randn(T, D, **bf), torch.randn(E, D), None, top_k=TOP_K)
    return dict(
        dim=D, hidden_dim=F, num_experts=E, top_k=TOP_K, x=torch.randn(T, D, **bf),
        x_RD=torch.randn(int(counts.sum()), D, **bf), num_tokens_per_expert_E=counts,
        w_gate=torch.randn(E, D), b_gate=torch.randn(E), expert_out=torch.randn(r.row_of.numel(), D, **bf),
    )


def _nvfp4_inputs():  # K = F = 64: packed weights take K in multiples of 64
    bf = dict(dtype=torch.bfloat16)
    offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
    return dict(
        x=torch.randn(64, 64, **bf), offs=offs, w=torch.randn(E, 64, 64, **bf), w_up=torch.randn(E, 64, 128, **bf),
        g_h=torch.tensor(1.0), dy=torch.randn(64, 64, **bf), signs=torch.ones(16),
        dim=D, hidden_dim=F, num_experts=E, top_k=TOP_K,
    )


def _fp8_inputs():
    return dict(x=torch.randn(M, K, dtype=torch.bfloat16), w=torch.randn(E, 200, K, dtype=torch.bfloat16),
                dy=torch.randn(M, 200, dtype=torch.bfloat16), offs=torch.tensor([10, 10, 30, 41], dtype=torch.int32),
                dim=D, hidden_dim=F, num_experts=E, top_k=TOP_K,
                micro_batches=[torch.randn(9, D, dtype=torch.bfloat16) for _ in range(2)],
                opt=types.SimpleNamespace(step=lambda: None))


# block -> its prelude, or why it does not run here (one line each)
PRELUDES = {
    0: _gemm_inputs,
    1: _expert_inputs,
    2: _layer_inputs,
    3: _nvfp4_inputs,
    4: _fp8_inputs,
    5: "a torch.distributed process group over NCCL",
    6: "a transformers checkpoint to load",
    7: dict,
    8: "torch.compile's reduce-overhead mode on a GPU (tests/test_graphs_gpu.py runs this loop)",
}


def test_the_table_covers_every_block():
    assert len(_blocks()) == len(PRELUDES)


@pytest.mark.parametrize("index", sorted(PRELUDES))
def test_readme_block_runs(index):
    prelude = PRELUDES[index]
    if isinstance(prelude, str):
        pytest.skip(f"README block {index} needs {prelude}")
    torch.manual_seed(0)
    scope = {"torch": torch, "moekit": moekit, **prelude()}
    with moekit.options():  # a block that sets options leaves them as they were
        exec(compile(_blocks()[index], f"README.md block {index}", "exec"), scope)
