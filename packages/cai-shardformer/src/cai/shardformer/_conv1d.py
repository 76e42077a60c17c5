"""GPT-2's `Conv1D` (a linear layer whose weight is stored (in, out), `y = x @ W + b`) as column- and row-parallel
layers, with Colossal-AI's names.

The weight keeps Conv1D's orientation and state-dict key, so a sharded GPT-2 saves and loads the Hugging Face layout:
the column layer splits weight dim 1 (the output features) and the row layer weight dim 0 (the input features). The
computation is the parent's: `_linear_weight()` hands `F.linear` the transposed view, so sequence parallelism,
replicated heads and the tp regions behave exactly as in `Linear1D_Col` / `Linear1D_Row`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cai.shardformer._layout import take_rows
from cai.shardformer._linear import FusedLinear1D_Col, Linear1D_Row


def _conv1d_shape(module: nn.Module) -> tuple[int, int]:
    if module.weight.dim() != 2:
        raise ValueError(
            f"{type(module).__name__}: a Conv1D weight is 2-D (in, out), got {tuple(module.weight.shape)}"
        )
    in_features, out_features = module.weight.shape
    return in_features, out_features


class GPT2FusedLinearConv1D_Col(FusedLinear1D_Col):
    """Column-parallel GPT-2 `Conv1D`; weight (in, out / tp). For GPT-2's fused `c_attn` ([q | k | v] along the
    output features) pass `split_sizes=[h, h, h]` and `num_heads=[n, n, n]`: each rank then holds its heads of q,
    of k and of v (three pieces, see [Note: pieces]); without `split_sizes` the output features are one block
    (the MLP's `c_fc`)."""

    split_dims = {"weight": 1, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, **kw):
        super().__init__(in_features, out_features, bias, dtype, device, **kw)
        rows = self.weight.shape[0]
        self.weight = nn.Parameter(
            torch.empty(in_features, rows, dtype=dtype, device=device)
        )  # (in, out / tp)

    def _linear_weight(self) -> torch.Tensor:
        return self.weight.t()

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group=None, *, split_sizes: list[int] | None = None, **kw
    ):
        """The column-parallel layer holding this rank's output columns of a Conv1D's weight and bias."""
        in_features, out_features = _conv1d_shape(module)
        new = cls(
            in_features, out_features, bias=module.bias is not None, dtype=module.weight.dtype,
            device=module.weight.device, process_group=process_group, split_sizes=split_sizes, **kw,
        )  # fmt: skip
        mine = new.pieces("weight", dist.get_rank(new.process_group))
        with torch.no_grad():
            new.weight.copy_(take_rows(module.weight, mine, new.weight.shape[1], 1))
            if new.bias is not None:
                new.bias.copy_(take_rows(module.bias, mine, new.bias.shape[0], 0))
        new.weight.requires_grad_(module.weight.requires_grad)
        return new


class GPT2FusedLinearConv1D_Row(Linear1D_Row):
    """Row-parallel GPT-2 `Conv1D` (`c_proj`); weight (in / tp, out), bias whole and added once after the
    reduction. `num_heads` keeps whole heads on a rank, as in `Linear1D_Row`."""

    split_dims = {"weight": 0, "bias": None}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, **kw):
        super().__init__(in_features, out_features, bias, dtype, device, **kw)
        cols = self.weight.shape[1]
        self.weight = nn.Parameter(
            torch.empty(cols, out_features, dtype=dtype, device=device)
        )  # (in / tp, out)

    def _linear_weight(self) -> torch.Tensor:
        return self.weight.t()

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, **kw):
        """The row-parallel layer holding this rank's input rows of a Conv1D's weight (the bias whole)."""
        in_features, out_features = _conv1d_shape(module)
        new = cls(
            in_features, out_features, bias=module.bias is not None, dtype=module.weight.dtype,
            device=module.weight.device, process_group=process_group, **kw,
        )  # fmt: skip
        mine = new.pieces("weight", dist.get_rank(new.process_group))
        with torch.no_grad():
            new.weight.copy_(take_rows(module.weight, mine, new.weight.shape[0], 0))
            if new.bias is not None:
                new.bias.copy_(module.bias)
        return new
