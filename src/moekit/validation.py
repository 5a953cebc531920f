"""Input checks shared by every op: dtypes, shapes, the layout contract (a unit stride along one of
the two matrix dims, 16-byte aligned other strides and base) and, at the cost of a sync, ``offs``."""

from __future__ import annotations

import torch

IN_DTYPES = (torch.bfloat16, torch.float16)
ALIGN = 16  # bytes: TMA base/stride alignment, and the contract torch._grouped_mm has too
_AUTOCAST_FROM = (torch.float32, torch.bfloat16, torch.float16)  # what autocast casts for a matmul


def autocast(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in the dtype ``torch.autocast`` runs matmuls in on its device, as ``torch.matmul`` would take
    it (float32, bfloat16 and float16 inputs are cast; others and ``None`` pass); ``t`` itself outside
    autocast. The cast is differentiable, so fp32 parameters and inputs get fp32 gradients."""
    if t is None:
        return None
    dev = t.device.type
    if dev not in ("cuda", "cpu") or not torch.is_autocast_enabled(dev):
        return t
    dtype = torch.get_autocast_dtype(dev)
    return t.to(dtype) if t.dtype in _AUTOCAST_FROM and t.dtype != dtype else t


def check_layout(name: str, t: torch.Tensor) -> None:
    """One of the two matrix dims must have unit stride; every other stride and the base 16-byte aligned
    (an empty tensor has no layout to check)."""
    if t.numel() == 0:
        return
    item = t.element_size()
    inner = t.stride()[-2:]
    if 1 not in inner and not (t.shape[-1] <= 1 or t.shape[-2] <= 1):
        raise ValueError(
            f"grouped_mm: {name} needs a unit stride along one of its last two dims, got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}; call .contiguous() first"
        )
    unit_dim = t.dim() - 1 if t.stride(-1) == 1 else t.dim() - 2
    for d in range(t.dim()):
        if d != unit_dim and t.shape[d] > 1 and (t.stride(d) * item) % ALIGN:
            raise ValueError(
                f"grouped_mm: {name}.stride({d}) = {t.stride(d)} elements is not a multiple of "
                f"{ALIGN} bytes ({ALIGN // item} elements of {t.dtype}); pad that dim or copy"
            )
    # storage_offset() is not traceable under torch.compile; the launcher re-checks real pointers and
    # takes the pointer path for a misaligned base, so skipping it there is safe.
    if not torch.compiler.is_compiling() and (t.storage_offset() * item) % ALIGN:
        raise ValueError(
            f"grouped_mm: {name} starts {t.storage_offset()} elements into its storage, not on a "
            f"{ALIGN}-byte boundary; copy it or slice at an aligned offset"
        )


def check_inputs(a, b, offs, out_dtype) -> str:
    """Validate everything that needs no host sync; return the form ('2d3d', '2d2d', '3d3d')."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_mm: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in IN_DTYPES:
            raise TypeError(f"grouped_mm: {name} must be bfloat16 or float16, got {t.dtype}")
    if a.dtype != b.dtype:
        raise TypeError(f"grouped_mm: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if out_dtype not in (None, a.dtype, torch.float32):
        raise TypeError(f"grouped_mm: out_dtype must be None, {a.dtype} or torch.float32, got {out_dtype}")
    if a.device != b.device:
        raise ValueError(f"grouped_mm: a is on {a.device} but b is on {b.device}")
    form = f"{a.dim()}d{b.dim()}d"
    if form not in ("2d3d", "2d2d", "3d3d"):
        raise ValueError(f"grouped_mm: supported forms are 2D x 3D, 2D x 2D and 3D x 3D, got {form}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"grouped_mm: K mismatch, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if form == "3d3d":
        if offs is not None:
            raise ValueError("grouped_mm: 3D x 3D takes no offs (each batch is one group)")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"grouped_mm: batch mismatch, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    else:
        if offs is None:
            raise ValueError(f"grouped_mm: the {form} form needs offs (E,) int32")
        if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
            got = f"{offs.dtype} {offs.dim()}-D" if isinstance(offs, torch.Tensor) else type(offs).__name__
            raise TypeError(f"grouped_mm: offs must be a 1-D int32 tensor, got {got}")
        if offs.device != a.device:
            raise ValueError(f"grouped_mm: offs is on {offs.device} but a is on {a.device}")
        if offs.numel() == 0:
            raise ValueError("grouped_mm: offs must hold at least one group")
        if form == "2d3d" and offs.numel() != b.shape[0]:
            raise ValueError(f"grouped_mm: offs has {offs.numel()} entries but b has E = {b.shape[0]} groups")
    check_layout("a", a)
    check_layout("b", b)
    return form


def check_offs(offs: torch.Tensor, bound: int) -> None:
    """Check ``0 <= offs[0] <= offs[1] <= ... <= offs[-1] <= bound``. Syncs with the device."""
    ok_start = bool(offs[0] >= 0)
    ok_mono = bool((offs[1:] >= offs[:-1]).all()) if offs.numel() > 1 else True
    ok_end = bool(offs[-1] <= bound)
    if not (ok_start and ok_mono and ok_end):
        raise ValueError(
            f"grouped_mm: offs must be non-decreasing cumulative ends within [0, {bound}], got {offs.tolist()}"
        )



def unit_columns(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit column stride, for the elementwise and row kernels that take only a row stride:
    copied only when its columns are strided (a column-major gradient, say)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def matrix_ready(t: torch.Tensor) -> torch.Tensor:
    """Gradients can arrive expanded (stride 0) or misaligned; copy only then (shape-level test, so
    it also traces under torch.compile)."""
    item = t.element_size()
    if 1 in t.stride()[-2:] and (t.storage_offset() * item) % ALIGN == 0:
        unit = t.dim() - 1 if t.stride(-1) == 1 else t.dim() - 2
        if all((t.stride(d) * item) % ALIGN == 0 for d in range(t.dim()) if d != unit):
            return t
    return t.contiguous()


# --------------------------------------------------------------------------------------------------
# custom op + autograd
