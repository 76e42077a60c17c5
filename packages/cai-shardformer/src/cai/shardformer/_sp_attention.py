"""The attention-side sequence-parallel modes on a Hugging Face decoder: `all_to_all` (Ulysses) and `ring_attn`.

Nothing of the model's forward is copied. Transformers' attention modules call the function registered under
`config._attn_implementation`; `install_sp_attention` registers `"cai_ulysses"` and `"cai_ring_attn"` (which
wrap `ulysses_attention` and `ring_attention`), points the config at one of them, gives each attention module
its sp group, and hooks the model's outer forward:

- in: every rank of the sp group receives the whole batch; the hook keeps this rank's tokens (a contiguous
  block for all_to_all, the zig-zag pair of chunks for ring_attn), with their global position ids, and the
  rank's labels already shifted;
- out: the loss is summed over the sp group; logits (or the last hidden state) are gathered back into the
  original token order, except in a training forward with labels and `parallel_output=True` (the default),
  which returns the loss and `logits=None`.

[Note: the loss over a split sequence]
Hugging Face shifts labels inside the loss (token t predicts label t+1), which would be wrong at every shard
boundary. So the hook shifts the labels of the whole sequence first and hands each rank its slice as
`shift_labels`, with `num_items_in_batch` set to the number of target tokens in the whole batch (or left as
the caller gave it, which already counts the whole batch). Each rank's loss is then the sum over its tokens
divided by the global count, and their sum, all-reduced in forward with an identity backward, is exactly the
unsplit mean; backward from it gives each rank the gradient of its own terms.

[Note: gradients of parameters under sequence parallelism]
Every parameter is replicated across the sp group and each rank's backward sees only its own tokens, so the
parameters' gradients are all-reduced (summed) over the sp group, in one flat all-reduce when backward ends
(`_sync_grads`). After backward every rank holds the gradient of the whole sequence, as in one process; a
data-parallel wrapper then runs over the dp axis only (not over dp x sp). A caller that reduces gradients itself
turns this off (`ShardConfig(sync_sp_grads=False)`) and sums over sp in its own collective: cai's
HybridParallelPlugin reduces cai-zero's buckets over dp x sp, divided by dp only (`grad_divisor`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cai.shardformer._config import ShardConfig
from cai.shardformer._ops import _gather, reduce_from_tp_region
from cai.shardformer._ring_attn import ring_attention, zigzag_indices
from cai.shardformer._ulysses import ulysses_attention

__all__ = ["ATTENTION_SP_MODES", "check_sp_attention", "install_sp_attention", "sp_token_indices"]

ATTENTION_SP_MODES = ("all_to_all", "ring_attn")
_IMPL = {"all_to_all": "cai_ulysses", "ring_attn": "cai_ring_attn"}


def sp_token_indices(mode: str, seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` of `world` holds under `mode`."""
    if mode == "ring_attn":
        return zigzag_indices(seq_len, rank, world, device)
    if seq_len % world:
        raise ValueError(
            f"all_to_all splits the sequence over sp = {world} ranks, but the sequence length is {seq_len}; pad the "
            f"batch to a multiple of {world} (labels -100 on the padding)"
        )
    chunk = seq_len // world
    return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)


def _window(module, kwargs, seq_len: int) -> None:
    window = kwargs.get("sliding_window")
    if window is not None and seq_len > window:
        raise ValueError(
            f"{type(module).__name__}: sliding_window={window} is shorter than the sequence ({seq_len}); the "
            f"sequence-parallel attention is full causal only: use sequences of at most {window} tokens"
        )


