"""Launch plans (``moekit.plans``): recording, refusal and replay with pointers moved, on the CPU with
the launch layer stood in for; and on the GPU, the block step with plans against without, bit for bit."""

import functools
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


def _launch(grid, values, direct=None):
    """A launch as the launch layer makes it: reported to a recording, then logged with its addresses."""
    if settings.recorder() is not None:
        settings.recorder().launch("compiled", direct or _direct, grid, values)
    else:
        settings.note_launch()
    _LOG.append(("run", (*grid, 1, 1)[:3], [_address(v) for v in values]))


class _Direct:
    """The launch layer's direct launch (``launch._Direct``), stood in for: a replay's launch is logged
    with its addresses, each descriptor expanded as ("desc", base address, shape, box), "dims"; ``made``
    counts the encodings."""

    made = 0

    def __init__(self, slots=()):
        self.slots = slots  # (position, metadata) of the descriptor arguments, descending; a kernel's own

    def make(self, d, meta):
        assert meta == "meta" and TensorDescriptor is not None and isinstance(d, TensorDescriptor)
        _Direct.made += 1
        return [("desc", d.base.data_ptr(), tuple(d.shape), tuple(d.block_shape)), "dims"]  # (as Triton: several)

    def launch_expanded(self, g0, g1, g2, stream, args):
        assert stream == "stream"
        _LOG.append(("replay", (g0, g1, g2), [_address(v) for v in args]))


_direct = _Direct()


def _address(v):
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    if TensorDescriptor is not None and isinstance(v, TensorDescriptor):
        return ("desc", v.base.data_ptr(), tuple(v.shape), tuple(v.block_shape))
    return v


@pytest.fixture
def stand_in(monkeypatch):
    """The launch layer's replay and device stood in for, plans on as on a GPU."""
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: "stream")
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
    _shifted(x1, 7)  # first seen: run as written, nothing recorded
    assert _LOG[-1][0] == "run" and plan_counts(_shifted) == (0, 0) and len(_shifted.seen) == 1
    a1, _, o1 = _shifted(x1, 7)  # seen again: recorded
    assert _LOG[-1] == ("run", (5, 7, 1), [x1.data_ptr() + 4, o1.data_ptr(), 5, 7])
    assert plan_counts(_shifted) == (1, 0)
    a2, none, o2 = _shifted(x2, 7)
    assert _LOG[-1] == ("replay", (5, 7, 1), [x2.data_ptr() + 4, o2.data_ptr(), 5, 7])
    assert none is None and o2.data_ptr() != o1.data_ptr() and a2.data_ptr() == o2.data_ptr()
    assert (a2.shape, a2.stride(), o2.shape, o2.stride()) == (a1.shape, a1.stride(), o1.shape, o1.stride())
    for _ in range(2):
        _shifted(x2, 8)  # another value: another key, recorded when seen again
    assert _LOG[-1][0] == "run" and plan_counts(_shifted) == (2, 0)
    for _ in range(2):
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
        _launch((1,), [descriptor(x[2:], [x.shape[0] - 2, 16], [16, 1], [2, 16]), out], _Direct(((0, "meta"),)))
        return out

    x1, x2 = torch.randn(6, 16), torch.randn(6, 16)
    boxed(x1)
    boxed(x1)
    made = _Direct.made
    for _ in range(3):  # encoded once at an address, then reused
        o2 = boxed(x2)
        assert _LOG[-1] == ("replay", (1, 1, 1), [("desc", x2.data_ptr() + 2 * 16 * 4, (4, 16), (2, 16)), "dims",
                                                  o2.data_ptr()])
    assert _Direct.made == made + 1
    boxed(x1)
    assert _LOG[-1][2][0] == ("desc", x1.data_ptr() + 2 * 16 * 4, (4, 16), (2, 16)) and _Direct.made == made + 2


