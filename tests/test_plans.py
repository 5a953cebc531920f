"""Launch plans (``moekit.plans``): recording, refusal and replay with pointers moved, on the CPU with
the launch layer stood in for; and on the GPU, the block step with plans against without, bit for bit."""

import gc
import weakref

import pytest
import torch

import moekit
from moekit import config, launch, plans
from moekit.config import settings
from moekit.descriptors import TensorDescriptor, descriptor
from moekit.plans import plan_counts, planned

_LOG: list = []


def _launch(grid, values):
    """A launch as the launch layer makes it: reported to a recording, then logged with its addresses."""
    if settings.RECORDER is not None:
        settings.RECORDER.launch("compiled", "direct", grid, values)
    _LOG.append(("run", tuple(grid), [_address(v) for v in values]))


def _address(v):
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    if TensorDescriptor is not None and isinstance(v, TensorDescriptor):
        return ("desc", v.base.data_ptr(), tuple(v.shape), tuple(v.block_shape))
    return v


@pytest.fixture
def stand_in(monkeypatch):
    """The launch layer's replay and device stood in for, plans on as on a GPU."""
    monkeypatch.setattr(launch, "run", lambda compiled, grid, values, device, direct: _LOG.append(
        ("replay", tuple(grid), [_address(v) for v in values])))
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "hooked", lambda: False)
    monkeypatch.setattr(config, "is_interpreting", lambda: False)
    _LOG.clear()
    with moekit.options(poison=False):
        yield


@planned
def _shifted(x, k: int):
    out = config.empty((x.shape[0], 8), dtype=x.dtype, device=x.device)
    _launch((x.shape[0], k), [x[:, 1:], out, x.shape[0], k])
    return out[:, :3], None, out


def test_replay_moves_every_pointer_and_rebuilds_the_views(stand_in):
    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    a1, _, o1 = _shifted(x1, 7)
    assert _LOG[-1] == ("run", (5, 7), [x1.data_ptr() + 4, o1.data_ptr(), 5, 7])
    assert plan_counts(_shifted) == (1, 0)
    a2, none, o2 = _shifted(x2, 7)
    assert _LOG[-1] == ("replay", (5, 7), [x2.data_ptr() + 4, o2.data_ptr(), 5, 7])
    assert none is None and o2.data_ptr() != o1.data_ptr() and a2.data_ptr() == o2.data_ptr()
    assert (a2.shape, a2.stride(), o2.shape, o2.stride()) == (a1.shape, a1.stride(), o1.shape, o1.stride())
    _shifted(x2, 8)  # another value: another key, recorded
    assert _LOG[-1][0] == "run" and plan_counts(_shifted) == (2, 0)
    _shifted(x2[1:], 8)  # another shape
    assert _LOG[-1][0] == "run" and plan_counts(_shifted) == (3, 0)
    with moekit.options(plans=False):
        _shifted(x1, 7)
    assert _LOG[-1][0] == "run"


@pytest.mark.skipif(TensorDescriptor is None, reason="needs Triton's host tensor descriptors")
def test_replay_moves_a_descriptors_base(stand_in, monkeypatch):
    monkeypatch.setattr(launch, "DESCRIPTORS", (TensorDescriptor,))

    @planned
    def boxed(x):
        out = config.empty((x.shape[0], 16), dtype=x.dtype, device=x.device)
        _launch((1,), [descriptor(x[2:], [x.shape[0] - 2, 16], [16, 1], [2, 16]), out])
        return out

    x1, x2 = torch.randn(6, 16), torch.randn(6, 16)
    boxed(x1)
    o2 = boxed(x2)
    assert _LOG[-1] == ("replay", (1,), [("desc", x2.data_ptr() + 2 * 16 * 4, (4, 16), (2, 16)), o2.data_ptr()])


_FROM_ELSEWHERE = torch.zeros(8)


@pytest.mark.parametrize("how", ["torch op in place", "tensor from elsewhere", "torch op output", "no launch",
                                 "input written", "shared memory"])
