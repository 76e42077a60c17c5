"""ViT policies (ViTModel, ViTForImageClassification): attention q/k/v column-parallel by heads and o
row-parallel, MLP fc1 column and fc2 row; the patch embedding (a convolution), cls token, position embeddings,
LayerNorms, pooler and classifier replicated (they are small, and the patch convolution's output is the
replicated hidden state every layer starts from)."""

from __future__ import annotations

from typing import Any

from torch import nn

from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription, Policy
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._common import check_divisible

__all__ = ["ViTForImageClassificationPolicy", "ViTModelPolicy", "ViTPolicy"]


class ViTPolicy(Policy):
    def config_sanity_check(self) -> None:
        cfg = self.model.config
        check_divisible(
            type(self.model).__name__, self.shard_config.tensor_parallel_size,
            num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        )  # fmt: skip

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        nh = self.model.config.num_attention_heads
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        return {
            "ViTLayer": ModulePolicyDescription(
                attribute_replacement={"attention.num_attention_heads": nh // tp},
                sub_module_replacement=[
                    Sub("attention.q_proj", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("attention.k_proj", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("attention.v_proj", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("attention.o_proj", Linear1D_Row, {"num_heads": nh}),
                    Sub("mlp.fc1", Linear1D_Col),
                    Sub("mlp.fc2", Linear1D_Row),
                ],
                tp_input_regions=["attention"],
            )
        }

    def postprocess(self) -> nn.Module:
        return self.model


class ViTModelPolicy(ViTPolicy):
    pass


class ViTForImageClassificationPolicy(ViTPolicy):
    pass
