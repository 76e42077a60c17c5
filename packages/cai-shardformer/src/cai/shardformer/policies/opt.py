"""OPT policies: q/k/v column by heads and out_proj row inside the attention; the layer's own fc1 column and fc2 row
(OPT has no MLP submodule: fc1 enters the tp region itself); the embedding and the (tied) lm_head vocab-parallel;
positions, norms and the optional project_in/project_out replicated."""

from __future__ import annotations

from typing import Any

from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._decoder import DecoderPolicy

__all__ = ["OPTForCausalLMPolicy", "OPTModelPolicy", "OPTPolicy"]


class OPTPolicy(DecoderPolicy):
    stack = "OPTDecoder"
    embedding = "embed_tokens"
    layer = "OPTDecoderLayer"
    attention = "self_attn"

    def divisible(self) -> dict[str, int]:
        cfg = self.model.config
        return {"num_attention_heads": cfg.num_attention_heads, "ffn_dim": cfg.ffn_dim}

    def layer_policy(self, tp: int) -> dict[Any, ModulePolicyDescription]:
        nh = self.model.config.num_attention_heads
        col = {"reduce_input_grad": False, "num_heads": nh}  # see [Note: one all-reduce per region]
        return {
            "OPTDecoderLayer": ModulePolicyDescription(
                attribute_replacement={"self_attn.num_heads": nh // tp},
                sub_module_replacement=[
                    Sub("self_attn.q_proj", Linear1D_Col, col),
                    Sub("self_attn.k_proj", Linear1D_Col, col),
                    Sub("self_attn.v_proj", Linear1D_Col, col),
                    Sub("self_attn.out_proj", Linear1D_Row, {"num_heads": nh}),
                    Sub("fc1", Linear1D_Col),  # the only column layer reading its input: its own region
                    Sub("fc2", Linear1D_Row),
                ],
                tp_input_regions=["self_attn"],
            )
        }


class OPTModelPolicy(OPTPolicy):
    pass


class OPTForCausalLMPolicy(OPTPolicy):
    pass
