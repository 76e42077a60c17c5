"""The shape shared by the decoder policies that are not Llama-shaped (GPT-2, GPT-J, OPT, Bloom, Falcon): a family
describes its transformer layer (`layer_policy`) and the config values that must divide by tp; this base makes the
token embedding and the lm_head vocab-parallel, re-ties tied weights, and routes the causal-LM loss through the
vocab-parallel cross-entropy."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from cai.shardformer._dropout import PARALLEL, fork_rng_in_forward
from cai.shardformer._embedding import VocabParallelEmbedding1D, VocabParallelLMHead1D
from cai.shardformer._layout import padded_vocab
from cai.shardformer._policy import ModulePolicyDescription, Policy
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies.llama import install_vocab_parallel_loss

__all__ = ["DecoderPolicy"]


class DecoderPolicy(Policy):
    """Subclasses set `stack` (the class name of the module owning the token embedding, e.g. "GPT2Model"),
    `embedding` (its path there), `layer` and `attention` (the transformer layer's class name and its attention's
    path) and implement `divisible` and `layer_policy`. Any model class with an
    `lm_head` linear gets it vocab-parallel (with its bias, if it has one)."""

    stack: str
    embedding: str
    layer: str  # the transformer layer's class name (a key of `layer_policy`)
    attention: str  # the attention's path inside it

    def divisible(self) -> dict[str, int]:
        """Config values (by their config name) that must divide by tp."""
        raise NotImplementedError

    def layer_policy(self, tp: int) -> dict[Any, ModulePolicyDescription]:
        raise NotImplementedError

    def check(self) -> None:
        """Family-specific checks beyond divisibility (layouts not built); raise with the fix."""

    @property
    def vocab_parallel_loss(self) -> bool:
        """Whether the loss may be computed from the hidden states (False where the model transforms its
        logits before the loss)."""
        return True

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"{type(self.model).__name__}: {what}")

    def config_sanity_check(self) -> None:
        tp = self.shard_config.tensor_parallel_size
        for name, value in self.divisible().items():
            if value % tp:
                raise self._fail(
                    f"{name}={value} does not divide over tensor_parallel_size={tp}; use a tp size that divides "
                    f"{value}"
                )
        self.check()
        padded_vocab(self.model.config.vocab_size, tp, self.shard_config.make_vocab_size_divisible_by)

    def preprocess(self) -> nn.Module:
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        self._tied = out is not None and out.weight is inp.weight
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        policy = self.layer_policy(tp)
        # Attention dropout acts on this rank's heads: a different mask per rank (as the Llama policy).
        fork = fork_rng_in_forward(
            self.attention, PARALLEL, group=self.shard_config.tensor_parallel_process_group
        )
        desc = policy[self.layer]
        policy[self.layer] = dataclasses.replace(
            desc, param_replacement=[*(desc.param_replacement or []), fork]
        )
        self.append_or_create_submodule_replacement(
            Sub(self.embedding, VocabParallelEmbedding1D, vocab), policy, self.stack
        )
        head = getattr(self.model, "lm_head", None)
        if isinstance(head, nn.Linear):
            sub = Sub("lm_head", VocabParallelLMHead1D, {**vocab, "gather_output": True})
            self.append_or_create_submodule_replacement(sub, policy, type(self.model).__name__)
        return policy

    def postprocess(self) -> nn.Module:
        model = self.model
        if self._tied:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        head = getattr(model, "lm_head", None)
        if (
            isinstance(head, VocabParallelLMHead1D)
            and self.shard_config.parallel_output
            and self.vocab_parallel_loss
            and hasattr(model, "loss_function")
        ):
            install_vocab_parallel_loss(model, head)
        return model
