"""Column- and row-parallel linear layers (Megatron), built from a plain `nn.Linear` by `from_native_module`.

Parameters keep the names `weight` and `bias`, so a model's state-dict keys do not change; their values are
this rank's shard (see [Note: pieces] in `_layout` for where the rows sit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cai.kernels import fp8_linear
from cai.shardformer._layout import Piece, column_pieces, gather_rows, local_rows, replica_group, take_rows
from cai.shardformer._ops import (
    copy_to_tp_region,
    gather_from_tp_region,
    gather_seq,
    reduce_from_tp_region,
    reduce_grad,
    reduce_scatter_seq,
    scatter_to_tp_region,
)
from cai.shardformer._ring import ring_column_linear, ring_row_linear
from cai.shardformer._sequence import saving_only_the_slice

# The layer-level modes: the same layout, ring overlaps the communication with the matmul.
SEQ_PARALLEL_MODES = ("split_gather", "ring")


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


def _check_sp(mode):
    if mode is not None and mode not in SEQ_PARALLEL_MODES:
        raise ValueError(f"seq_parallel_mode={mode!r}; the layers support {SEQ_PARALLEL_MODES} or None")


def _linear(layer: Linear1D_Col | Linear1D_Row, x, weight, bias=None) -> torch.Tensor:
    """The layer's local product: in FP8 in training once ``enable_fp8`` has set ``layer.fp8``."""
    if layer.fp8 and layer.training:
        # row-wise: one scale per row is the same on every shard of a split weight, one per tensor would not be
        return fp8_linear(x, weight, bias, recipe="rowwise")
    return F.linear(x, weight, bias)


