"""Linear projections of one input (an attention's q, k and v): one autograd function for all of them, whose
backward accumulates the input's gradient inside the matmuls.

[Note: shared-input projections]
Autograd sums the input gradients of ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` in separate passes over a
tokens x hidden tensor (two adds a layer, each reading two such tensors and writing one). Computing the three
projections in one function lets its backward form ``dx = dq @ Wq`` and add ``dk @ Wk`` and ``dv @ Wv`` into it
with ``addmm_`` (beta 1), where each product's epilogue reads the partial sum once: the adds' other read and their
writes are gone. The products, and what backward keeps (``x`` and the weights), are those of the separate layers.

The attention's forward calls its projections one after the other, so :func:`share_input` gives each projection a
``forward`` (an instance attribute; the modules stay plain ``nn.Linear``, so state dicts, FP8 conversion, tensor
parallel policies and inference fusion see what they saw). The first projection called with an input computes all
of them and hands the others their outputs when they are called with the same input (same tensor, same version,
weights unchanged). It falls back to the plain ``F.linear`` of its own module when the shared path would not be
exact or would not pay: another module has replaced one of the projections (a parallel or FP8 layer), a projection
has hooks (Gemini gathers a module's chunk in its forward pre-hook), the input needs no gradient, autocast is on,
dtypes differ, or torch.compile is tracing (Inductor schedules the adds itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["share_input"]


class _SharedInputLinear(torch.autograd.Function):
    """``[x @ w.T + b for w, b in ...]`` with one gradient for ``x`` accumulated by ``addmm_``."""

    @staticmethod
    def forward(ctx, x, n, *params):
        weights, biases = params[:n], params[n:]
        x2d = x.reshape(-1, x.shape[-1])
        outs = []
        for w, b in zip(weights, biases):
            y = x2d @ w.T if b is None else torch.addmm(b, x2d, w.T)
            outs.append(y.view(*x.shape[:-1], w.shape[0]))
        ctx.save_for_backward(x2d, *weights)
        ctx.shape, ctx.n, ctx.has_bias = x.shape, n, [b is not None for b in biases]
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x2d, *weights = ctx.saved_tensors
        n = ctx.n
        need_x, need = ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
        dx, dws, dbs = None, [None] * n, [None] * n
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:  # an output that got no gradient
                continue
            g2d = g.reshape(-1, g.shape[-1])
            if need_x:
                dx = g2d @ w if dx is None else dx.addmm_(g2d, w)
            if need[i]:
                dws[i] = g2d.T @ x2d
            if ctx.has_bias[i] and need[n + i]:
                dbs[i] = g2d.sum(0)
        if dx is not None:
            dx = dx.view(ctx.shape)
        return (dx, None, *dws, *dbs)


def has_hooks(m: nn.Module) -> bool:
    """Whether a module hook, ``m``'s own or a global one, would see ``m`` called."""
    from torch.nn.modules import module as hooks

    return bool(
        m._forward_pre_hooks
        or m._forward_hooks
        or m._backward_pre_hooks
        or m._backward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_backward_pre_hooks
        or hooks._global_backward_hooks
    )


class _Group:
    """The projections ``names`` of ``owner`` (see the module note). Holds the outputs computed for projections
    not yet called, keyed by the input they were computed from."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        self.owner = owner
        self.names = names
        self.pending: dict[str, tuple[torch.Tensor, int, tuple[int, ...], torch.Tensor]] = {}

    def members(self, x: torch.Tensor) -> list[nn.Linear] | None:
        """The projections, if the shared path applies to input ``x`` now; else None."""
        if not (torch.is_grad_enabled() and x.requires_grad and x.numel() > 0):
            return None
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
            return None
        mods = []
        for name in self.names:
            m = getattr(self.owner, name, None)
            own = m.__dict__.get("forward") if isinstance(m, nn.Module) else None
            if (
                type(m) is not nn.Linear
                or not isinstance(own, _Forward)
                or own.group is not self
                or has_hooks(m)
            ):
                return None
            if m.weight.dtype != x.dtype or m.weight.device != x.device:
                return None
            if m.bias is not None and m.bias.dtype != x.dtype:
                return None
            mods.append(m)
        return mods

    def forward(self, module: nn.Linear, name: str, x: torch.Tensor) -> torch.Tensor:
        kept = self.pending.pop(name, None)
        if kept is not None:
            kx, version, weight_versions, out = kept
            if kx is x and x._version == version and weight_versions == _versions(module):
                return out
        mods = self.members(x)
        if mods is None or getattr(self.owner, name) is not module:
            return F.linear(x, module.weight, module.bias)
        params = [m.weight for m in mods] + [m.bias for m in mods]
        outs = _SharedInputLinear.apply(x, len(mods), *params)
        for other, m, out in zip(self.names, mods, outs):
            if m is not module:
                self.pending[other] = (x, x._version, _versions(m), out)
        return outs[mods.index(module)]


def _versions(m: nn.Linear) -> tuple[int, ...]:
    return (m.weight._version,) + ((m.bias._version,) if m.bias is not None else ())


class _Forward:
    """The ``forward`` of one projection of a group: an instance attribute of its ``nn.Linear``. If the module's
    class has been changed since (``convert_to_fp8`` turns Linear layers into ``Fp8Linear`` in place), the class's
    own forward runs."""

    def __init__(self, group: _Group, module: nn.Linear, name: str) -> None:
        self.group = group
        self.module = module
        self.name = name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.module) is not nn.Linear:
            return type(self.module).forward(self.module, x)
        return self.group.forward(self.module, self.name, x)


def share_input(module: nn.Module, names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")) -> bool:
    """Give ``module``'s projections ``names`` (plain ``nn.Linear`` children with one input size) the shared-input
    forward of [Note: shared-input projections], in place; True if they have it now."""
    mods = [getattr(module, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in mods) or len({m.in_features for m in mods}) != 1:
        return False
    if all(isinstance(m.__dict__.get("forward"), _Forward) for m in mods):
        return True
    group = _Group(module, tuple(names))
    for name, m in zip(names, mods):
        m.forward = _Forward(group, m, name)
    return True