def _hf_ulysses(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    group = module.cai_sp_group
    _window(module, kwargs, query.shape[2] * dist.get_world_size(group))
    causal = getattr(module, "is_causal", True)
    out = ulysses_attention(query, key, value, group, causal=causal, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as transformers' attention functions


def _hf_ring(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    group = module.cai_sp_group
    _window(module, kwargs, query.shape[2] * dist.get_world_size(group))
    if dropout:
        raise ValueError(f"ring_attn has no attention dropout; set attention_dropout=0 (got {dropout})")
    out = ring_attention(query, key, value, group, causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_IMPL["all_to_all"], _hf_ulysses)
    AttentionInterface.register(_IMPL["ring_attn"], _hf_ring)


def check_sp_attention(
    model: nn.Module, cfg: ShardConfig, attention: dict[str, str] | None, policy_name: str
) -> None:
    """Refuse what `install_sp_attention` cannot do, before any module changes."""
    mode = cfg.sequence_parallelism_mode
    if attention is None:
        raise NotImplementedError(
            f"{policy_name} does not support sequence_parallelism_mode={mode!r}; the Llama-shaped policies (Llama, "
            f"Mistral, Qwen2, Qwen3) do"
        )
    sp, tp = cfg.sequence_parallel_size, cfg.tensor_parallel_size
    config = model.config
    heads = config.num_attention_heads
    name = type(model).__name__
    if mode == "all_to_all" and heads % (tp * sp):
        raise ValueError(
            f"{name}: all_to_all gives each rank num_attention_heads / (tp * sp) heads, but num_attention_heads="
            f"{heads} does not divide by tp={tp} x sp={sp}; use sizes whose product divides {heads}, or ring_attn "
            f"(no head constraint)"
        )
    if mode == "ring_attn" and getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"{name}: ring_attn has no attention dropout, but attention_dropout={config.attention_dropout}; set it to 0"
        )


class _GatherSeqKeepGrad(torch.autograd.Function):
    """All-gather along dim 1 forward; backward keeps this rank's rows. Every rank then computes the same thing
    from the gathered tensor, so its own rows' gradient is the whole of what it owes (no sum over ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[1]
        return _gather(x, 1, group)

    @staticmethod
    def backward(ctx, g):
        rank = dist.get_rank(ctx.group)
        return g.narrow(1, rank * ctx.rows, ctx.rows).contiguous(), None


def install_sp_attention(model: nn.Module, cfg: ShardConfig, attention: dict[str, str]) -> None:
    """Apply `cfg.sequence_parallelism_mode` (all_to_all or ring_attn) to `model` in place. `attention` maps the
    decoder layer's class name to its attention submodule's path (the policy's `sequence_parallel_attention`)."""
    mode, group = cfg.sequence_parallelism_mode, cfg.sequence_parallel_process_group
    _register()
    model.config._attn_implementation = _IMPL[mode]  # the setter reaches the sub-configs too
    for module in model.modules():
        path = attention.get(type(module).__name__)
        if path is not None:
            module.get_submodule(path).cai_sp_group = group
    if cfg.sync_sp_grads:
        _sync_grads(model, group)
    signature = inspect.signature(model.forward)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    order: list[torch.Tensor] = []  # the current call's gather order (set in pre, read in post)

    def pre_hook(module, args, kwargs):
        bound = dict(signature.bind_partial(*args, **kwargs).arguments)
        kw = {**bound, **bound.pop(var_kw, {})} if var_kw else bound
        return (), _split_inputs(kw, mode, group, order)

    def post_hook(module, args, kwargs, output):
        if isinstance(output, tuple):
            raise ValueError(
                f"sequence_parallelism_mode={mode!r} needs return_dict=True outputs (got a tuple)"
            )
        if getattr(output, "loss", None) is not None:
            # See [Note: the loss over a split sequence].
            output.loss = reduce_from_tp_region(output.loss, group)
            if module.training and cfg.parallel_output:
                # The loss is all a training step needs: gathering b x s x vocab logits would be the step's
                # largest collective. As with the vocab-parallel loss, `logits` is then None.
                output = type(output)(**{k: v for k, v in output.items() if k != "logits"})
        for key in ("logits", "last_hidden_state"):
            value = getattr(output, key, None)
            if value is not None:
                full = _GatherSeqKeepGrad.apply(value, group)
                if mode == "ring_attn":  # back to the token order of the input
                    full = full.index_select(1, torch.argsort(order[0].to(full.device)))
                setattr(output, key, full)
        return output

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)


def _split_inputs(kw: dict, mode: str, group, order: list) -> dict:
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    if tokens is None:
        raise ValueError(f"sequence_parallelism_mode={mode!r}: pass input_ids or inputs_embeds")
    if kw.get("past_key_values") is not None:
        raise ValueError(
            f"sequence_parallelism_mode={mode!r} runs full sequences only: no past_key_values (generate on an "
            f"unsplit model)"
        )
    mask = kw.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            f"sequence_parallelism_mode={mode!r} supports causal attention without padding: the attention_mask has "
            f"zeros; pack the sequences (labels -100 between them) or pass no attention_mask"
        )
    seq = tokens.shape[1]
    idx = sp_token_indices(mode, seq, rank, sp, tokens.device)
    order[:] = [torch.cat([sp_token_indices(mode, seq, r, sp) for r in range(sp)])]
    kw["attention_mask"] = None
    kw["use_cache"] = False
    for name in ("input_ids", "inputs_embeds"):
        if kw.get(name) is not None:
            kw[name] = kw[name].index_select(1, idx)
    positions = kw.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0)
    kw["position_ids"] = positions.index_select(-1, idx)  # global positions: rotary sees the true offsets
    labels = kw.get("labels")
    if labels is not None:
        ignore = kw.get("ignore_index", -100)
        shifted = kw.get("shift_labels")
        if shifted is None:
            shifted = F.pad(labels, (0, 1), value=ignore)[..., 1:]
        if kw.get("num_items_in_batch") is None:
            kw["num_items_in_batch"] = (shifted != ignore).sum()
        kw["shift_labels"] = kw["labels"] = shifted.index_select(1, idx).contiguous()
    return kw


def _sync_grads(model: nn.Module, group) -> None:
    """See [Note: gradients of parameters under sequence parallelism]. Each parameter's gradient of this backward
    is stashed as it arrives; when backward ends, one flat all-reduce sums them all over the group and each
    `.grad` gets the difference (reduced - own), which is also right when `.grad` already held an earlier
    micro-batch's (already reduced) gradient."""
    params = [p for p in model.parameters() if p.requires_grad]  # each shared (tied) parameter once
    pending: list[tuple[nn.Parameter, torch.Tensor]] = []

    def flush() -> None:
        if not pending:
            return
        grads = [g.reshape(-1) for _, g in pending]
        flat = torch.cat(grads)
        dist.all_reduce(flat, group=group)
        for (p, own), reduced in zip(pending, flat.split([g.numel() for g in grads])):
            if p.grad is not None:  # None only under torch.autograd.grad, which accumulates nothing
                p.grad.add_(reduced.view_as(own) - own)
        pending.clear()

    def make_hook(p):
        def hook(grad):
            if not pending:  # first gradient of this backward: reduce them all when it ends
                torch.autograd.Variable._execution_engine.queue_callback(flush)
            pending.append((p, grad))
            return grad

        return hook

    for p in params:
        p.register_hook(make_hook(p))
