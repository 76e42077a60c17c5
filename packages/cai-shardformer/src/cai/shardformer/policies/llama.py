"""Policies of the Llama-shaped decoders (Llama, and by family prefix Mistral, Qwen2, Qwen3): attention
q/k/v column-parallel by heads, o row-parallel; MLP gate/up column, down row; embedding and lm_head
vocab-parallel; the causal-LM loss vocab-parallel through the model's `loss_function` hook."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from cai.kernels import defer_lm_head_loss
from cai.shardformer._dropout import PARALLEL, fork_rng_in_forward
from cai.shardformer._embedding import (
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    vocab_parallel_cross_entropy,
)
from cai.shardformer._layout import padded_vocab
from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription, Policy, reduce_param_grads
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer._sequence import split_sequence

__all__ = ["LlamaForCausalLMPolicy", "LlamaModelPolicy", "LlamaPolicy"]


class LlamaPolicy(Policy):
    """The decoder layers and the embedding. `family` is the Hugging Face class-name prefix."""

    family = "Llama"
    shards_mlp = True  # False where the MLP stays replicated (Mixtral's experts): no intermediate_size check
    sequence_parallel_modes = ("split_gather", "ring", "all_to_all", "ring_attn")

    def config_sanity_check(self) -> None:
        tp = self.shard_config.tensor_parallel_size
        cfg = self.model.config
        nh = cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", None) or nh
        name = type(self.model).__name__
        if nh % tp:
            raise ValueError(
                f"{name}: num_attention_heads={nh} does not divide over tensor_parallel_size={tp}; use a tp size "
                f"that divides {nh}"
            )
        if nkv % tp and tp % nkv:
            raise ValueError(
                f"{name}: num_key_value_heads={nkv} neither divides nor is divided by tensor_parallel_size={tp}; "
                f"use a tp size that divides {nkv} or is a multiple of it (kv heads are then replicated)"
            )
        if self.shards_mlp and cfg.intermediate_size % tp:
            raise ValueError(
                f"{name}: intermediate_size={cfg.intermediate_size} does not divide over tensor_parallel_size={tp}"
            )
        padded_vocab(
            cfg.vocab_size, tp, self.shard_config.make_vocab_size_divisible_by
        )  # raises with the fix

    def sequence_parallel_attention(self) -> dict[str, str]:
        return {f"{self.family}DecoderLayer": "self_attn"}

    def preprocess(self) -> nn.Module:
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        self._tied = out is not None and out.weight is inp.weight
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        cfg = self.model.config
        nh = cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", None) or nh
        local_q = nh // tp
        local_kv = max(nkv // tp, 1)  # one replicated kv head per rank when kv heads < tp
        group = self.shard_config.tensor_parallel_process_group
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        row: dict[str, Any] = {}
        sc = self.shard_config
        sp_mode = sc.sequence_parallelism_mode if sc.enable_sequence_parallelism else None
        if sp_mode == "ring":
            col = {"seq_parallel_mode": "ring"}  # the column layers ring the slices themselves
        if sp_mode in ("split_gather", "ring"):
            # The row layers leave the tp region split along the sequence; the sp group is the tp group.
            row = {"seq_parallel_mode": sp_mode}
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        policy = {
            f"{self.family}DecoderLayer": ModulePolicyDescription(
                attribute_replacement={"self_attn.num_key_value_groups": local_q // local_kv},
                # Attention dropout acts on this rank's heads: a different mask per rank.
                param_replacement=[fork_rng_in_forward("self_attn", PARALLEL, group=group)],
                sub_module_replacement=[
                    Sub("self_attn.q_proj", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("self_attn.k_proj", Linear1D_Col, {**col, "num_heads": nkv}),
                    Sub("self_attn.v_proj", Linear1D_Col, {**col, "num_heads": nkv}),
                    Sub("self_attn.o_proj", Linear1D_Row, {**row, "num_heads": nh}),
                    Sub("mlp.gate_proj", Linear1D_Col, col),
                    Sub("mlp.up_proj", Linear1D_Col, col),
                    Sub("mlp.down_proj", Linear1D_Row, row),
                ],
                tp_input_regions=["self_attn", "mlp"],
            ),
            f"{self.family}Model": ModulePolicyDescription(
                sub_module_replacement=[Sub("embed_tokens", VocabParallelEmbedding1D, vocab)]
            ),
        }
        if sp_mode in ("split_gather", "ring"):
            self._split_sequence(policy, sp_mode, sc.tensor_parallel_process_group)
        return policy

    def _split_sequence(self, policy: dict, mode: str, group) -> None:
        """The sequence is split at the first decoder layer and gathered after the final norm (see [Note: where
        the sequence is split]); the norms run on the slice, so their weight gradients are partial sums over the
        sequence group, all-reduced once per backward by a gradient hook."""
        layer, backbone = f"{self.family}DecoderLayer", f"{self.family}Model"
        norms = reduce_param_grads("input_layernorm.weight", "post_attention_layernorm.weight", group=group)
        policy[layer] = dataclasses.replace(
            policy[layer], param_replacement=[*(policy[layer].param_replacement or []), norms]
        )
        split = split_sequence("layers.0", "norm", group, mode=mode)
        final_norm = reduce_param_grads("norm.weight", group=group)
        policy[backbone] = dataclasses.replace(
            policy[backbone],
            param_replacement=[*(policy[backbone].param_replacement or []), split, final_norm],
        )

    def postprocess(self) -> nn.Module:
        if self._tied:
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight
        return self.model


class LlamaModelPolicy(LlamaPolicy):
    pass


class LlamaForCausalLMPolicy(LlamaPolicy):
    """Adds the vocab-parallel lm_head. With `parallel_output=True` (the default) a training forward with
    `labels` computes the loss from the hidden states (see `install_vocab_parallel_loss`) and returns no logits;
    otherwise the logits are gathered over the real vocabulary."""

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        policy = super().module_policy()
        if not policy:
            return policy
        head = Sub(
            "lm_head", VocabParallelLMHead1D,
            {"gather_output": True, "make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by},
        )  # fmt: skip
        return self.append_or_create_submodule_replacement(head, policy, f"{self.family}ForCausalLM")

    def postprocess(self) -> nn.Module:
        model = super().postprocess()
        head = model.get_output_embeddings()
        if isinstance(head, VocabParallelLMHead1D) and self.shard_config.parallel_output:
            install_vocab_parallel_loss(model, head)
        return model


def install_vocab_parallel_loss(model: nn.Module, head: VocabParallelLMHead1D) -> None:
    """Route a Hugging Face causal LM's training loss through `vocab_parallel_cross_entropy` (cai-kernels'
    `defer_lm_head_loss` says how: the head defers, the loss reads the hidden states; `logits` is then None)."""
    defer_lm_head_loss(
        model,
        head,
        lambda lm_head, hidden, labels, ignore_index, reduction: vocab_parallel_cross_entropy(
            hidden, lm_head, labels, ignore_index=ignore_index, reduction=reduction
        ),
    )
