"""Expert parallelism (moekit.distributed): gloo process groups of 2 and 4 CPU ranks, and NCCL groups
of 2 (or 4) GPUs where the machine has them.

Each world size runs once (one spawn of W processes, module-scoped) through a table of cases; every
case compares ExpertParallelMoE with a single-process moekit.MoE holding the same full weights and
fed every rank's tokens concatenated: outputs, dx, the expert gradients of each rank's shard, the
router gradients summed over the ranks, and the routing counts. On CPU the expert ops run their
pure-PyTorch reference (the interpreter would take minutes) and one case compiles the block over the
kernels under the interpreter; on GPUs (one process per GPU, ``-m gpu``) they run the kernels, at
D = 256, F = 128, and one more case captures the device-splits path in a CUDA graph.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moekit
from moekit import MoE, config
from moekit.distributed import ExpertParallelMoE, send_plan, send_plan_ref
from moekit.testing import assert_close

BF16 = torch.bfloat16
D, F, E = 16, 8, 8  # the NCCL workers set D, F = 256, 128 (GPU_DIMS)
GPU_DIMS = (256, 128)
CKPT_ROOT = ""  # the workers' shared folder (checkpoints)
BLOCKS = {  # the gpt-oss block (weights applied in the combine), the bias-free block (weights in the epilogue)
    "gpt-oss": {},
    "plain": dict(bias=False, router_bias=False, activation="swiglu"),
}

# --------------------------------------------------------------------------------------------------
# the cases (run on every rank of a gloo group)
# --------------------------------------------------------------------------------------------------


def _inputs(tokens):
    xs = [(torch.randn(t, D) * 2).to(BF16) for t in tokens]
    return xs, [torch.randn(t, D).to(BF16) for t in tokens]


def _match_moe(rank, world, *, block="plain", splits="host", chunks=1, top_k=2, tokens=None, bias_E=None):
    """ExpertParallelMoE on this rank's tokens against moekit.MoE on all ranks' tokens."""
    torch.manual_seed(0)  # the same weights and inputs on every rank
    moe = MoE(D, F, E, top_k, dtype=BF16, **BLOCKS[block])
    if bias_E is not None:
        moe.expert_bias.copy_(torch.tensor(bias_E, dtype=torch.float32))
    if tokens is None:  # the host path takes a different token count on each rank, the device path one count
        tokens = [6 + 3 * r for r in range(world)] if splits == "host" else [9] * world
    xs, dys = _inputs(tokens)
    ep = ExpertParallelMoE.from_moe(moe, splits=splits, chunks=chunks)
    x = xs[rank].clone().requires_grad_()
    present = []  # the receiving side's combine index: exactly the local choices present, the others -1
    real_experts = ep.experts.forward

    def experts_spy(x_recv, counts, token_idx, row_of, *rest, **kw):
        present.append(((row_of >= 0).sum().item(), counts.sum().item()))
        return real_experts(x_recv, counts, token_idx, row_of, *rest, **kw)

    ep.experts.forward = experts_spy
    y = ep(x)
    ep.experts.forward = real_experts
    assert len(present) == chunks and all(p == n for p, n in present), present
    y.backward(dys[rank])
    ep.all_reduce_router_grads()

    xf = torch.cat(xs).requires_grad_()
    yf = moe(xf)
    yf.backward(torch.cat(dys))
    mine = slice(sum(tokens[:rank]), sum(tokens[: rank + 1]))
    shard = slice(ep.expert_start, ep.expert_start + ep.local_experts)
    load = ep.tokens_per_expert.clone()
    dist.all_reduce(load)
    assert torch.equal(load, moe.tokens_per_expert), "routing counts"
    full = dict(moe.named_parameters())
    pairs = [("y", y, yf[mine]), ("dx", x.grad, xf.grad[mine])]
    pairs += [(n, p.grad, full[n].grad[shard]) for n, p in ep.experts.named_parameters(prefix="experts")]
    gpu = x.is_cuda
    for name, got, want in pairs:
        if chunks == 1 and not gpu and name.startswith("experts"):  # the same rows in the same order reach
            assert torch.equal(got, want), name  # every reference op: bit for bit
        else:  # y and dx: sums of per-rank shares, each rounded to bf16; chunks: expert gradients add up
            # chunk by chunk, each rounded to bf16; GPUs: the kernels' tiles depend on the problem's size
            assert_close(got, want.float(), BF16, what=name)
    tol = dict(rtol=1e-4, atol=1e-5) if gpu else dict(rtol=1e-5, atol=1e-7)  # cuBLAS sums in another order
    for name, p in ep.router.named_parameters():
        torch.testing.assert_close(p.grad, full[f"router.{name}"].grad, **tol)
    return ep, moe


def _state_dict_round_trip(rank, world):
    ep, moe = _match_moe(rank, world, block="gpt-oss")
    full, ref = ep.full_state_dict(), moe.state_dict()
    assert full.keys() == ref.keys()
    for key in ref:
        assert torch.equal(full[key], ref[key]), key


def _trained_ep2(rank, block):
    """A MoE and its EP = 2 shards (groups {0, 1} and {2, 3} of four ranks) after one SGD step of the
    experts: (moe, ep2, the pair groups, the step's tokens)."""
    torch.manual_seed(0)
    moe = MoE(D, F, E, 2, dtype=BF16, **BLOCKS[block])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    ep2 = ExpertParallelMoE.from_moe(moe, group=pairs[rank // 2])
    x = torch.randn(7, D).to(BF16)
    ep2(x).float().square().sum().backward()
    with torch.no_grad():
        for p in ep2.experts.parameters():
            p -= 0.5 * p.grad.to(p.dtype)
    return moe, ep2, pairs, x


def _reshard_2_to_4(rank, world):
    """Train EP=2 groups one step, gather its full state dict, load it into EP=4 and into a MoE."""
    moe, ep2, _, x = _trained_ep2(rank, "gpt-oss")
    full = ep2.full_state_dict()  # over the pair
    assert full["experts.mlp1_weight_EGD"].shape[0] == E and not torch.equal(full["experts.mlp1_weight_EGD"],
                                                                             moe.experts.mlp1_weight_EGD)
    ep4 = ExpertParallelMoE(D, F, E, 2, dtype=BF16)
    ep4.load_full_state_dict(full)
    moe.load_state_dict(full)
    assert_close(ep4(x), moe(x).float(), BF16, what="y")  # each rank's own tokens: EP=4 matches the resharded weights
    back = ep4.full_state_dict()
    assert all(torch.equal(back[k], full[k]) for k in full)


def _dcp_reshard(rank, world):
    """torch.distributed.checkpoint between EP sizes: EP = 2 groups save, EP = 4 loads in place (and
    back), each matching the weights saved; no full state dict on any rank."""
    import torch.distributed.checkpoint as dcp

    _, ep2, pairs, _ = _trained_ep2(rank, "plain")
    with torch.no_grad():
        ep2.expert_bias += 0.25
    saved = ep2.full_state_dict()
    path = os.path.join(CKPT_ROOT, "ep2")
    dcp.save(ep2.sharded_state_dict(), checkpoint_id=path)
    ep4 = ExpertParallelMoE(D, F, E, 2, dtype=BF16, **BLOCKS["plain"])
    dcp.load(ep4.sharded_state_dict(), checkpoint_id=path)
    got = ep4.full_state_dict()
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    dcp.save(ep4.sharded_state_dict(), checkpoint_id=os.path.join(CKPT_ROOT, "ep4"))
    back = ExpertParallelMoE(D, F, E, 2, dtype=BF16, group=pairs[rank // 2], **BLOCKS["plain"])
    dcp.load(back.sharded_state_dict(), checkpoint_id=os.path.join(CKPT_ROOT, "ep4"))
    assert all(torch.equal(back.state_dict()[k], ep2.state_dict()[k]) for k in saved)


def _idle_rank(rank, world, splits):
    """No token goes to the last rank's experts: it receives zero rows and sends back empty outputs."""
    _match_moe(rank, world, splits=splits, chunks=3, bias_E=[0] * (E - E // world) + [COLD] * (E // world))


def _uneven_and_empty_rank_tokens(rank, world):
    _match_moe(rank, world, tokens=[0] + [5 + 4 * r for r in range(1, world)])


def _expert_bias_stays_replicated(rank, world):
    torch.manual_seed(0)
    ep = ExpertParallelMoE(D, F, E, 2, dtype=BF16)
    ep(torch.randn(5 + rank * 7, D).to(BF16))  # different loads on each rank
    ep.update_expert_bias(0.1)
    biases = [torch.empty(E) for _ in range(world)]
    dist.all_gather(biases, ep.expert_bias)
    assert all(torch.equal(b, biases[0]) for b in biases) and biases[0].abs().sum() > 0


def _bad_inputs(rank, world):
    with pytest.raises(ValueError, match="divisible"):
        ExpertParallelMoE(D, F, world * 2 + 1, 2, dtype=BF16)
    with pytest.raises(ValueError, match="splits"):
        ExpertParallelMoE(D, F, E, 2, dtype=BF16, splits="eager")
    with pytest.raises(ValueError, match="chunks"):
        ExpertParallelMoE(D, F, E, 2, dtype=BF16, chunks=0)
    ep = ExpertParallelMoE(D, F, E, 2, dtype=BF16)
    with pytest.raises(ValueError, match="experts"):
        ep.load_full_state_dict({k: v[:1] if k.startswith("experts.") else v for k, v in ep.state_dict().items()})


def _device_splits_need_equal_tokens(rank, world):
    """Fixed slots are sized from the local token count: a rank with another count is caught on the
    device (every rank sees the mismatch, so none hangs in a later collective)."""
    ep = ExpertParallelMoE(D, F, E, 2, dtype=BF16, splits="device")
    with pytest.raises(RuntimeError, match="same number of tokens"):
        ep(torch.randn(5 + rank, D).to(BF16))


def _from_moe_keeps_nvfp4(rank, world, splits="host", precision="nvfp4"):
    """(Device splits: the quantized experts write zeros past offs[-1] whatever ``tail`` says, and get row
    scales whose dropped rows are unwritten; on GPUs this runs the kernels.) ``precision``: "nvfp4" or
    "fp8", each through moekit.quantized's interface."""
    from moekit import fp8, nvfp4

    recipe = nvfp4.TrainingRecipe(seed=3) if precision == "nvfp4" else fp8.TrainingRecipe(pow2_scales=True)
    torch.manual_seed(0)  # the same weights and inputs on every rank
    moe = MoE(D, max(F, 16), E, 2, dtype=BF16, **{precision: recipe}, **BLOCKS["plain"])  # (NVFP4: 16s along F)
    ep = ExpertParallelMoE.from_moe(moe, splits=splits)
    kept = getattr(ep.experts, precision)
    assert kept is not None and kept.recipe == recipe
    # the quantized experts on a rank's received tokens (fewer choice rows than T*K, absent entries): their
    # quantization scales see other rows than a single process's, so the comparison is loose
    xs, dys = _inputs([9] * world if splits == "device" else [6 + 3 * r for r in range(world)])
    x = xs[rank].clone().requires_grad_()
    y = ep(x)
    y.backward(dys[rank])
    want = moe(torch.cat(xs))[sum(len(t) for t in xs[:rank]) :][: len(x)].float()
    err = (y.float() - want).norm() / want.norm()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in ep.experts.parameters())
    assert err < 0.15, f"{precision} EP output off the single-process {precision} block by {err:.3f}"


def _on_the_kernels(rank, world, splits):
    """The Triton kernels (interpreter), outputs poisoned. Host splits: each rank's experts run on fewer
    rows than its tokens' T*K choices (cut to the real ones; the dropped choices are absent, -1, in
    row_of). Device splits, two chunks: the slot rows that no token fills travel unwritten, and the
    dropped choices' rows lie past offs[-1]; neither may reach an output or a gradient."""
    with moekit.options(reference=False):
        for block in BLOCKS:
            _match_moe(rank, world, block=block, top_k=3, splits=splits, chunks=1 if splits == "host" else 2)


def _compiled_over_the_kernels(rank, world):
    """torch.compile of the whole block over the Triton kernels (interpreter): the collectives are
    graph breaks, the router, permutations and experts compile; the result equals eager."""
    torch.manual_seed(0)
    with moekit.options(reference=False):
        ep = ExpertParallelMoE(D, F, E, 2, dtype=BF16, splits="device", **BLOCKS["plain"])
        x = torch.randn(5, D).to(BF16)
        compiled = torch.compile(ep, backend="aot_eager")
        torch.testing.assert_close(compiled(x), ep(x), rtol=0, atol=0)


def _fsdp2_on_the_router(rank, world):
    """FSDP2 (fully_shard) over the EP ranks on everything but the experts: it all-gathers the router
    for the forward and reduce-scatters its gradient as a mean; the experts stay local."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    moe = MoE(D, F, E, 2, dtype=BF16)
    xs, dys = _inputs([7] * world)
    ep = ExpertParallelMoE.from_moe(moe)
    mesh = init_device_mesh(torch.get_default_device().type, (world,))
    fully_shard(ep, mesh=mesh, ignored_params=set(ep.experts.parameters()))
    ep(xs[rank]).backward(dys[rank])
    moe(torch.cat(xs)).backward(torch.cat(dys))
    shard = slice(ep.expert_start, ep.expert_start + ep.local_experts)
    for name, p in ep.experts.named_parameters(prefix="experts"):
        assert type(p) is torch.nn.Parameter and torch.equal(p.grad, moe.get_parameter(name).grad[shard]), name
    for name, p in ep.router.named_parameters(prefix="router"):
        grad = p.grad.full_tensor() * world  # FSDP2 averages
        tol = dict(rtol=1e-4, atol=1e-5) if grad.is_cuda else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, moe.get_parameter(name).grad, **tol)


def _ep_by_fsdp2(rank, world):
    """torchtitan's EP x FSDP layout on a (dp = 2, ep = 2) mesh: experts sharded over "ep" by the
    module and again over "dp" by FSDP2 (it all-gathers them for the compute and reduce-scatters
    their gradients as a mean over dp); the router fully sharded over all four ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.get_default_device().type
    mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    moe = MoE(D, F, E, 2, dtype=BF16, **BLOCKS["plain"])
    tokens = [6 + r for r in range(world)]
    xs, dys = _inputs(tokens)
    ep = ExpertParallelMoE.from_moe(moe, group=mesh.get_group("ep"))
    fully_shard(ep.experts, mesh=mesh["dp"])
    fully_shard(ep, mesh=mesh._flatten("dp_ep"))
    x = xs[rank].clone().requires_grad_()
    ep(x).backward(dys[rank])
    xf = torch.cat(xs).requires_grad_()
    moe(xf).backward(torch.cat(dys))
    mine = slice(sum(tokens[:rank]), sum(tokens[: rank + 1]))
    assert_close(x.grad, xf.grad[mine].float(), BF16, what="dx")  # a sum of per-rank shares
    shard = slice(ep.expert_start, ep.expert_start + ep.local_experts)
    for name, p in ep.experts.named_parameters(prefix="experts"):
        assert p.to_local().shape[0] == ep.local_experts // 2, name  # sharded again over dp
        grad = p.grad.full_tensor().float() * 2  # the mean over the two dp replicas' partial sums
        assert_close(grad, moe.get_parameter(name).grad[shard].float(), BF16, what=name)
    for name, p in ep.router.named_parameters(prefix="router"):
        tol = dict(rtol=1e-4, atol=1e-5) if p.is_cuda else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p.grad.full_tensor() * world, moe.get_parameter(name).grad, **tol)


def _device_splits_graph(rank, world):
    """GPUs: the device-splits path runs forward and backward with host syncs forbidden, and its
    forward replays from a CUDA graph captured on every rank (the all-to-alls inside)."""
    torch.manual_seed(0)
    moe = MoE(D, F, E, 2, dtype=BF16, **BLOCKS["plain"])
    ep = ExpertParallelMoE.from_moe(moe, splits="device", chunks=2)
    xs, dys = _inputs([64] * world)
    x = xs[rank].clone().requires_grad_()
    ep(x).backward(dys[rank])  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = ep(x)
        y.backward(dys[rank])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(y, moe(torch.cat(xs))[64 * rank : 64 * (rank + 1)].float(), BF16, what="y")
    _forward_replays_from_a_cuda_graph(ep, x)


def _forward_replays_from_a_cuda_graph(ep, x):
    """Capture ep's forward on a copy of x in a CUDA graph (warmed up on a side stream), give the copy
    new values, replay, and compare with an eager forward: bit for bit."""
    static_x = x.detach().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        ep(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = ep(static_x)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert torch.equal(static_y, ep(static_x))


def _step_replays_from_a_cuda_graph(ep, x, dy):
    """Capture a whole training step of ep (forward, and the gradients of x and every parameter) in a
    CUDA graph, give its inputs new values, replay, and compare with an eager step: bit for bit."""
    static_x, static_dy = x.detach().clone().requires_grad_(), dy.clone()
    params = [static_x, *ep.parameters()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            torch.autograd.grad(ep(static_x), params, static_dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ep(static_x)
        static_grads = torch.autograd.grad(static_y, params, static_dy)
    with torch.no_grad():
        static_x.copy_(torch.randn_like(static_x))
        static_dy.copy_(torch.randn_like(static_dy))
    graph.replay()
    torch.cuda.synchronize()
    y = ep(static_x)
    grads = torch.autograd.grad(y, params, static_dy)
    assert torch.equal(static_y, y), "y"
    for i, (got, want) in enumerate(zip(static_grads, grads, strict=True)):
        assert torch.equal(got, want), f"gradient {i}"


HOT, COLD = 1e4, -1e4
# cases that need a given world size
ONLY = {"reshard-2-to-4": 4, "dcp-reshard-2-to-4": 4, "ep-x-fsdp2": 4, "top4-device": 4}
CASES = {  # name: the case, run on every rank; the comment says what it covers
    **{f"match-{b}-{s}-chunks{c}": partial(_match_moe, block=b, splits=s, chunks=c)
       for b in BLOCKS for s in ("host", "device") for c in (1, 3)},
    # experts 1, 2 and 6 are never chosen
    **{f"empty-experts-{s}": partial(_match_moe, splits=s, bias_E=[0, COLD, COLD, 0, 0, 0, COLD, 0])
       for s in ("host", "device")},
    # more chunks than tokens: empty chunks, device slots of 0 and 1 rows
    "empty-chunks-device": lambda rank, world: _match_moe(rank, world, splits="device", chunks=3, tokens=[2] * world),
    # every token's first choice is expert 5: its rank gets at least T rows from every rank
    **{f"hot-expert-{s}": partial(_match_moe, splits=s, bias_E=[0] * 5 + [HOT, 0, 0]) for s in ("host", "device")},
    # no token goes to the last rank's experts (the biases are set per world size in _idle_rank)
    **{f"idle-rank-{s}": partial(_idle_rank, splits=s) for s in ("host", "device")},
    # K = 4 > El on four ranks: a token's choices share its one row on a rank
    "top4-device": partial(_match_moe, splits="device", top_k=4, block="gpt-oss"),
    "uneven-tokens-host": _uneven_and_empty_rank_tokens,
    "state-dict-round-trip": _state_dict_round_trip,
    "expert-bias-replicated": _expert_bias_stays_replicated,
    "bad-inputs": _bad_inputs,
    "device-splits-unequal-tokens": _device_splits_need_equal_tokens,
    "from-moe-nvfp4": _from_moe_keeps_nvfp4,
    "from-moe-nvfp4-device": partial(_from_moe_keeps_nvfp4, splits="device"),
    "from-moe-fp8-device": partial(_from_moe_keeps_nvfp4, splits="device", precision="fp8"),
    "reshard-2-to-4": _reshard_2_to_4,
    "dcp-reshard-2-to-4": _dcp_reshard,
    "ep-x-fsdp2": _ep_by_fsdp2,
    "compile": _compiled_over_the_kernels,
    **{f"{s}-splits-kernels": partial(_on_the_kernels, splits=s) for s in ("host", "device")},
    "fsdp2": _fsdp2_on_the_router,
    "device-splits-graph": _device_splits_graph,
}
GPU_ONLY = {"device-splits-graph"}
# the kernels on CPU; on GPUs every case runs them
INTERPRETER_CASES = {"compile", "host-splits-kernels", "device-splits-kernels"}
WORLD_CASES = {
    2: [n for n in CASES if ONLY.get(n, 2) == 2 and n not in GPU_ONLY
        and (n not in INTERPRETER_CASES or config.is_interpreting())],
    4: ["match-plain-host-chunks1", "match-plain-device-chunks3", "match-gpt-oss-device-chunks1",
        "match-gpt-oss-host-chunks3", "idle-rank-device", "hot-expert-host", "top4-device", "reshard-2-to-4",
        "dcp-reshard-2-to-4", "ep-x-fsdp2", "empty-chunks-device"],
}


def _nccl_world() -> int:
    """The NCCL test's world: 4 GPUs where the machine has 4 or more, else 2 (0: too few GPUs)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 4 if n >= 4 else (2 if n >= 2 else 0)


# the interpreter; a failed device assert ends a CUDA process
CPU_ONLY = {*INTERPRETER_CASES, "device-splits-unequal-tokens"}


def _nccl_cases(world: int) -> list[str]:
    """Every case that runs at this world size on the kernels."""
    names = [n for n in CASES if ONLY.get(n, world) == world and n not in CPU_ONLY]
    return names if world == 2 else [n for n in names if n in WORLD_CASES[4] or n in GPU_ONLY]

# --------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, folder: str, names: list[str], backend: str = "gloo") -> None:
    global D, F, CKPT_ROOT
    CKPT_ROOT = folder
    device_id = None
    if backend == "nccl":  # one GPU per rank, the kernels, tensors created on it by default
        D, F = GPU_DIMS
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
        torch.set_default_device(device_id)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=device_id)
    moekit.set_options(reference=backend == "gloo", poison=True)  # unwritten kernel outputs start as NaN
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            CASES[name](rank, world)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        with open(f"{folder}/rank{rank}.json", "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _run_world(world: int, folder, timeout_s: float = 240.0, backend: str = "gloo",
               names: list[str] | None = None) -> list[dict]:
    ctx = mp.get_context("spawn")
    names = WORLD_CASES[world] if names is None else names
    procs = [ctx.Process(target=_worker, args=(r, world, str(folder), names, backend)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(world):
        path = os.path.join(folder, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else {})
    return results


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    return {w: _run_world(w, tmp_path_factory.mktemp(f"ep{w}")) for w in WORLD_CASES}


@pytest.mark.parametrize("world, case", [(w, n) for w, names in WORLD_CASES.items() for n in names],
                         ids=[f"w{w}-{n}" for w, names in WORLD_CASES.items() for n in names])
def test_expert_parallel(world_results, world, case):
    for rank, results in enumerate(world_results[world]):
        status = results.get(case, "did not run (an earlier case hung or the process died)")
        assert status == "ok", f"rank {rank} of {world}, {case}:\n{status}"


NCCL_WORLD = _nccl_world()
NCCL_CASES = _nccl_cases(NCCL_WORLD) if NCCL_WORLD else _nccl_cases(2)


@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory):
    if NCCL_WORLD == 0:
        pytest.skip("needs 2 or more CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (the spawned ranks inherit it)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return _run_world(NCCL_WORLD, tmp_path_factory.mktemp("ep-nccl"), timeout_s=540.0, backend="nccl",
                      names=NCCL_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("case", NCCL_CASES)
def test_expert_parallel_on_gpus(nccl_results, case):
    for rank, results in enumerate(nccl_results):
        status = results.get(case, "did not run (an earlier case hung or the process died)")
        assert status == "ok", f"rank {rank} of {NCCL_WORLD} (NCCL), {case}:\n{status}"


# --------------------------------------------------------------------------------------------------
# single-process pieces
# --------------------------------------------------------------------------------------------------

PLANS = [  # (experts (T, K), El, W, cap or None): why
    ([[0, 3], [2, 1], [1, 0]], 2, 2, None),  # exact blocks; token 1 goes to both ranks
    ([[0, 1], [1, 0], [0, 1]], 2, 2, None),  # every token to rank 0 only: rank 1's block is empty
    ([[0, 5], [4, 2], [7, 6], [1, 3]], 2, 4, 4),  # fixed slots of T rows, some empty
    ([[3, 1, 2]], 1, 4, None),  # one token, K = 3 on three ranks
    (torch.zeros(0, 2, dtype=torch.int64).tolist(), 2, 2, None),  # no tokens
]


@pytest.mark.parametrize("experts, local, world, cap", PLANS)
def test_send_plan_matches_reference(experts, local, world, cap):
    ids = torch.tensor(experts, dtype=torch.int64).view(-1, 2 if not experts else len(experts[0]))
    got, want = send_plan(ids, local, world, cap), send_plan_ref(ids, local, world, cap)
    for name, g, w in zip(got._fields, got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert torch.equal(got.pairs, torch.bincount((ids // local).reshape(-1), minlength=world))
    s = world * cap if cap is not None else int(got.tokens.sum())
    pos = got.pos.long()
    assert torch.equal(got.send_tok[pos[pos >= 0]].long(), torch.nonzero(pos >= 0)[:, 0])  # each row's token
    assert (pos < s).all() and torch.equal(pos[pos >= 0].unique(), pos[pos >= 0].sort().values)  # distinct
    if ids.numel():  # each choice's row is its token's row for the choice's rank
        assert torch.equal(got.row, pos.gather(1, ids // local))


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(D, F, E, 2)


@pytest.mark.gpu
def test_device_splits_have_no_host_sync_and_capture_in_a_cuda_graph(tmp_path):
    """NCCL, one rank: a whole device-splits step (forward and every gradient) replays from a CUDA graph
    bit for bit; the path runs forward and backward with host syncs forbidden, and its forward replays
    from a CUDA graph."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        dev = torch.device("cuda")
        moe = MoE(256, 128, 8, 2, device=dev, dtype=BF16, **BLOCKS["plain"])
        ep = ExpertParallelMoE.from_moe(moe, splits="device", chunks=2)
        x = torch.randn(512, 256, device=dev, dtype=BF16, requires_grad=True)
        ep(x).sum().backward()  # warm-up (compiles the kernels)
        # a whole step first: captured after an eager step whose loss was y.float().square().sum(),
        # the step's capture fails (cudaErrorStreamCaptureImplicit; docs/design.md, section 15)
        _step_replays_from_a_cuda_graph(ep, x, torch.randn(512, 256, device=dev, dtype=BF16))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = ep(x)
            y.float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close(y, moe(x.detach()).float(), BF16, what="y")
        _forward_replays_from_a_cuda_graph(ep, x)
    finally:
        dist.destroy_process_group()


def test_ep_cost_model_prints_its_table(capsys):
    from moekit.__main__ import main
    from moekit.bench import BLOCK_SHAPES, ep_model

    main(["bench", "--ep-model", "--link", "nvlink4", "--link-gbs", "100", "--link-us", "8", "--tflops", "400"])
    text = capsys.readouterr().out
    assert "a model, not a measurement" in text and "at 400 TF/s" in text
    assert "### nvlink4: 450 GB/s" in text and "### custom: 100 GB/s per direction, 8 us" in text
    rows = [line for line in text.splitlines() if line.startswith("| gpt-oss-20b |")]
    assert [row.split(" | ")[2] for row in rows] == ["2", "4", "8"] * 2
    shape = BLOCK_SHAPES["gpt-oss-20b"]  # T = 24576, K = 4, D = F = 2880, E = 32
    cost = ep_model.layer_cost(shape, 2, 450.0, 5.0, 600.0)
    p = 1 - (16 * 15 * 14 * 13) / (32 * 31 * 30 * 29)  # some of a token's 4 experts among the other 16
    rows_off = 24576 * p  # token rows leaving a rank
    out_b, back_b = 2880 * 2 + 8 * 4, 2880 * 2  # a row and its choices out; a row back
    assert cost.host_mb == pytest.approx(rows_off * out_b / 1e6)
    assert cost.a2a_host == pytest.approx(4 * 5e-3 + 2 * rows_off * (out_b + back_b) / 450e9 * 1e3)
    assert cost.a2a_device == pytest.approx(4 * 5e-3 + 2 * 24576 * (out_b + back_b) / 450e9 * 1e3)  # a slot of T rows
    assert cost.compute == pytest.approx(18 * 24576 * 4 * 2880 * 2880 / 600e12 * 1e3)
    assert cost.exposed[1] == pytest.approx(cost.a2a_host)  # one chunk overlaps nothing
    assert cost.exposed[8] < cost.exposed[2] < cost.exposed[1]