@pytest.mark.skipif(TensorDescriptor is None, reason="needs Triton's host tensor descriptors")
def test_a_descriptor_over_constant_memory_is_expanded_once_where_it_stands(stand_in, monkeypatch):
    """A descriptor over registered constant memory, between moving ones: expanded when the plan is made
    (at its recorded address), the moving ones after it at their shifted positions."""
    monkeypatch.setattr(launch, "DESCRIPTORS", (TensorDescriptor,))
    ones = plans.constant(torch.ones(4, 16))
    direct = _Direct(((3, "meta"), (1, "meta"), (0, "meta")))

    @planned
    def boxed(x):
        out = config.empty((x.shape[0],), dtype=x.dtype, device=x.device)
        box = [x.shape[0], 16], [16, 1], [2, 16]
        _launch((1,), [descriptor(x, *box), descriptor(ones, [4, 16], [16, 1], [2, 16]), out,
                       descriptor(x[2:], [x.shape[0] - 2, 16], [16, 1], [2, 16])], direct)
        return out

    x1, x2 = torch.randn(6, 16), torch.randn(6, 16)
    boxed(x1)
    boxed(x1)
    for _ in range(2):
        out = boxed(x2)
        assert _LOG[-1] == ("replay", (1, 1, 1), [("desc", x2.data_ptr(), (6, 16), (2, 16)), "dims",
                                                  ("desc", ones.data_ptr(), (4, 16), (2, 16)), "dims", out.data_ptr(),
                                                  ("desc", x2.data_ptr() + 2 * 16 * 4, (4, 16), (2, 16)), "dims"])


def test_a_replay_allocates_through_the_public_binding_with_the_recorded_layout(stand_in):
    """Allocations (``aten.empty.memory_format``, ``aten.empty_strided``) replay as ``torch.empty_strided``
    with the recorded sizes, strides, dtype and device (a channels-last and a transposed layout too), not
    through the op overload's generic call."""
    @planned
    def allocating(x):
        a = torch.empty((2, 3, 4, 5), dtype=torch.float16, device=x.device, memory_format=torch.channels_last)
        b = torch.empty_strided((4, 3), (1, 4), dtype=torch.int32, device=x.device)
        c = config.empty((x.shape[0],), dtype=x.dtype, device=x.device)
        _launch((1,), [x, a, b, c])
        return a, b, c

    x = torch.randn(6)
    want = allocating(x)
    for _ in range(2):
        got = allocating(torch.randn(6))
        for g, w in zip(got, want, strict=True):
            assert (g.shape, g.stride(), g.dtype, g.device) == (w.shape, w.stride(), w.dtype, w.device)
    assert _LOG[-1][0] == "replay"
    (plan,) = allocating.plans.values()
    ops = [step[1] for step in plan.steps if step[0] == plans._OP]
    assert len(ops) == 3 and all(op is torch.empty_strided for op in ops)


def _public_cases():
    x, g = torch.randn(5, 6), torch.randn(5, 6)
    y = torch.softmax(x, -1)
    return {
        torch.ops.aten._softmax.default: (x, -1, False),
        torch.ops.aten._softmax_backward_data.default: (g, y, -1, torch.float32),
        torch.ops.aten.add.Tensor: (x, g),
        torch.ops.aten.mul.Tensor: (x, g),
        torch.ops.aten.sigmoid.default: (x,),
        torch.ops.aten.transpose.int: (x, 0, 1),
        torch.ops.aten.t.default: (x,),
        torch.ops.aten.sum.dim_IntList: (x, [0], True),
        torch.ops.aten.mm.default: (x, g.t()),
    }


def test_each_public_binding_a_replay_calls_is_its_op():
    """The bindings that replay ops (``plans._PUBLIC``) give the op overload's values, shape, strides and
    dtype on the schema's positional arguments, and with alpha for add."""
    cases = _public_cases()
    assert set(cases) == set(plans._PUBLIC)
    for op, args in cases.items():
        want, got = op(*args), plans._PUBLIC[op](*args)
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), op
        assert torch.equal(got, want), op
    x, g = torch.randn(4), torch.randn(4)
    assert torch.equal(plans._PUBLIC[torch.ops.aten.add.Tensor](x, g, alpha=3),
                       torch.ops.aten.add.Tensor(x, g, alpha=3))


