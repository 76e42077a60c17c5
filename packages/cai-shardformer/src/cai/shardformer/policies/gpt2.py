"""GPT-2 policies: Conv1D layers (weight stored (in, out)); the fused `c_attn` split by heads within each of q, k
and v; `c_fc` column, both `c_proj` row; `wte` and the (tied) lm_head vocab-parallel, `wpe` replicated."""

from __future__ import annotations

from typing import Any

from cai.shardformer._conv1d import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from cai.shardformer._policy import ModulePolicyDescription
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._decoder import DecoderPolicy

__all__ = ["GPT2LMHeadModelPolicy", "GPT2ModelPolicy", "GPT2Policy"]


class GPT2Policy(DecoderPolicy):
    stack = "GPT2Model"
    embedding = "wte"
    layer = "GPT2Block"
    attention = "attn"

    def divisible(self) -> dict[str, int]:
        cfg = self.model.config
        return {"n_head": cfg.n_head, "n_inner": cfg.n_inner or 4 * cfg.n_embd}

    def check(self) -> None:
        if getattr(self.model.config, "add_cross_attention", False):
            raise NotImplementedError(
                f"{type(self.model).__name__}: add_cross_attention=True (GPT-2 as a decoder of an encoder-decoder) "
                f"has no tensor-parallel layout in this policy; shard it with tp=1 or pass policy="
            )

    def layer_policy(self, tp: int) -> dict[Any, ModulePolicyDescription]:
        cfg = self.model.config
        nh, h = cfg.n_head, cfg.n_embd
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        qkv = {**col, "split_sizes": [h, h, h], "num_heads": [nh, nh, nh]}
        return {
            "GPT2Block": ModulePolicyDescription(
                # GPT2Attention splits c_attn's output at `split_size` and views heads from it at run time.
                attribute_replacement={"attn.num_heads": nh // tp, "attn.split_size": h // tp},
                sub_module_replacement=[
                    Sub("attn.c_attn", GPT2FusedLinearConv1D_Col, qkv),
                    Sub("attn.c_proj", GPT2FusedLinearConv1D_Row, {"num_heads": nh}),
                    Sub("mlp.c_fc", GPT2FusedLinearConv1D_Col, col),
                    Sub("mlp.c_proj", GPT2FusedLinearConv1D_Row),
                ],
                tp_input_regions=["attn", "mlp"],
            )
        }


class GPT2ModelPolicy(GPT2Policy):
    pass


class GPT2LMHeadModelPolicy(GPT2Policy):
    pass
