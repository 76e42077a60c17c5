"""GPT-J policies: q/k/v column by heads, out_proj row; fc_in column, fc_out row; `wte` and the lm_head (which has
a bias) vocab-parallel. Attention and MLP read the same normalised input in parallel; each is its own tp region."""

from __future__ import annotations

from typing import Any

from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._decoder import DecoderPolicy

__all__ = ["GPTJForCausalLMPolicy", "GPTJModelPolicy", "GPTJPolicy"]


class GPTJPolicy(DecoderPolicy):
    stack = "GPTJModel"
    embedding = "wte"
    layer = "GPTJBlock"
    attention = "attn"

    def divisible(self) -> dict[str, int]:
        cfg = self.model.config
        return {"n_head": cfg.n_head, "n_inner": cfg.n_inner or 4 * cfg.n_embd}

    def layer_policy(self, tp: int) -> dict[Any, ModulePolicyDescription]:
        nh = self.model.config.n_head
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        heads = {**col, "num_heads": nh}
        return {
            "GPTJBlock": ModulePolicyDescription(
                # Read by both attention classes (eager and flash) to split and merge heads.
                attribute_replacement={"attn.num_attention_heads": nh // tp},
                sub_module_replacement=[
                    Sub("attn.q_proj", Linear1D_Col, heads),
                    Sub("attn.k_proj", Linear1D_Col, heads),
                    Sub("attn.v_proj", Linear1D_Col, heads),
                    Sub("attn.out_proj", Linear1D_Row, {"num_heads": nh}),
                    Sub("mlp.fc_in", Linear1D_Col, col),
                    Sub("mlp.fc_out", Linear1D_Row),
                ],
                tp_input_regions=["attn", "mlp"],
            )
        }


class GPTJModelPolicy(GPTJPolicy):
    pass


class GPTJForCausalLMPolicy(GPTJPolicy):
    pass