def test_a_replay_calls_the_common_ops_through_their_public_bindings(stand_in):
    @planned
    def router_like(x, g):
        s = torch.softmax(x, -1)
        ds = torch.ops.aten._softmax_backward_data(g, s, -1, torch.float32)
        out = config.empty((x.shape[1], x.shape[0]), dtype=x.dtype, device=x.device)
        _launch((1,), [s, ds, out])
        return (s + ds).sum(0, keepdim=True), out.mT

    for n in range(4):
        x, g = torch.randn(5, 6), torch.randn(5, 6)
        got, t = router_like(x, g)
        s = torch.softmax(x, -1)
        want = (s + torch.ops.aten._softmax_backward_data(g, s, -1, torch.float32)).sum(0, keepdim=True)
        assert torch.equal(got, want) and t.shape == (5, 6) and t.stride() == (1, 5)
        assert _LOG[-1][0] == ("run" if n < 2 else "replay")
    (plan,) = router_like.plans.values()
    ops = {step[1] for step in plan.steps if step[0] == plans._OP}
    assert {torch._softmax, torch._softmax_backward_data, torch.add, torch.sum, torch.transpose} <= ops


_FROM_ELSEWHERE = torch.zeros(8)


def test_torch_ops_are_replayed_on_the_new_tensors(stand_in):
    @planned
    def launcher(x, y):
        out = config.empty((8,), dtype=x.dtype, device=x.device)
        out.zero_()
        x.add_(1)  # an input written: the replay writes this call's input
        z = torch.cat([x, y])[2:10]  # a list argument, a view
        _launch((1,), [z, out])
        return x + y, out, z

    for n in range(4):
        x, y = torch.randn(8), torch.randn(8)
        x0 = x.clone()
        s, out, z = launcher(x, y)
        assert _LOG[-1][0] == ("run" if n < 2 else "replay")
        assert torch.equal(x, x0 + 1) and torch.equal(s, x0 + 1 + y) and torch.equal(out, torch.zeros(8))
        assert torch.equal(z, torch.cat([x0 + 1, y])[2:10]) and _LOG[-1][2] == [z.data_ptr(), out.data_ptr()]
    assert plan_counts(launcher) == (1, 0)


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.mark.parametrize("how", ["tensor from elsewhere", "no launch", "overlapping inputs", "data-dependent shape",
                                 "launch not direct", "output needs autograd"])
def test_what_cannot_be_replayed_runs_the_function_itself(stand_in, how):
    @planned
    def launcher(x, y):
        out = config.empty((8,), dtype=x.dtype, device=x.device)
        if how == "data-dependent shape":
            out = out[: int((x > 0).nonzero().shape[0] >= 0) * 8]
        if how == "launch not direct" and settings.recorder() is not None:  # (as the launch layer reports it)
            settings.recorder().launch(None, None, (1,), ())
        if how != "no launch":
            _launch((1,), [x, _FROM_ELSEWHERE if how == "tensor from elsewhere" else y, out])
        return _Custom.apply(x) if how == "output needs autograd" else out

    base = torch.randn(16, requires_grad=how == "output needs autograd")
    if how == "overlapping inputs":
        x, y = base[:8], base[4:12]
    else:
        x, y = (torch.randn(8, requires_grad=how == "output needs autograd"), torch.randn(8))
    for _ in range(3):
        launcher(x, y)
        assert not _LOG or _LOG[-1][0] == "run"
    assert plan_counts(launcher) == (0, 1)


@pytest.mark.parametrize("how", ["no_grad inside", "detach returned"])
def test_grad_mode_inside_the_function_is_not_replayed_wrong(stand_in, how):
    """A replay runs every op in the call's grad mode, so a function that switches it inside, or returns a
    ``detach`` (folded into its input on record), is refused."""
    @planned
    def launcher(x):
        out = config.empty((8,), dtype=x.dtype, device=x.device)
        _launch((1,), [x, out])
        if how == "no_grad inside":
            with torch.no_grad():
                return out, x * 3
        return out, x.detach()

    x = torch.randn(8, requires_grad=True)
    with torch.set_grad_enabled(how == "no_grad inside"):
        for _ in range(3):
            _, y = launcher(x)
            assert not y.requires_grad and y.grad_fn is None
    assert plan_counts(launcher) == (0, 1)


