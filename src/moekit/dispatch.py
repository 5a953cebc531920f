"""moekit's custom ops: a ``torch.library`` op for ``torch.compile``, a direct call in eager mode.

``torch.library.custom_op`` dispatch costs host time on every call (the dispatcher, the generated
autograd function, default filling and schema checks): 0.15–0.35 ms per call measured on the H100's
and the H200's hosts (docs/design.md, section 9), as much as many of the block's kernels take on the
GPU. :func:`custom_op` registers the same op, and a call goes

- under ``torch.compile`` (``torch.compiler.is_compiling()``), and whenever something traces or
  intercepts the call (a tensor subclass among the arguments, such as AOTAutograd's fake and
  functional tensors or a DTensor, or an active ``TorchDispatchMode``): through the registered op,
  with its fake and its registered autograd;
- in eager mode, grad mode on, an input requiring grad and an autograd formula registered: through
  an ``autograd.Function`` that runs the implementation, then the registered ``setup_context`` and,
  on the way back, ``backward`` (what the op's generated autograd function runs, without the
  dispatcher);
- in eager mode with an input requiring grad and no formula registered: through the op, which
  raises on backward, as torch.library ops do;
- otherwise: straight to the implementation.

The eager and compiled paths run the same implementation, so they give the same bits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

_NO_DEFAULT = inspect.Parameter.empty


PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _eager(args) -> bool:
    """Plain eager execution: not compiling, no dispatch mode active (``moekit.plans``' recorder, which
    sees the ops beneath, aside), only plain tensors."""
    if torch.compiler.is_compiling():
        return False
    modes = torch._C._len_torch_dispatch_stack()
    if modes and not (modes == 1 and getattr(torch._C._get_dispatch_stack_at(0), "moekit_recorder", False)):
        return False
    return all(type(a) in PLAIN_TYPES for a in args if isinstance(a, torch.Tensor))


def _requires_grad(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class CustomOp:
    """A ``torch.library.custom_op`` (``.op``) with its implementation (``.impl``); calling it
    dispatches as the module docstring says. ``register_fake`` and ``register_autograd`` register on
    the op and keep what the eager path needs. Calls take positional arguments only."""

    def __init__(self, name: str, fn: Callable, mutates_args=()):
        self.name = name
        self.op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        self.impl = fn
        params = list(inspect.signature(fn).parameters.values())
        self._arity = len(params)
        self._defaults = tuple(p.default for p in params)
        self._function: type[torch.autograd.Function] | None = None

    def register_fake(self, fn: Callable) -> Callable:
        self.op.register_fake(fn)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        def forward(ctx, *args):
            out = impl(*args)
            setup_context(ctx, args, out)
            return out

        name = "".join(part.title() for part in self.name.split("::")[-1].split("_")) + "Fn"
        self._function = type(name, (torch.autograd.Function,),
                              {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def _filled(self, args: tuple) -> tuple:
        if len(args) == self._arity:
            return args
        rest = self._defaults[len(args):]
        if len(args) > self._arity or any(d is _NO_DEFAULT for d in rest):
            raise TypeError(f"{self.name}: takes {self._arity} positional arguments, got {len(args)}")
        return (*args, *rest)

    def __call__(self, *args):
        if not _eager(args):
            return self.op(*args)
        args = self._filled(args)
        if torch.is_grad_enabled() and _requires_grad(args):
            if self._function is None:  # no formula: the op's own behaviour (an error on backward)
                return self.op(*args)
            return self._function.apply(*args)
        return self.impl(*args)


def custom_op(name: str, *, mutates_args=()) -> Callable[[Callable], CustomOp]:
    """Decorator: ``@custom_op("moekit::name")`` over the implementation, as
    ``torch.library.custom_op`` (type-annotated arguments, a fake registered on the result)."""

    def wrap(fn: Callable) -> CustomOp:
        return CustomOp(name, fn, mutates_args)

    return wrap


def traced_or_eager(op: Callable, launcher: Callable, *args):
    """``op`` (a registered custom op without autograd) while torch.compile traces, else ``launcher``
    itself: in eager mode the custom-op dispatch costs host time comparable to a small kernel."""
    return (op if torch.compiler.is_compiling() else launcher)(*args)


__all__ = ["PLAIN_TYPES", "CustomOp", "custom_op", "traced_or_eager"]
