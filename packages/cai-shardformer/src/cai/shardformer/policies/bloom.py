"""Bloom policies: the fused `query_key_value` interleaves per head ([q, k, v] of head 0, then of head 1, ...), so it
splits as one block of `n_head` heads of 3 x head_dim rows (each rank's rows contiguous); `dense` row; the MLP's
dense_h_to_4h column, dense_4h_to_h row; word embeddings and the (tied) lm_head vocab-parallel. ALiBi biases are per
head: each rank keeps the slopes of its own heads."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._decoder import DecoderPolicy

__all__ = ["BloomForCausalLMPolicy", "BloomModelPolicy", "BloomPolicy"]


def _alibi_of_rank(rank: int, tp: int):
    """BloomModel.build_alibi_tensor restricted to this rank's heads (the attention reads `num_heads / tp` heads'
    biases, batch-major)."""

    def build_alibi_tensor(
        self, attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype
    ) -> torch.Tensor:
        full = type(self).build_alibi_tensor(self, attention_mask, num_heads, dtype)  # (B * nh, 1, S)
        batch, per = attention_mask.shape[0], num_heads // tp
        mine = full.view(batch, num_heads, *full.shape[1:])[:, rank * per : (rank + 1) * per]
        return mine.reshape(batch * per, *full.shape[1:])  # (B * nh / tp, 1, S)

    return build_alibi_tensor


class BloomPolicy(DecoderPolicy):
    stack = "BloomModel"
    embedding = "word_embeddings"
    layer = "BloomBlock"
    attention = "self_attention"

    def divisible(self) -> dict[str, int]:
        cfg = self.model.config
        return {"n_head": cfg.n_head, "4 * hidden_size": 4 * cfg.hidden_size}

    def check(self) -> None:
        cfg = self.model.config
        if cfg.pretraining_tp > 1 and cfg.slow_but_exact:
            raise NotImplementedError(
                f"{type(self.model).__name__}: slow_but_exact=True with pretraining_tp={cfg.pretraining_tp} slices "
                f"the full dense weights inside forward, which a tp shard does not hold; set slow_but_exact=False"
            )

    def layer_policy(self, tp: int) -> dict[Any, ModulePolicyDescription]:
        nh = self.model.config.n_head
        rank = dist.get_rank(self.shard_config.tensor_parallel_process_group)
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        return {
            "BloomBlock": ModulePolicyDescription(
                attribute_replacement={"self_attention.num_heads": nh // tp},
                sub_module_replacement=[
                    Sub("self_attention.query_key_value", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("self_attention.dense", Linear1D_Row, {"num_heads": nh}),
                    Sub("mlp.dense_h_to_4h", Linear1D_Col, col),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row),
                ],
                tp_input_regions=["self_attention", "mlp"],
            ),
            "BloomModel": ModulePolicyDescription(
                method_replacement={"build_alibi_tensor": _alibi_of_rank(rank, tp)}
            ),
        }


class BloomModelPolicy(BloomPolicy):
    pass


class BloomForCausalLMPolicy(BloomPolicy):
    pass