def test_a_launch_from_another_thread_during_a_recording_records_again(stand_in):
    """The recorder is the recording thread's: a launch another thread makes meanwhile is not its own, and
    the recording is not kept (it may have missed one of the function's launches); the next call records."""
    import threading

    foreign = [True]

    @planned
    def launcher(x):
        out = config.empty((8,), dtype=x.dtype, device=x.device)
        _launch((1,), [x, out])
        if foreign[0]:
            t = threading.Thread(target=_launch, args=((2,), [5]))
            t.start()
            t.join()
        _launch((3,), [out])
        return out

    x = torch.randn(8)
    launcher(x)
    launcher(x)  # recorded, with a launch from another thread in the middle: not kept
    assert plan_counts(launcher) == (0, 0) and [e[1][0] for e in _LOG[-3:]] == [1, 2, 3]
    foreign[0] = False
    launcher(x)
    assert plan_counts(launcher) == (1, 0)
    _LOG.clear()
    out = launcher(x)
    assert _LOG == [("replay", (1, 1, 1), [x.data_ptr(), out.data_ptr()]), ("replay", (3, 1, 1), [out.data_ptr()])]


def test_a_replay_drops_each_intermediate_after_its_last_use(stand_in):
    """Memory goes where it went in the function: a temporary the first kernel used is gone by the second
    launch, not held to the end of the replay."""
    @planned
    def launcher(x):
        tmp = x * 2  # a temporary: read by the first kernel only
        out = config.empty((8,), dtype=x.dtype, device=x.device)
        _launch((1,), [tmp, out])
        _launch((2,), [out])
        return out

    x = torch.randn(8)
    launcher(x)
    launcher(x)
    (plan,) = launcher.plans.values()
    alive, at_second = [], []

    def watched(*a, op):
        t = op(*a)
        alive.append(weakref.ref(t))
        return t

    class Second:  # the second launch, watched
        def launch_expanded(self, *a):
            at_second.append(alive[-1]() is None)
            return _direct.launch_expanded(*a)

    steps = []
    for step in plan.steps:  # the temporary's op and the second launch, watched
        if step[0] == plans._OP and str(step[9]) == "aten.mul.Tensor":
            step = (step[0], functools.partial(watched, op=step[1]), *step[2:])
        elif step[0] == plans._LAUNCH and step[2][0] == 2:
            step = (step[0], Second(), *step[2:])
        steps.append(step)
    plan.steps = steps
    launcher(x)
    assert len(alive) == 1 and at_second == [True]  # gone before the second launch


def test_a_custom_op_in_a_recording_is_one_direct_call(stand_in):
    """moekit's custom ops see the recorder as no dispatch mode: their implementation runs in the
    recording (its ops and launches recorded once), not the registered op."""
    from moekit.routing import gather_weights_fwd

    calls = []
    op = moekit.dispatch.CustomOp("moekit_test::plans_double", _double_impl(calls))
    op.register_fake(lambda x: torch.empty_like(x))

    @planned
    def launcher(x):
        return op(x)

    assert gather_weights_fwd  # (imported for the op registry's side effects only)
    x1, x2 = torch.randn(8), torch.randn(8)
    launcher(x1)
    o1 = launcher(x1)
    o2 = launcher(x2)
    assert calls == [1, 1] and torch.equal(o1, x1 * 2) and torch.equal(o2, x2 * 2)
    assert [e[0] for e in _LOG] == ["run", "run", "replay"] and _LOG[-1][2] == [x2.data_ptr(), o2.data_ptr()]


def _double_impl(calls):
    def plans_double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out = x * 2
        _launch((1,), [x, out])
        return out
    return plans_double


