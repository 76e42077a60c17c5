"""`enable_fused_normalization` for LayerNorm: every `torch.nn.LayerNorm` (or subclass that keeps its forward)
becomes cai-kernels' `LayerNorm` holding the same `weight` and `bias` Parameters, so state-dict keys, tied or
shared references and optimizer bindings stay as they were. RMSNorm goes through cai-kernels' `patch_hf_model`."""

from __future__ import annotations

from torch import nn

from cai.kernels import LayerNorm


def fuse_layer_norms(model: nn.Module) -> int:
    """Swap the LayerNorms of `model` in place; return how many. Norms over more than the last dim, without an
    affine weight, or whose class overrides `forward` (a different formula) are left alone."""
    count = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.LayerNorm) or type(mod).forward is not nn.LayerNorm.forward:
            continue
        if len(mod.normalized_shape) != 1 or mod.weight is None:
            continue
        new = LayerNorm(mod.normalized_shape[0], mod.eps, bias=mod.bias is not None, device="meta")
        new.weight = mod.weight
        if mod.bias is not None:
            new.bias = mod.bias
        new.train(mod.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        count += 1
    return count