def enable_fp8(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Run the local matmuls (forward and both backward products) of ``model``'s column- and row-parallel layers in
    FP8 with row-wise dynamic scales (``cai.kernels.fp8_linear(recipe="rowwise")``: a per-tensor scale would differ
    between shards) in training; returns how many layers.

    Skipped, as by ``cai.kernels.convert_to_fp8``: names ending in one of ``skip`` (the output head) and layers whose
    local features are not multiples of 16. The communication around the products stays in the working dtype. A
    row-parallel layer's scales cover its own slice of the input features, so its rounding differs slightly from the
    unsharded layer's; column-parallel layers quantise exactly as unsharded. Ring sequence parallelism multiplies
    inside its ring and raises.
    """
    count = 0
    for name, m in model.named_modules():
        if not isinstance(m, (Linear1D_Col, Linear1D_Row)) or name.split(".")[-1] in skip:
            continue
        out_features, in_features = m._linear_weight().shape
        if in_features % 16 or out_features % 16:
            continue
        if m.seq_parallel_mode == "ring":
            raise ValueError(
                f"enable_fp8: {name} multiplies inside the sequence ring, which has no FP8 path; use "
                "sequence_parallelism_mode='split_gather' with FP8"
            )
        m.fp8 = True
        count += 1
    return count


class ParallelModule(nn.Module):
    """A layer whose parameters are shards of global tensors. `full_tensor(name, local)` gathers the global
    tensor of parameter `name` (or of its gradient, passed as `local`) on every rank of the tp group."""

    split_dims: dict[str, int | None] = {}  # parameter name -> dim it is split along, None if replicated

    def pieces(self, name: str, rank: int) -> list[Piece]:
        raise NotImplementedError

    def full_size(self, name: str) -> int:
        raise NotImplementedError

    def full_tensor(self, name: str, local: torch.Tensor | None = None) -> torch.Tensor:
        local = getattr(self, name) if local is None else local
        dim = self.split_dims.get(name)
        if dim is None:
            return local.detach().clone()
        return gather_rows(
            local, lambda r: self.pieces(name, r), self.full_size(name), dim, self.process_group
        )


class Linear1D_Col(ParallelModule):
    """`y = x @ W.T + b` with W split by output features (rows); x replicated on the tp ranks.

    `gather_output` all-gathers the output features; otherwise each rank returns its slice. With
    `reduce_input_grad=False` the caller has put x into the tp region already (one gradient all-reduce for
    several column layers that read the same x, as q, k and v do); `seq_parallel_mode="split_gather"` takes x
    split along `seq_parallel_dim` and all-gathers it (gradient reduce-scattered; only the slice is kept for
    backward, which gathers it again), `"ring"` multiplies the slices as they go round the group instead of
    gathering them (see [Note: ring steps]). `num_heads` keeps heads
    whole on a rank and replicates them when there are fewer heads than ranks (GQA kv heads).
    """

    split_dims = {"weight": 0, "bias": 0}
    fp8 = False  # the local product in FP8 (``enable_fp8``)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        process_group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        skip_bias_add: bool = False,
        reduce_input_grad: bool = True,
        split_sizes: list[int] | None = None,
        num_heads: int | list[int] | None = None,
    ):
        super().__init__()
        _check_sp(seq_parallel_mode)
        self.in_features, self.out_features = in_features, out_features
        self.process_group = _group(process_group)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.seq_parallel_mode, self.seq_parallel_dim = seq_parallel_mode, seq_parallel_dim
        self.reduce_input_grad = reduce_input_grad
        self.sp_region = None  # ring mode inside a policy's region: see `_sequence.RingRegion`
        sizes = list(split_sizes) if split_sizes is not None else [out_features]
        if sum(sizes) != out_features:
            raise ValueError(f"split_sizes {sizes} sum to {sum(sizes)}, not out_features={out_features}")
        heads = num_heads if isinstance(num_heads, list) else [num_heads] * len(sizes)
        if len(heads) != len(sizes):
            raise ValueError(f"num_heads {num_heads} must give one head count per split of {sizes}")
        self._splits = list(zip(sizes, heads))
        tp, rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        self._tp = tp
        mine = self.pieces("weight", rank)
        rows = local_rows(mine)
        if gather_output and any(p.replicated for p in mine):
            raise ValueError(
                "gather_output=True with replicated heads is not supported; gather per split instead"
            )
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        # Replicated heads see only their share of the query heads on each rank: their gradients are summed
        # over the ranks holding the same head (see the replicated-kv bullet in DESIGN.md).
        replicas = [p for p in mine if p.replicated]
        self._replicated = [(p.local, p.length) for p in replicas]
        self._replica_group = None
        if replicas:
            n_heads = next(h for (s, h) in self._splits if h is not None and tp % h == 0 and h < tp)
            self._replica_group = replica_group(self.process_group, tp // n_heads)

    def pieces(self, name: str, rank: int) -> list[Piece]:
        return column_pieces(self._splits, self._tp, rank, what=f"{type(self).__name__}.{name}")

    def full_size(self, name: str) -> int:
        return self.out_features

    @classmethod
    def from_native_module(cls, module: nn.Linear, process_group: dist.ProcessGroup | None = None, **kw):
        """The column-parallel layer holding this rank's rows of `module`'s weight and bias."""
        new = cls(
            module.in_features, module.out_features, bias=module.bias is not None, dtype=module.weight.dtype,
            device=module.weight.device, process_group=process_group, **kw,
        )  # fmt: skip
        rank = dist.get_rank(new.process_group)
        mine = new.pieces("weight", rank)
        with torch.no_grad():
            new.weight.copy_(take_rows(module.weight, mine, new.weight.shape[0], 0))
            if new.bias is not None:
                new.bias.copy_(take_rows(module.bias, mine, new.bias.shape[0], 0))
        new.weight.requires_grad_(module.weight.requires_grad)
        return new

    def _linear_weight(self) -> torch.Tensor:
        """The weight as (out, in) for `F.linear` (GPT-2's Conv1D layers store it transposed)."""
        return self.weight

    def ring_weight(self) -> torch.Tensor:
        """The weight as the forward multiplies it (replicated heads' gradients summed over their replicas)."""
        return self._with_replica_grads(self._linear_weight())

    def _with_replica_grads(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self._replica_group is None:
            return t
        parts, at = [], 0
        for start, length in self._replicated:
            if start > at:
                parts.append(t[at:start])
            parts.append(reduce_grad(t[start : start + length], self._replica_group))
            at = start + length
        if at < t.shape[0]:
            parts.append(t[at:])
        return torch.cat(parts)

    def forward(self, x: torch.Tensor):
        weight = self._with_replica_grads(self._linear_weight())
        bias = self._with_replica_grads(self.bias)
        add_bias = None if self.skip_bias_add else bias
        dim, group = self.seq_parallel_dim, self.process_group
        if self.seq_parallel_mode == "ring":  # see [Note: ring steps]
            if self.sp_region is not None and self.sp_region.holds(x):
                y = self.sp_region.output(self)  # computed in the region's one ring for all its column layers
            else:
                (y,) = ring_column_linear(x, [weight], dim, group)  # (..., S, out_features / tp)
            y = y if add_bias is None else y + add_bias
        elif self.seq_parallel_mode == "split_gather":
            full = gather_seq(x, dim, group)
            with saving_only_the_slice(full, x, dim, group):
                y = _linear(self, full, weight, add_bias)  # (..., S, out_features / tp)
        else:
            if self.reduce_input_grad:
                x = copy_to_tp_region(x, group)
            y = _linear(self, x, weight, add_bias)  # (..., out_features / tp)
        if self.gather_output:
            y = gather_from_tp_region(y, self.process_group)
        return (y, bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self._tp}"


class FusedLinear1D_Col(Linear1D_Col):
    """A column-parallel layer over a fused projection (`[q; k; v]` or `[gate; up]` stacked by rows):
    `split_sizes` gives each part's rows and `num_heads` (a list, one per part, or None) the heads in each, so
    every rank holds matching slices of every part and whole heads (GQA kv heads replicated when fewer
    than tp ranks)."""

    @classmethod
    def from_native_module(cls, module: nn.Linear, process_group=None, *, split_sizes: list[int], **kw):
        return super().from_native_module(module, process_group, split_sizes=split_sizes, **kw)


class Linear1D_Row(ParallelModule):
    """`y = x @ W.T + b` with W split by input features (columns); the partial products are all-reduced
    (or reduce-scattered along `seq_parallel_dim` under `seq_parallel_mode="split_gather"`, ring-wise under
    `"ring"`), then the bias is added once. `input_is_parallel=False` splits a replicated x first (Colossal-AI's `parallel_input`)."""

    split_dims = {"weight": 1, "bias": None}
    fp8 = False  # the local product in FP8 (``enable_fp8``)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        process_group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        skip_bias_add: bool = False,
        num_heads: int | None = None,
        parallel_input: bool | None = None,
    ):
        super().__init__()
        _check_sp(seq_parallel_mode)
        self.in_features, self.out_features = in_features, out_features
        self.process_group = _group(process_group)
        self.input_is_parallel = input_is_parallel if parallel_input is None else parallel_input
        self.seq_parallel_mode, self.seq_parallel_dim = seq_parallel_mode, seq_parallel_dim
        self.skip_bias_add = skip_bias_add
        self._tp = dist.get_world_size(self.process_group)
        self._num_heads = num_heads
        mine = self.pieces("weight", dist.get_rank(self.process_group))
        if any(p.replicated for p in mine):
            raise ValueError(
                f"Linear1D_Row: {num_heads} heads over tp={self._tp} would replicate input features; a row "
                f"layer needs the heads divisible by tp"
            )
        self.weight = nn.Parameter(torch.empty(out_features, local_rows(mine), dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def pieces(self, name: str, rank: int) -> list[Piece]:
        return column_pieces(
            [(self.in_features, self._num_heads)], self._tp, rank, what="Linear1D_Row.weight"
        )

    def full_size(self, name: str) -> int:
        return self.in_features

    @classmethod
    def from_native_module(cls, module: nn.Linear, process_group: dist.ProcessGroup | None = None, **kw):
        """The row-parallel layer holding this rank's columns of `module`'s weight (the bias whole)."""
        new = cls(
            module.in_features, module.out_features, bias=module.bias is not None, dtype=module.weight.dtype,
            device=module.weight.device, process_group=process_group, **kw,
        )  # fmt: skip
        mine = new.pieces("weight", dist.get_rank(new.process_group))
        with torch.no_grad():
            new.weight.copy_(take_rows(module.weight, mine, new.weight.shape[1], 1))
            if new.bias is not None:
                new.bias.copy_(module.bias)
        return new

    def _linear_weight(self) -> torch.Tensor:
        """The weight as (out, in) for `F.linear` (GPT-2's Conv1D layers store it transposed)."""
        return self.weight

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.process_group)
        if self.seq_parallel_mode == "ring":  # (..., S / tp, out_features); see [Note: ring steps]
            y = ring_row_linear(x, self._linear_weight(), self.seq_parallel_dim, self.process_group)
        else:
            # (..., out_features), a partial sum over this rank's input features
            y = _linear(self, x, self._linear_weight())
            if self.seq_parallel_mode == "split_gather":
                y = reduce_scatter_seq(y, self.seq_parallel_dim, self.process_group)
            else:
                y = reduce_from_tp_region(y, self.process_group)
        if self.bias is None or self.skip_bias_add:
            return (y, self.bias) if self.skip_bias_add else y
        bias = self.bias
        if self.seq_parallel_mode is not None:
            # Each rank adds the bias to its own sequence slice only: its gradient is a partial sum.
            bias = reduce_grad(bias, self.process_group)
        return y + bias  # after the reduction, so it is added once and not tp times

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self._tp}"