def test_a_recording_under_autocast_replays_its_ops_as_they_ran():
    """Under autocast the recorded ops are autocast's casts and what ran on them; a replay runs exactly
    those, so an fp32 GEMM that the function ran with autocast off stays fp32."""
    @planned
    def launcher(x, w):
        low = torch.mm(x, w)  # cast by autocast
        with torch.autocast("cpu", enabled=False):
            full = torch.mm(x, w)
        _launch((1,), [x, low, full])
        return low, full

    x, w = torch.randn(4, 8), torch.randn(8, 4)
    with moekit.options(poison=False), pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "current_device", lambda: 0)
        mp.setattr(launch, "current_stream", lambda device: "stream")
        mp.setattr(launch, "hooked", lambda: False)
        mp.setattr(config, "is_interpreting", lambda: False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = [launcher(x, w) for _ in range(3)]
    assert _LOG[-1][0] == "replay" and plan_counts(launcher) == (1, 0)
    for low, full in got:
        assert (low.dtype, full.dtype) == (torch.bfloat16, torch.float32) and torch.equal(full, x @ w)


def test_a_replay_skips_views_that_only_kernels_read(stand_in):
    """A view op whose output only kernels read is not run again: the kernel gets the viewed tensor's
    address plus the view's offset. A view that a torch op reads or that is returned is run."""
    @planned
    def launcher(x, w):
        out = config.empty((4, 4), dtype=x.dtype, device=x.device)
        _launch((1,), [w.mT, x[1:], out])
        return out, (x[2:] + 0)

    w1, x1 = torch.randn(3, 4), torch.randn(5, 4)
    launcher(x1, w1)
    launcher(x1, w1)
    w2, x2 = torch.randn(3, 4), torch.randn(5, 4)
    out, tail = launcher(x2, w2)
    assert _LOG[-1] == ("replay", (1, 1, 1), [w2.data_ptr(), x2.data_ptr() + 16, out.data_ptr()])
    assert torch.equal(tail, x2[2:])
    (plan,) = launcher.plans.values()
    ops = [str(step[9]) for step in plan.steps if step[0] == plans._OP]
    assert ops == ["aten.empty.memory_format", "aten.slice.Tensor", "aten.add.Tensor"]  # (no transpose, one slice)


def test_a_view_that_undoes_a_view_replays_as_the_tensor_it_views(stand_in):
    """``t.mT.mT`` of a recorded tensor (a weight gradient computed transposed and turned back) runs no
    view op in a replay: the output is the recorded tensor itself, same address, shape and strides. A view
    of an input that undoes a view stays a view op (an input is never returned as itself)."""
    @planned
    def launcher(x):
        out = config.empty((3, 4), dtype=x.dtype, device=x.device)
        _launch((1,), [x, out])
        return out.mT.mT, x.mT.mT

    for _ in range(2):
        launcher(torch.randn(3, 4))
    x = torch.randn(3, 4)
    back, same = launcher(x)
    assert _LOG[-1] == ("replay", (1, 1, 1), [x.data_ptr(), back.data_ptr()])
    assert back.shape == (3, 4) and back.stride() == (4, 1) and back._base is None
    assert same.data_ptr() == x.data_ptr() and same.stride() == x.stride() and same is not x
    (plan,) = launcher.plans.values()
    ops = [str(step[9]) for step in plan.steps if step[0] == plans._OP]
    assert ops == ["aten.empty.memory_format", "aten.transpose.int", "aten.transpose.int"], ops  # (x's two)


def test_registered_constant_memory_stays_where_it_is(stand_in):
    ones = plans.constant(torch.ones(4))

    @planned
    def with_ones(x):
        out = config.empty((4,), dtype=x.dtype, device=x.device)
        _launch((1,), [x, ones[1:], out])
        return out

    with_ones(torch.randn(4))
    with_ones(torch.randn(4))
    x = torch.randn(4)
    out = with_ones(x)
    assert _LOG[-1] == ("replay", (1, 1, 1), [x.data_ptr(), ones.data_ptr() + 4, out.data_ptr()])


def test_a_launcher_called_while_another_records_is_recorded_with_it(stand_in):
    @planned
    def outer(x):
        return _shifted(x, 3)[2]

    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    before = plan_counts(_shifted)
    outer(x1)
    outer(x1)
    assert plan_counts(_shifted) == before and plan_counts(outer) == (1, 0)
    o2 = outer(x2)
    assert _LOG[-1] == ("replay", (5, 3, 1), [x2.data_ptr() + 4, o2.data_ptr(), 5, 3])


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
        for _ in range(3):  # run as written, the recording, then a replay
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
def test_a_copy_to_the_host_is_refused(stand_in):
    """Values read on the host could steer the function: a recording with a device-to-host copy is
    refused (a zero-byte scratch buffer beside it is no arena slice)."""
    @planned
    def launcher(x):
        scratch = torch.empty(0, device=x.device)
        _launch((1,), [x, scratch])
        return x.cpu()  # (no item(): only the copy to the host refuses it)

    x = torch.randn(8, device="cuda")
    for _ in range(3):
        launcher(x)
    assert plan_counts(launcher) == (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["plain", "gpt-oss"])
def test_composed_block_steps_with_plans_equal_steps_without(config_name):
    """The launchers' own plans, on the composed path (``fused_block`` off)."""
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
            with moekit.options(plans=on, fused_block=False):
                out = moe(x)
                got[on] = (out, *torch.autograd.grad(out, [x, *params], dy))
        for a, b in zip(got[True], got[False], strict=True):
            assert a.stride() == b.stride() and torch.equal(a, b)
    for fn in (ragged_m, grouped_mm_swiglu_fwd, combine_fwd, routing_metadata_fwd):
        assert plan_counts(fn)[0] > 0, fn.__name__


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "gpt-oss", "sigmoid, expert bias", "fp32 masters, autocast",
                                     "x frozen", "save_h"])
