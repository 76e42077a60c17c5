"""Falcon policies for its three `query_key_value` layouts (transformers' FalconAttention):

- new_decoder_architecture: kv groups one after another, each [q heads of the group, k, v]: one split of
  `num_kv_heads` blocks, so tp must divide num_kv_heads (a group's query heads cannot be replicated);
- multi_query: [all q heads | k | v] with one kv head: q split by heads, k and v replicated on every rank (their
  gradients summed over the tp group, as replicated GQA heads);
- neither: per head [q, k, v] interleaved, as Bloom: one split of `num_attention_heads` blocks.

`dense` row; the MLP's dense_h_to_4h column, dense_4h_to_h row; word embeddings and the (tied) lm_head
vocab-parallel. With ALiBi (`alibi=True`) each rank's attention keeps its heads' biases (see `_alibi_of_rank`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from cai.shardformer._linear import FusedLinear1D_Col, Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._decoder import DecoderPolicy

__all__ = ["FalconForCausalLMPolicy", "FalconModelPolicy", "FalconPolicy"]


def _alibi_of_rank(rank: int, tp: int, heads: int):
    """A `param_replacement` entry: FalconModel.forward builds the ALiBi biases of all heads inline and folds them into
    a per-head attention mask; a forward pre-hook on the layer's attention keeps this rank's heads of both."""
    per = heads // tp

    def hook(module, args, kwargs):
        alibi = kwargs.get("alibi")
        if alibi is None:
            return None
        mine = slice(rank * per, (rank + 1) * per)
        kwargs = dict(kwargs)
        kwargs["alibi"] = alibi.reshape(-1, heads, *alibi.shape[-2:])[:, mine]  # (B, heads / tp, 1, S)
        mask = kwargs.get("attention_mask")
        if (
            mask is not None and mask.dim() == 4 and mask.shape[1] == heads
        ):  # ALiBi folded in: (B, heads, q, k)
            kwargs["attention_mask"] = mask[:, mine]
        return args, kwargs

    def apply(layer: nn.Module) -> None:
        layer.self_attention.register_forward_pre_hook(hook, with_kwargs=True)

    return apply


class FalconPolicy(DecoderPolicy):
    stack = "FalconModel"
    embedding = "word_embeddings"
    layer = "FalconDecoderLayer"
    attention = "self_attention"

    def divisible(self) -> dict[str, int]:
        cfg = self.model.config
        out = {"num_attention_heads": cfg.num_attention_heads, "ffn_hidden_size": cfg.ffn_hidden_size}
        if cfg.new_decoder_architecture:
            out["num_kv_heads (kv groups of new_decoder_architecture)"] = cfg.num_kv_heads
        return out

    def layer_policy(self, tp: int) -> dict[Any, ModulePolicyDescription]:
        cfg = self.model.config
        nh, h = cfg.num_attention_heads, cfg.hidden_size
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        attrs: dict[str, Any] = {"self_attention.num_heads": nh // tp}
        if cfg.new_decoder_architecture:
            qkv = Sub("self_attention.query_key_value", Linear1D_Col, {**col, "num_heads": cfg.num_kv_heads})
            attrs["self_attention.num_kv_heads"] = cfg.num_kv_heads // tp
        elif cfg.multi_query:
            hd = h // nh
            kw = {**col, "split_sizes": [h, hd, hd], "num_heads": [nh, 1, 1]}
            qkv = Sub("self_attention.query_key_value", FusedLinear1D_Col, kw)  # num_kv_heads stays 1
        else:
            qkv = Sub("self_attention.query_key_value", Linear1D_Col, {**col, "num_heads": nh})
            attrs["self_attention.num_kv_heads"] = nh // tp
        rank = dist.get_rank(self.shard_config.tensor_parallel_process_group)
        return {
            "FalconDecoderLayer": ModulePolicyDescription(
                attribute_replacement=attrs,
                param_replacement=[_alibi_of_rank(rank, tp, nh)] if cfg.alibi else None,
                sub_module_replacement=[
                    qkv,
                    Sub("self_attention.dense", Linear1D_Row, {"num_heads": nh}),
                    Sub("mlp.dense_h_to_4h", Linear1D_Col, col),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row),
                ],
                tp_input_regions=["self_attention", "mlp"],
            )
        }


class FalconModelPolicy(FalconPolicy):
    pass


class FalconForCausalLMPolicy(FalconPolicy):
    pass
