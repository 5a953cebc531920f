"""NVFP4 training of the expert MLPs: NVIDIA's NVFP4 pretraining recipe, emulated on bf16 GEMMs.

Each expert GEMM ``y = x @ W[g]`` (a :class:`NVFP4GroupedLinear`) runs its three GEMMs on NVFP4 operands:

- forward ``y = x @ W``: x in 1x16 blocks along K (round to nearest), W in 16x16 blocks
  (``TrainingRecipe.weight_block_2d``), so that the same quantized W serves ``W^T`` in the dgrad;
- dgrad ``dx = dy @ W^T``: dy in 1x16 blocks along N, stochastically rounded;
- wgrad ``dW[g] = x^T dy`` over the expert's rows: both operands in 1x16 blocks along the rows (the
  reduction), dy stochastically rounded, both first rotated by the same random Hadamard transform of
  size 16 along the rows (``hadamard16``), which spreads outliers over each block and cancels in the
  product. Each expert's rows are padded to a multiple of 16 (on the device: rows move to a buffer
  sized by the static bound M + 15 E), so that no block or rotation mixes two experts.

Emulation: an operand decodes to bf16 without its global scale (an e2m1 value times an e4m3 scale is
exact in bf16), the GEMM runs in bf16 with fp32 accumulation (``moekit.grouped_mm``: the Triton kernels
on CUDA, the reference on CPU) and the product of the two global scales multiplies the fp32 result:
the arithmetic of an NVFP4 tensor-core GEMM, up to the accumulation order. Global scales are per
tensor, computed on the device; nothing syncs with the host. Master weights and their gradients keep
the parameters' dtype; the bias, SwiGLU and routing weights stay in the activation dtype.

Stochastic rounding draws from ``nvfp4.quantize``'s Philox stream: each module owns a seed and a
counter that advances by the Philox counters each stochastically rounded tensor uses (numel / 4, host
integers), so a run started from the same seeds is reproducible. Limits of that host counter:
- a CUDA graph captured over a step replays the captured counters, so every replay rounds with the
  same random bits (the noise is frozen, not averaged out over steps);
- the counter and a drawn seed are not in the state dict, so a resumed run does not continue the
  stream;
- data-parallel replicas seeded alike draw the same bits; give each rank its own ``seed``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..grouped_gemm import grouped_mm
from ..quantized import QuantizedExperts, cached_weight, recipe_of, row_experts
from . import formats as nvfp4
from .gemm import grouped_mm_nvfp4_wgrad

HADAMARD = 16  # the rotation's size: one NVFP4 block


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """What the NVFP4 expert GEMMs quantize, and how (NVIDIA's recipe by default).

    - ``weight_block_2d``: weights in 16x16 blocks (one quantization for W and W^T), else 1x16 blocks
      along each GEMM's reduction dim (W requantized along N for the dgrad);
    - ``stochastic_rounding``: gradients rounded stochastically (else to nearest); activations and
      weights always round to nearest;
    - ``random_hadamard``: the wgrad operands rotated by ``hadamard16`` along the rows;
    - ``seed``: the seed of the stochastic rounding and of the Hadamard signs; None draws one from
      torch's global generator when a module is built (reproducible under ``torch.manual_seed``; it
      advances that generator, so weights initialized after it differ from a build without NVFP4).
    Activations are always quantized in 1x16 blocks.
    """

    weight_block_2d: bool = True
    stochastic_rounding: bool = True
    random_hadamard: bool = True
    seed: int | None = None

    def __post_init__(self):
        """Checked here, not at the first forward or backward: a flag given as a string ("no") would read as
        true, and a seed outside Philox's [0, 2^63) fails only at the first stochastically rounded gradient."""
        for name in ("weight_block_2d", "stochastic_rounding", "random_hadamard"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"TrainingRecipe: {name} must be a bool, got {type(v).__name__} {v!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"TrainingRecipe: seed must be None or an int in [0, 2^63) (a Philox seed), got {seed!r}")


# --------------------------------------------------------------------------------------------------
# the random Hadamard transform
# --------------------------------------------------------------------------------------------------


def hadamard_matrix(n: int = HADAMARD, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """The (n, n) Sylvester Hadamard matrix (entries +-1, n a power of two), symmetric, H H^T = n I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_signs(seed: int, *, device=None) -> torch.Tensor:
    """(16,) fp32 random +-1 from ``seed`` (a CPU generator, so every device gets the same signs)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)  # device= too: a default device may be set
    return (torch.randint(0, 2, (HADAMARD,), generator=gen, device="cpu") * 2 - 1).float().to(device)


def hadamard16(x: torch.Tensor, signs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """The random Hadamard transform of size 16 over each block of 16 along the last dim:
    x (..., K), K % 16 == 0, signs (16,) of +-1 -> x_b @ Q for each block x_b, Q = diag(signs) H / 4,
    orthonormal (Q Q^T = I), so that (x Q) . (y Q) = x . y over a reduction along the last dim.
    ``inverse``: x_b @ Q^T. Computed in fp32 (fp64 for fp64 input), returned in x's dtype. A torch op
    (a (..., 16) @ (16, 16) matmul) on every device."""
    if x.shape[-1] % HADAMARD:
        raise ValueError(f"hadamard16: the last dim must be a multiple of {HADAMARD}, got {tuple(x.shape)}")
    if signs.shape != (HADAMARD,):
        raise ValueError(f"hadamard16: signs must be ({HADAMARD},), got {tuple(signs.shape)}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = signs.to(cdt)[:, None] * hadamard_matrix(device=x.device, dtype=cdt) * 0.25  # (16, 16)
    blocks = x.to(cdt).contiguous().view(-1, HADAMARD)  # one (rows, 16) @ (16, 16) GEMM
    return (blocks @ (q.T if inverse else q)).view(x.shape).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# emulated NVFP4 operands
# --------------------------------------------------------------------------------------------------


def _decode(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """NVFP4 values and block scales -> bf16 without the global scale: exact (e2m1 x e4m3 fits bf16)."""
    one = torch.ones((), dtype=torch.float32, device=values.device)
    return nvfp4.dequantize(values, scales, one, dtype=torch.bfloat16)


def _quantize_codes(x: torch.Tensor, stochastic: bool, stream: RandomStream | None):
    """x (..., K) along K -> (values, scales, global scale), stochastically rounded on ``stream``'s next
    words if asked."""
    if stochastic:
        return nvfp4.quantize(x, rounding="stochastic", seed=stream.seed, offset=stream.take(x.numel() // 4))
    return nvfp4.quantize(x)


def _quantize(x: torch.Tensor, stochastic: bool, stream: RandomStream | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) along K -> (decoded bf16 (..., K), global scale fp32 0-dim)."""
    values, scales, g = _quantize_codes(x, stochastic, stream)
    return _decode(values, scales), g


def _quantize_weights(w: torch.Tensor, block_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, K, N) along K -> (decoded (E, N, K) bf16, global scales (E,) fp32, one per expert); once per
    ``moekit.weight_cache`` scope."""
    return cached_weight(w, ("nvfp4", block_2d), lambda t: _quantize_weights_now(t, block_2d))


def _quantize_weights_now(w: torch.Tensor, block_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    values, scales, g = nvfp4.quantize_weights(w, block_2d=block_2d)
    return _decode(values, scales), g


class RandomStream:
    """A seed and a counter of the Philox stream: ``take(n)`` returns the counter and moves it by n."""

    def __init__(self, seed: int):
        self.seed, self.offset = seed, 0

    def take(self, n: int) -> int:
        offset, self.offset = self.offset, self.offset + n
        return offset


def padded_rows(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each expert's rows moved to start at a multiple of 16: offs (E,) int32 cumulative ends over
    ``rows`` rows -> (dest (rows,) int64: each row's place, ``bound`` for rows past offs[-1];
    padded_offs (E,) int32; bound = rows + 15 E rounded up to 16, the padded row count). On the device."""
    e = offs.numel()
    bound = -(-(rows + (HADAMARD - 1) * e) // HADAMARD) * HADAMARD
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).clamp(min=0)
    padded = (counts + HADAMARD - 1) // HADAMARD * HADAMARD
    padded_ends = padded.cumsum(0)
    shift = F.pad((padded_ends - padded) - (ends - counts), (0, 1))  # padded start - start; the extra: unused
    expert = row_experts(offs, rows)
    dest = torch.arange(rows, device=offs.device) + shift[expert]
    return torch.where(expert < e, dest, bound), padded_ends.to(torch.int32), bound


def _to_padded(t: torch.Tensor, dest: torch.Tensor, bound: int) -> torch.Tensor:
    """t (rows, C) -> (C, bound) fp32: rows scattered to their padded places (zeros between), transposed
    so that the rows are the last dim (the quantization and rotation axis)."""
    out = t.new_zeros(bound + 1, t.shape[1], dtype=torch.float32)  # the last row takes rows past offs[-1]
    out.index_copy_(0, dest, t.float())
    return out[:bound].T


# --------------------------------------------------------------------------------------------------
# the NVFP4 grouped GEMM with its backward
# --------------------------------------------------------------------------------------------------


def _zero_tail(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """t (M, ...) with its rows at or past offs[-1] (no expert's) set to 0, on the device: whatever they
    hold must not move a per-tensor global scale, since the GEMMs ignore them."""
    keep = torch.arange(t.shape[0], device=t.device) < offs[-1:]  # (M,)
    return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, 0)


class NVFP4GroupedLinearFn(torch.autograd.Function):
    """x (M, K) expert-sorted rows, w (E, K, N) (any strides), offs (E,) int32 -> (M, N) in x's dtype,
    the three GEMMs on NVFP4 operands as ``TrainingRecipe`` says; rows past offs[-1] are 0."""

    @staticmethod
    def forward(ctx, x, w, offs, recipe, signs, stream):
        x = _zero_tail(x, offs)  # rows past offs[-1] stay out of the global scale
        xd, gx = _quantize(x, False, None)  # (M, K)
        wd, gw = _quantize_weights(w, recipe.weight_block_2d)  # (E, N, K), (E,)
        gw_rows = F.pad(gw, (0, 1))[row_experts(offs, x.shape[0])]  # (M,): rows past offs[-1] are 0 anyway
        y = grouped_mm(xd, wd.mT, offs, out_dtype=torch.float32) * (gx * gw_rows)[:, None]
        ctx.save_for_backward(x, None if recipe.weight_block_2d else w, wd, gw_rows, offs, signs)
        ctx.recipe, ctx.stream, ctx.w_dtype = recipe, stream, w.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, wd, gw_rows, offs, signs = ctx.saved_tensors
        recipe, stream = ctx.recipe, ctx.stream
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy = _zero_tail(dy, offs)
            dyd, gdy = _quantize(dy, recipe.stochastic_rounding, stream)  # (M, N) along N
            if not recipe.weight_block_2d:  # 1x16 blocks along N for W^T: w.mT (E, N, K) quantized along N
                wd, gw = _quantize_weights(w.mT, False)  # (E, K, N)
                wd, gw_rows = wd.mT, F.pad(gw, (0, 1))[row_experts(offs, x.shape[0])]
            dx = grouped_mm(dyd, wd, offs, out_dtype=torch.float32) * (gdy * gw_rows)[:, None]
            dx = dx.to(x.dtype)
        if ctx.needs_input_grad[1]:
            dest, padded_offs, bound = padded_rows(offs, x.shape[0])
            xt, dyt = _to_padded(x, dest, bound), _to_padded(dy, dest, bound)  # (K, Mp), (N, Mp)
            if recipe.random_hadamard:
                xt, dyt = hadamard16(xt, signs), hadamard16(dyt, signs)
            xq = nvfp4.quantize(xt)
            dyq = _quantize_codes(dyt, recipe.stochastic_rounding, stream)
            dw = grouped_mm_nvfp4_wgrad(*xq, *dyq, padded_offs, out_dtype=torch.float32).to(ctx.w_dtype)  # (E, K, N)
        return dx, dw, None, None, None, None


class NVFP4Training(QuantizedExperts):
    """The NVFP4 precision of one :class:`moekit.GroupedExperts` (``moekit.quantized``'s interface): its
    recipe, the Hadamard signs (a non-persistent buffer: state dicts do not change) and the
    stochastic-rounding stream."""

    def __init__(self, recipe: TrainingRecipe, device=None):
        super().__init__()
        seed = recipe.seed if recipe.seed is not None else int(torch.randint(0, 2**62, (1,)))
        self.recipe = dataclasses.replace(recipe, seed=seed)
        self.stream = RandomStream(seed)
        self.register_buffer("signs", random_signs(seed, device=device), persistent=False)

    def reset_parameters(self) -> None:
        """The Hadamard signs again from the recipe's seed, and the rounding stream from its start (a
        meta-device build needs it after ``to_empty``: the signs are a buffer no checkpoint holds)."""
        with torch.no_grad():
            self.signs.copy_(random_signs(self.recipe.seed, device=self.signs.device))
        self.stream = RandomStream(self.recipe.seed)

    @staticmethod
    def build(nvfp4_arg, device=None) -> NVFP4Training | None:
        """``GroupedExperts(nvfp4=...)``: None / False -> None, True -> the default recipe, a recipe."""
        recipe = recipe_of(nvfp4_arg, TrainingRecipe, "nvfp4")
        return None if recipe is None else NVFP4Training(recipe, device)

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ w (E, K, N) per expert on NVFP4 operands -> (M, N)."""
        return NVFP4GroupedLinearFn.apply(x, w, offs, self.recipe, self.signs, self.stream)

    def extra_repr(self) -> str:
        return str(self.recipe)


__all__ = [
    "NVFP4GroupedLinearFn", "NVFP4Training", "RandomStream", "TrainingRecipe", "hadamard16", "hadamard_matrix",
    "padded_rows", "random_signs", "row_experts",
]