def test_block_step_plans_replay_the_fused_step_bit_for_bit(variant):
    """The fused step's forward and backward plans (``moekit.block``) against the step without plans,
    over steps that move every address: new tokens, parameters updated in place (an optimizer step)
    and one replaced, a change of T, and a non-contiguous output gradient."""
    from moekit import block

    torch.manual_seed(0)
    dtype = torch.float32 if variant.startswith("fp32") else torch.bfloat16
    config_name = "gpt-oss" if variant in ("gpt-oss", "fp32 masters, autocast") else "plain"
    kw = dict(score_func="sigmoid") if variant.startswith("sigmoid") else {}
    from moekit.bench.moe import CONFIGS
    moe = moekit.MoE(256, 128, 16, 4, device="cuda", dtype=dtype, **CONFIGS[config_name], **kw)
    with torch.no_grad():
        moe.expert_bias.normal_(0, 0.1)
    before = [plan_counts(block._forward), plan_counts(block._backward)]
    for step, t in enumerate((300, 300, 300, 64, 64, 64, 300)):  # (a signature records when seen again)
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16, requires_grad=variant != "x frozen")
        dy = torch.randn(256, t, device="cuda", dtype=torch.bfloat16).t()  # non-contiguous
        params = [p for p in (x, *moe.parameters()) if p.requires_grad]
        got = {}
        for on in (True, False):
            with moekit.options(plans=on, save_h=variant == "save_h"), torch.autocast(
                    "cuda", torch.bfloat16, enabled=variant.startswith("fp32")):
                out = moe(x)
            assert type(out.grad_fn).__name__ == "_MoEStepFnBackward"
            got[on] = (out, *torch.autograd.grad(out, params, dy))
        assert all(t.isfinite().all() for t in got[False])  # (NaN would fail torch.equal below)
        for a, b in zip(got[True], got[False], strict=True):
            assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
        with torch.no_grad():  # an optimizer step in place (sign SGD: bounded over the seven steps),
            for p, g in zip(params[-len(list(moe.parameters())):], got[True][-len(list(moe.parameters())):],
                            strict=True):  # and once a parameter replaced
                p.sub_(1e-3 * g.sign().to(p.dtype))
            if step == 1:
                moe.experts.mlp2_weight_EDF = torch.nn.Parameter(moe.experts.mlp2_weight_EDF.detach().clone())
    after = [plan_counts(block._forward), plan_counts(block._backward)]
    for (kept0, refused0), (kept1, refused1) in zip(before, after, strict=True):
        assert kept1 - kept0 == 2 and refused1 == refused0  # (T = 300 and 64), each replayed
