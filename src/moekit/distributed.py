"""Expert parallelism on ``torch.distributed``: :class:`ExpertParallelMoE`.

Legend: T tokens on this rank, K experts per token, E experts in all, W ranks in the expert-parallel
(EP) group, El = E / W experts per rank, D model dim, F expert hidden dim, C chunks, S rows this rank
sends, N tokens it receives.

Rank w holds experts [w*El, (w+1)*El) (a contiguous block of expert ids) and a replica of the router.
Each rank routes its own T tokens over all E experts, exactly as :class:`moekit.MoE` does. A token
then goes once to every rank that holds at least one of its K experts (*dispatch*; :func:`send_plan`
lays out the send buffer on the device), with its K choices beside it: the routing weights, and the
expert ids local to that rank, -1 where a choice lies on another rank. A rank sends S <= T*min(K, W)
rows instead of one per choice (T*K): at K = 8 and W = 2, about a quarter of them. The receiving rank
treats its N tokens as :class:`moekit.MoE` treats its input: :func:`moekit.routing_metadata` orders
the choices on it by expert (those on other ranks dropped), :class:`moekit.GroupedExperts` reads the
token rows in place, and :func:`moekit.combine` sums each token's outputs there in fp32 (the absent
choices add nothing). That per-rank share of each token goes back by the reverse all-to-all
(*combine*), and the source sums its tokens' (at most W) shares in fp32. With expert output biases the
routing weights scale the rows in the receiving rank's combine; without them they scale each row's
SwiGLU output in the up-projection's epilogue, as in :class:`moekit.MoE`.

Numerics: routing and every expert row are :class:`moekit.MoE`'s (a rank's rows of one expert come in
source rank order, each source's in token order: the single-process order of the concatenated
tokens), so the expert gradients match it; the output and dx are sums of per-rank shares each rounded
to x.dtype, within a few bf16 ulps of it.

Split sizes, the option ``splits``. Both start with an all-to-all of a (C, W, 3) counts tensor that
tells every rank, per chunk, how many tokens and choices each source sends it.

- ``"host"`` (the default, on every backend): one ``.tolist()`` of the counts (one host sync per
  forward) gives exact split sizes: the all-to-alls move exactly the tokens each rank needs, and the
  experts run on exactly the choices. Ranks may pass different numbers of tokens. Everything that
  needs no size (the send plan, the choice table's layout) is computed before the sync.
- ``"device"``: no host sync, for CUDA graphs and for a host that must run ahead of the GPU. Tokens go
  in fixed slots of T_c rows per (source, destination) pair (a rank gets each token at most once) by
  an equal-split all-to-all into a (W * T_c, D) receive buffer; the experts run over W*T_c*K choice
  rows with device offsets, those of other ranks (and of empty slots) past the last offset, where they
  come out as zeros; those choices are absent (-1) in the combine's index, so the combine, its backward
  and the dx sum skip them (their gradients go nowhere). The slots' unused rows travel unwritten, and
  no result depends on them: their choices are all absent on the receiving rank, whose combine sends
  back zeros for them; where a copy of the routed rows carries them into rows past the last offset,
  every GEMM's loads stop at the group's end (and the NVFP4 path zeroes those rows before its amax);
  the gradients that return for them are zeros or never read. Every rank must pass the same number of
  tokens. The price: W*T_c
  rows per rank against the T_c*(1 + (W-1)*p) that need to go, (W-1)*T_c against (W-1)*p*T_c on the
  link (p: the chance that a token has a choice on a given other rank; 1/p is 1.0 at W = 2, 1.1 at
  4, 1.5 at 8 for E = 128, K = 8), and expert activations for W*T_c*K rows; ``python -m moekit
  bench --ep-model`` prints both paths' modelled all-to-all times.

No token is ever dropped: there is no capacity limit.

Overlap, the option ``chunks`` (default 1): the tokens are cut into C contiguous slices; every slice's
dispatch is started (``async_op=True``) before any expert computation, and each slice's combine is
started as soon as its experts finish, so the all-to-alls of one slice run while the GEMMs of another
do. The backward overlaps the same way: each reverse all-to-all is started by one autograd node and
waited on by another. Expert-weight gradients then add up slice by slice. Measured on four H200s, C > 1
was slower than C = 1 at gpt-oss-120b and qwen3-30b-a3b: each slice repeats the host's per-op cost
while its GPU work shrinks (docs/design.md, section 15).

Gradients: the collectives are autograd functions whose backward is the reverse all-to-all, so the
backward is a collective too (every rank runs it; x requires grad on all ranks or on none).

- Expert weights (sharded): rank w's gradients are complete for its experts, summed over every rank's
  tokens (their rows all arrived there). Do not all-reduce them over the EP group; with EP replicas in
  an outer data-parallel group, all-reduce them over that group only.
- Router weight and bias (replicated): each rank's gradient covers only its own tokens, a partial sum
  as in data parallelism. Sum them over the EP group (and any outer data-parallel group):
  :meth:`ExpertParallelMoE.all_reduce_router_grads`, or a data-parallel wrapper of the non-expert
  parameters that spans the EP ranks. The sums then equal the single-process gradients of the summed
  loss over all ranks' tokens. Where the wrapper averages instead (each rank's loss a mean over its
  tokens, the global loss the mean of those), divide the expert gradients by W as well.
- ``expert_bias`` is a buffer, not a parameter: :meth:`ExpertParallelMoE.update_expert_bias` sums the
  load over the group, so it stays replicated.

GPU notes: do not use NVLink multicast or symmetric-memory multicast; run with
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NCCL_NVLS_ENABLE=0``. The collectives and the host-split
read are excluded from ``torch.compile`` (``torch.compiler.disable``); the router, the permutations
and the experts compile.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .layers import GroupedExperts, RoutedBlock
from .routing import (
    Dispatch,
    Routing,
    combine,
    gather_token_rows,
    routing_metadata,
    sorted_weights,
)
from .validation import autocast

SPLITS = ("device", "host")

# --------------------------------------------------------------------------------------------------
# the send plan: each token once per destination rank
# --------------------------------------------------------------------------------------------------


class ScatterRowsFn(torch.autograd.Function):
    """out (rows, ...) zeros with out[pos[i]] = x[i]; pos (N,) int64, distinct. Backward: grad[pos]."""

    @staticmethod
    def forward(ctx, x, pos, rows: int):
        ctx.save_for_backward(pos)
        out = x.new_zeros((rows, *x.shape[1:]))
        return out.index_copy_(0, pos, x)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return grad.index_select(0, pos), None, None


class SendPlan(NamedTuple):
    """Where a slice of T tokens goes (:func:`send_plan`); W ranks, K choices per token, S buffer rows."""

    tokens: torch.Tensor  # (W,) int64: tokens sent to each rank (S = their sum, or W * cap)
    pairs: torch.Tensor  # (W,) int64: (token, expert) choices sent to each rank
    pos: torch.Tensor  # (T, W) int32: token t's row in the send buffer for rank w, -1 if t does not go there
    send_tok: torch.Tensor  # (bound,) int32: the token of each buffer row; the first S rows are the buffer
    row: torch.Tensor  # (T, K) int64: choice (t, k)'s buffer row, pos[t, w(t, k)]
    local: torch.Tensor  # (T, K) int32: choice (t, k)'s expert id on its rank, in [0, El)


def send_plan(experts: torch.Tensor, local_experts: int, world: int, cap: int | None = None) -> SendPlan:
    """Where each token goes, on the device and without a sync.

    experts (T, K) integer global expert ids (distinct per token); rank w owns experts
    [w*El, (w+1)*El), El = ``local_experts``. A token goes once to every rank that owns one of its
    experts. The send buffer holds destination 0's tokens, then destination 1's, ..., each block in
    token order: S rows in all, the sum of ``tokens`` (known on the host only after a sync, so
    ``send_tok`` is sized for the most, T*W rows); with ``cap``, fixed slots of ``cap`` rows per
    destination (S = W * cap), destination w's tokens first in its slot, the rest naming token 0.
    ``pos`` is -1 where a token does not go: an absent entry for :func:`moekit.combine` and
    :func:`moekit.routing.gather_token_rows`.
    """
    t, k = experts.shape
    dev = experts.device
    ids = experts.long()
    dest = ids // local_experts  # (T, K)
    hit = torch.zeros((world, t), dtype=torch.bool, device=dev).scatter_(0, dest.t(), True)  # (W, T)
    tokens = hit.sum(1)
    pairs = torch.zeros(world, dtype=torch.int64, device=dev).scatter_add_(0, dest.reshape(-1),
                                                                           torch.ones_like(dest).reshape(-1))
    bound = t * world if cap is None else cap * world
    base = tokens.cumsum(0) - tokens if cap is None else torch.arange(world, device=dev) * cap
    place = base[:, None] + hit.cumsum(1) - 1  # (W, T): the scan runs along the inner dim (along dim 0 of a
    # (T, W) mask it took 2.7 ms at T = 16384, W = 4)
    send_tok = torch.zeros(bound + 1, dtype=torch.int32, device=dev)  # (+1: the absent entries' writes)
    owner = torch.arange(t, device=dev, dtype=torch.int32).expand(world, t)
    send_tok.scatter_(0, torch.where(hit, place, bound).reshape(-1), owner.reshape(-1))
    pos = torch.where(hit, place, -1).t()  # (T, W)
    row = pos.gather(1, dest)
    local = (ids - dest * local_experts).to(torch.int32)
    return SendPlan(tokens, pairs, pos.to(torch.int32).contiguous(), send_tok[:bound], row, local)


def send_plan_ref(experts: torch.Tensor, local_experts: int, world: int, cap: int | None = None) -> SendPlan:
    """Reference for :func:`send_plan`, on the host with Python loops."""
    ids = experts.tolist()
    t, k = experts.shape
    blocks = [[i for i in range(t) if any(e // local_experts == w for e in ids[i])] for w in range(world)]
    base = [w * cap for w in range(world)] if cap is not None else [sum(map(len, blocks[:w])) for w in range(world)]
    pos = [[-1] * world for _ in range(t)]
    send_tok = [0] * (t * world if cap is None else cap * world)
    for w, block in enumerate(blocks):
        for j, i in enumerate(block):
            pos[i][w] = base[w] + j
            send_tok[base[w] + j] = i
    as_t = partial(torch.tensor, device=experts.device)
    return SendPlan(
        as_t([len(b) for b in blocks], dtype=torch.int64),
        as_t([sum(e // local_experts == w for r in ids for e in r) for w in range(world)], dtype=torch.int64),
        as_t(pos, dtype=torch.int32).view(t, world),
        as_t(send_tok, dtype=torch.int32),
        as_t([[pos[i][e // local_experts] for e in ids[i]] for i in range(t)], dtype=torch.int64).view(t, k),
        as_t([[e % local_experts for e in ids[i]] for i in range(t)], dtype=torch.int32).view(t, k),
    )


# --------------------------------------------------------------------------------------------------
# the all-to-all as two autograd nodes: start (async) and wait
# --------------------------------------------------------------------------------------------------


class _Exchange:
    """One all-to-all and its reverse: split sizes (lists of host ints, or None for equal splits), the
    row counts of both sides, and the pending work handles."""

    def __init__(self, group, in_rows: int, out_rows: int, in_splits=None, out_splits=None):
        self.group, self.in_rows, self.out_rows = group, in_rows, out_rows
        self.in_splits, self.out_splits = in_splits, out_splits
        self.work = self.bwd_work = self.bwd_out = None

    def reverse(self) -> _Exchange:
        return _Exchange(self.group, self.out_rows, self.in_rows, self.out_splits, self.in_splits)


@torch.compiler.disable
def _launch(out, inp, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


class _AllToAllStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex: _Exchange):
        x = x.contiguous()
        out = x.new_empty((ex.out_rows, *x.shape[1:]))
        ex.work = _launch(out, x, ex.out_splits, ex.in_splits, ex.group)
        ctx.ex = ex
        return out

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        _wait(ex.bwd_work)
        out, ex.bwd_work, ex.bwd_out = ex.bwd_out, None, None
        return out, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, ex: _Exchange):
        _wait(ex.work)
        ex.work = None
        ctx.ex = ex
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        grad = grad.contiguous()
        ex.bwd_out = grad.new_empty((ex.in_rows, *grad.shape[1:]))
        ex.bwd_work = _launch(ex.bwd_out, grad, ex.in_splits, ex.out_splits, ex.group)
        return grad, None


@torch.compiler.disable
def _wait(work) -> None:
    work.wait()


def all_to_all_start(x: torch.Tensor, ex: _Exchange) -> torch.Tensor:
    """Start the all-to-all of x (``ex.in_rows``, ...); the result is valid after :func:`all_to_all_wait`."""
    return _AllToAllStart.apply(x, ex)


def all_to_all_wait(out: torch.Tensor, ex: _Exchange) -> torch.Tensor:
    """Wait for the all-to-all started by :func:`all_to_all_start`; differentiable (the reverse
    all-to-all, started by this node's backward and waited on by the start node's)."""
    return _AllToAllWait.apply(out, ex)


@torch.compiler.disable
def _exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """send (C, W, 3) int64, per chunk and destination rank: (tokens sent there, their (token, expert)
    pairs, this rank's tokens in the chunk) -> the same from every source rank, (C, W, 3), in one
    all-to-all."""
    send = send.transpose(0, 1).contiguous()  # (W, C, 3)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1)


@torch.compiler.disable
def _host_splits(*counts: torch.Tensor) -> list:
    return torch.stack(counts).tolist()  # the one host sync of the "host" path


# --------------------------------------------------------------------------------------------------
# the module
# --------------------------------------------------------------------------------------------------


class _Chunk:
    """One slice [t0, t1) of the tokens on its way: its choices, its exchanges and its buffers."""

    def __init__(self, t0: int, t1: int, experts: torch.Tensor, weights: torch.Tensor):
        self.t0, self.t1, self.experts, self.weights = t0, t1, experts, weights


class ExpertParallelMoE(RoutedBlock):
    """:class:`moekit.MoE` with its experts sharded over an expert-parallel process group: the same
    :class:`moekit.layers.RoutedBlock` (arguments, router, balancing state, routing), other experts.

    Same arguments and numerics as :class:`moekit.MoE`, plus:

    - ``group``: the EP process group (default: the world). Rank w of W holds experts
      [w*E/W, (w+1)*E/W); E must be divisible by W.
    - ``splits``: "host" (the default: one ``.tolist()`` per forward, exact sizes) or "device" (no host
      sync, fixed slots of T tokens per rank pair, and expert work over W*T*K choice rows). See the
      module docstring.
    - ``chunks``: C >= 1 token slices whose all-to-alls overlap each other's expert GEMMs.

    ``aux_loss=True`` leaves the load-balancing loss of this rank's tokens in ``self.aux_loss`` (a
    per-rank loss, like the router's gradients).

    Parameters: ``router`` (replicated, fp32 ``Linear(D, E)``), ``experts`` (a
    :class:`moekit.GroupedExperts` of El = E/W experts: this rank's shard), buffers ``expert_bias``
    (E,) (replicated) and ``tokens_per_expert`` (E,) (this rank's tokens). State-dict keys are
    :class:`moekit.MoE`'s, with the expert tensors (El, ...) instead of (E, ...):
    :meth:`load_full_state_dict` and :meth:`full_state_dict` convert, so checkpoints move between EP
    sizes and to and from a single-process :class:`moekit.MoE`; :meth:`sharded_state_dict` does the
    same through ``torch.distributed.checkpoint`` without a full copy on any rank.

    ``forward(x)``: x (..., D) bf16/fp16, this rank's tokens -> (..., D) in x.dtype. A collective: every
    rank of the group calls it, with the same C (and, with "device" splits, the same token count).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        group: dist.ProcessGroup | None = None,
        splits: str = "host",
        chunks: int = 1,
        bias: bool = True,
        activation: str = "gpt-oss",
        router_bias: bool = True,
        score_func: str = "softmax",
        renormalize: bool = True,
        aux_loss: bool = False,
        device=None,
        dtype=None,
        **experts_kw,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE: torch.distributed is not initialized (dist.init_process_group)")
        super().__init__("ExpertParallelMoE", dim, hidden_dim, num_experts, top_k, bias=bias, activation=activation,
                         router_bias=router_bias, score_func=score_func, renormalize=renormalize, aux_loss=aux_loss,
                         device=device, dtype=dtype, experts_kw=experts_kw)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"ExpertParallelMoE: num_experts ({num_experts}) must be divisible by the EP group's "
                             f"size ({self.world})")
        if splits not in SPLITS:
            raise ValueError(f"ExpertParallelMoE: splits must be one of {SPLITS}, got {splits!r}")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"ExpertParallelMoE: chunks must be an int >= 1, got {chunks!r}")
        self.splits, self.chunks = splits, chunks
        self.num_experts, self.local_experts = num_experts, num_experts // self.world
        self.expert_start = self.rank * self.local_experts
        self.experts = GroupedExperts(dim, hidden_dim, self.local_experts, bias=bias, activation=activation,
                                      device=device, dtype=dtype, **experts_kw)

    @classmethod
    def from_moe(cls, moe: nn.Module, *, group=None, splits: str = "host", chunks: int = 1):
        """This rank's shard of a :class:`moekit.MoE` (same configuration, its weights sliced)."""
        ex = moe.experts
        out = cls(
            ex.dim, ex.hidden_dim, ex.num_experts, moe.top_k, group=group, splits=splits, chunks=chunks,
            bias=ex.mlp1_bias_EG is not None, router_bias=moe.router.bias is not None, score_func=moe.score_func,
            renormalize=moe.renormalize, aux_loss=moe.use_aux_loss, device=ex.mlp1_weight_EGD.device,
            dtype=ex.mlp1_weight_EGD.dtype, nvfp4=None if ex.nvfp4 is None else ex.nvfp4.recipe,
            fp8=None if ex.fp8 is None else ex.fp8.recipe, **ex.swiglu,
        )
        out.load_full_state_dict(moe.state_dict())
        return out

    # ---- state dicts ------------------------------------------------------------------------------

    def shard_state_dict(self, full: dict) -> dict:
        """A full (:class:`moekit.MoE`-shaped) state dict -> this rank's: expert tensors sliced to
        [expert_start, expert_start + El) along dim 0, everything else as is."""
        out = {}
        for key, value in full.items():
            if key.startswith("experts."):
                if value.shape[0] != self.num_experts:
                    raise ValueError(f"ExpertParallelMoE: {key} has {value.shape[0]} experts, expected "
                                     f"{self.num_experts}")
                value = value[self.expert_start : self.expert_start + self.local_experts]
            out[key] = value
        return out

    def load_full_state_dict(self, full: dict, strict: bool = True):
        """Load a full state dict (experts (E, ...), e.g. a :class:`moekit.MoE`'s or :meth:`full_state_dict`'s)."""
        return self.load_state_dict(self.shard_state_dict(full), strict=strict)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The full state dict on every rank: expert tensors all-gathered over the group to (E, ...);
        a collective. Its keys and shapes are :class:`moekit.MoE`'s."""
        out = {}
        for key, value in self.state_dict().items():
            if key.startswith("experts."):
                parts = [torch.empty_like(value) for _ in range(self.world)]
                dist.all_gather(parts, value.contiguous(), group=self.group)
                value = torch.cat(parts)
            out[key] = value
        return out

    def sharded_state_dict(self) -> dict:
        """The state dict for ``torch.distributed.checkpoint`` (DCP): each expert tensor as a DTensor of
        the full (E, ...) shape, sharded along dim 0 over the EP group (``Shard(0)``) and viewing this
        rank's tensor; everything else (replicated) as is. Keys are :class:`moekit.MoE`'s.

        ``dcp.save(ep.sharded_state_dict(), checkpoint_id=path)`` on every rank writes one checkpoint
        (each rank its own shard; replicated tensors and EP replicas are written once), and
        ``dcp.load(sd := ep.sharded_state_dict(), checkpoint_id=path)`` at any EP size whose W divides E
        reads it in place, into the parameters themselves: no rank holds the full experts."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        group = self.group if self.group is not None else dist.group.WORLD
        mesh = DeviceMesh.from_group(group, self.expert_bias.device.type)
        out = {}
        for key, value in self.state_dict().items():
            if key.startswith("experts."):
                shape = torch.Size((self.num_experts, *value.shape[1:]))
                value = DTensor.from_local(value, mesh, [Shard(0)], run_check=False, shape=shape,
                                           stride=torch.empty(shape, device="meta").stride())
            out[key] = value
        return out

    # ---- replicated state -------------------------------------------------------------------------

    def router_parameters(self) -> list[nn.Parameter]:
        """The replicated parameters, whose gradients are per-rank partial sums."""
        return list(self.router.parameters())

    @torch.no_grad()
    def all_reduce_router_grads(self, average: bool = False) -> None:
        """Sum (or average) the router's gradients over the EP group: afterwards they equal the
        single-process gradients over all ranks' tokens (the sum). Not needed where a data-parallel
        wrapper over this group already reduces the router."""
        for p in self.router_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                if average:
                    p.grad /= self.world

    def expert_load(self) -> torch.Tensor:
        """The global load: ``tokens_per_expert`` summed over the group (a collective), so that
        :meth:`update_expert_bias` keeps ``expert_bias`` replicated."""
        load = self.tokens_per_expert.clone()
        dist.all_reduce(load, group=self.group)
        return load.float()

    # ---- forward ----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.experts.dim:
            raise ValueError(f"ExpertParallelMoE: x (..., {self.experts.dim}), got {tuple(shape)}")
        x2 = autocast(x).reshape(-1, shape[-1])
        r = self.route(x2)
        chunks = self._chunks(r, x2.shape[0])
        device = self.splits == "device"
        for c in chunks:  # everything that needs no buffer size, ahead of the host sync
            self._plan(c, device)
        send = torch.stack([torch.stack([c.plan.tokens, c.plan.pairs, torch.full_like(c.plan.tokens, c.t1 - c.t0)], 1)
                            for c in chunks])  # (C, W, 3)
        recv = _exchange_counts(send, self.group)  # (C, W, 3)
        if device:  # fixed slots need the same token count on every rank (checked on the device)
            torch._assert_async((recv[..., 2] == send[..., 2]).all(),
                                "ExpertParallelMoE: splits='device' needs the same number of tokens on every rank")
            host = None
        else:
            host = _host_splits(send[..., 0], recv[..., 0], recv[..., 1])
        scaled = self.experts.mlp2_bias_ED is None  # weights applied before the (linear) down-projection
        for i, c in enumerate(chunks):
            self._dispatch(c, x2, host and (host[0][i], host[1][i], sum(host[2][i])))
        for c in chunks:
            self._experts(c, scaled)
        outs = [self._combine(c) for c in chunks]
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        return y if y.shape == shape else y.reshape(shape)  # not a view where it need not be (FSDP2 warns)

    def _chunks(self, r: Routing, tokens: int) -> list[_Chunk]:
        bounds = [tokens * i // self.chunks for i in range(self.chunks + 1)]
        return [_Chunk(t0, t1, r.experts[t0:t1], r.weights[t0:t1])
                for t0, t1 in zip(bounds[:-1], bounds[1:], strict=True)]

    def _plan(self, c: _Chunk, device: bool) -> None:
        """The chunk's send plan, and its tokens' choices as the cells of an (S, 2K) fp32 table to send
        beside the rows: for each row, the K routing weights, then the K local expert ids + 1 as int32
        bits (0, read as id -1: the choice is on another rank). Cell (r, j) is at r*2K + j."""
        k = self.top_k
        c.plan = p = send_plan(c.experts, self.local_experts, self.world, cap=(c.t1 - c.t0) if device else None)
        col = torch.arange(k, device=p.row.device)
        c.cell = torch.cat([(p.row * 2 * k + col).reshape(-1), (p.row * 2 * k + k + col).reshape(-1)])
        ids = (p.local + 1).view(torch.float32).reshape(-1)
        c.cell_value = torch.cat([c.weights.float().reshape(-1), ids])  # (differentiable in the weights)

    def _dispatch(self, c: _Chunk, x2, host) -> None:
        """Start the chunk's all-to-alls: each token once to every rank that holds one of its experts,
        and its choices there."""
        if host is None:  # fixed slots: a rank gets each token at most once
            s = n = self.world * (c.t1 - c.t0)
            send_l = recv_l = c.pairs = None
        else:
            send_l, recv_l, c.pairs = host
            s, n = sum(send_l), sum(recv_l)
        rows = gather_token_rows(x2[c.t0 : c.t1], c.plan.send_tok[:s], c.plan.pos)  # (S, D)
        meta = ScatterRowsFn.apply(c.cell_value, c.cell, s * 2 * self.top_k).view(s, 2 * self.top_k)
        c.ex = _Exchange(self.group, s, n, send_l, recv_l)
        c.ex_meta = _Exchange(self.group, s, n, send_l, recv_l)
        c.rows = all_to_all_start(rows, c.ex)
        c.meta = all_to_all_start(meta, c.ex_meta)

    def _experts(self, c: _Chunk, scaled: bool) -> None:
        """Wait for the chunk's tokens, run this rank's experts on them as :class:`moekit.MoE` does (each
        token's choices on other ranks dropped), sum each token's local outputs, and start sending the
        sums back."""
        k = self.top_k
        x_recv = all_to_all_wait(c.rows, c.ex)  # (N, D) by source rank, each source's in token order
        meta = all_to_all_wait(c.meta, c.ex_meta)
        weights = meta[:, :k]
        ids = meta[:, k:].detach().contiguous().view(torch.int32) - 1
        d = routing_metadata(ids, self.local_experts)  # -1 (other ranks): dropped
        if c.pairs is not None:  # host splits: the rows of this rank's choices only, the others absent
            rows = c.pairs
            scale = sorted_weights(weights, d.row_of)[:rows] if scaled else None
            d = Dispatch(d.counts, d.offs, d.token_idx[:rows], torch.where(d.row_of < rows, d.row_of, -1))
            tail = "zeros"
        else:  # device splits: every choice keeps a row, those of other ranks' experts past offs[-1],
            # marked absent, so that the routing weights, the combine and their backward skip them; the
            # experts leave those rows unwritten (nothing reads them) instead of writing zeros
            d = Dispatch(d.counts, d.offs, d.token_idx, torch.where(d.row_of < d.offs[-1], d.row_of, -1))
            scale = sorted_weights(weights, d.row_of) if scaled else None
            tail = "unwritten"
        y = self.experts.routed(x_recv, d, scale, tail=tail)
        part = combine(y, None if scaled else weights, d.row_of)  # (N, D) this rank's share of each token
        c.back = c.ex.reverse()
        c.out = all_to_all_start(part, c.back)

    def _combine(self, c: _Chunk) -> torch.Tensor:
        """Wait for the chunk's partial outputs and sum each token's (at most W) shares in fp32."""
        back = all_to_all_wait(c.out, c.back)
        return combine(back, None, c.plan.pos)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, rank={self.rank}/{self.world} holds [{self.expert_start}, "
                f"{self.expert_start + self.local_experts}), top_k={self.top_k}, splits={self.splits!r}, "
                f"chunks={self.chunks}")


__all__ = ["ExpertParallelMoE", "SendPlan", "send_plan", "send_plan_ref"]
