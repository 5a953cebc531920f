"""moekit.graphed off the GPU: what it refuses, and the eager path it keeps (the GPU tests are in
test_graphs_gpu.py)."""

import pytest
import torch

import moekit
from moekit import MoE, nvfp4


def test_graphed_takes_only_moe():
    with pytest.raises(TypeError, match="takes a moekit.MoE"):
        moekit.graphed(torch.nn.Linear(4, 4))


def test_graphed_refuses_stochastic_nvfp4():
    moe = MoE(64, 32, 4, 2, nvfp4=nvfp4.TrainingRecipe(stochastic_rounding=True), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stochastic rounding"):
        moekit.graphed(moe)


def test_graphed_runs_cpu_tensors_eagerly_and_ungraphed_restores():
    torch.manual_seed(0)
    moe = MoE(64, 32, 4, 2, dtype=torch.bfloat16)
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    ref = moe(x)
    assert moekit.graphed(moe) is moe
    torch.testing.assert_close(moe(x), ref, rtol=0, atol=0)
    assert set(moe.state_dict()) == set(MoE(64, 32, 4, 2).state_dict())
    moekit.graphs.ungraphed(moe)
    assert "forward" not in moe.__dict__