def test_what_cannot_be_replayed_runs_the_launcher_itself(stand_in, how):
    @planned
    def launcher(x, y):
        out = config.empty((8,), dtype=x.dtype, device=x.device)
        if how == "torch op in place":
            out.zero_()
        if how == "input written":
            x.add_(1)
        if how != "no launch":
            _launch((1,), [x, _FROM_ELSEWHERE if how == "tensor from elsewhere" else y, out])
        return x + 1 if how == "torch op output" else out

    base = torch.randn(16)
    x, y = (base[:8], base[8:]) if how == "shared memory" else (torch.randn(8), torch.randn(8))
    for _ in range(3):
        launcher(x, y)
        assert not _LOG or _LOG[-1][0] == "run"
    assert plan_counts(launcher) == (0, 1)


def test_registered_constant_memory_stays_where_it_is(stand_in):
    ones = plans.constant(torch.ones(4))

    @planned
    def with_ones(x):
        out = config.empty((4,), dtype=x.dtype, device=x.device)
        _launch((1,), [x, ones[1:], out])
        return out

    with_ones(torch.randn(4))
    x = torch.randn(4)
    out = with_ones(x)
    assert _LOG[-1] == ("replay", (1,), [x.data_ptr(), ones.data_ptr() + 4, out.data_ptr()])


def test_a_launcher_called_while_another_records_is_recorded_with_it(stand_in):
    @planned
    def outer(x):
        return _shifted(x, 3)[2]

    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    before = plan_counts(_shifted)
    outer(x1)
    assert plan_counts(_shifted) == before and plan_counts(outer) == (1, 0)
    o2 = outer(x2)
    assert _LOG[-1] == ("replay", (5, 3), [x2.data_ptr() + 4, o2.data_ptr(), 5, 3])


def test_a_recording_keeps_no_tensor_alive(stand_in):
    """A recorded call's tensors go when the caller drops them, without a garbage collection: a reference
    cycle through them kept an autograd graph, and its gradient accumulators made on the default stream,
    alive into a later CUDA-graph capture, whose backward then waited on the legacy stream."""
    @planned
    def launcher(x):
        out = config.empty((x.shape[0], 8), dtype=x.dtype, device=x.device)
        _launch((1,), [x, out])
        return out[:, :3], out

    gc.disable()
    try:
        x = torch.randn(5, 4)
        for _ in range(2):  # the recording, then a replay
            views, out = launcher(x)
            alive = weakref.ref(out), weakref.ref(views)
            del views, out
            assert all(r() is None for r in alive)
        assert plan_counts(launcher) == (1, 0)
    finally:
        gc.enable()


def test_plans_stay_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(config, "is_interpreting", lambda: True)
    n = sum(plan_counts(_shifted))
    _shifted(torch.randn(3, 4), 11)
    assert sum(plan_counts(_shifted)) == n
    assert plans.planned  # (the module's public surface)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["plain", "gpt-oss"])
def test_block_steps_with_plans_equal_steps_without(config_name):
    from moekit.bench.moe import CONFIGS
    from moekit.experts import grouped_mm_swiglu_fwd
    from moekit.grouped_gemm import ragged_m
    from moekit.routing import combine_fwd, routing_metadata_fwd

    torch.manual_seed(0)
    moe = moekit.MoE(256, 128, 16, 4, device="cuda", dtype=torch.bfloat16, **CONFIGS[config_name])
    params = list(moe.parameters())
    for t in (300, 300, 300, 64, 300):  # replays with new addresses, and a change of T
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        got = {}
        for on in (True, False):
            with moekit.options(plans=on):
                out = moe(x)
                got[on] = (out, *torch.autograd.grad(out, [x, *params], dy))
        for a, b in zip(got[True], got[False], strict=True):
            assert a.stride() == b.stride() and torch.equal(a, b)
    for fn in (ragged_m, grouped_mm_swiglu_fwd, combine_fwd, routing_metadata_fwd):
        assert plan_counts(fn)[0] > 0, fn.__name__
