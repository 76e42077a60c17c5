"""BERT policies: self-attention query/key/value column-parallel by heads, attention output row; intermediate
column, output row; word embedding vocab-parallel (position and token-type embeddings, LayerNorms, pooler and
classifiers replicated); the masked-LM decoder vocab-parallel and tied to the word embedding, its logits gathered
(BERT's heads compute their loss from the logits themselves, so there is no loss hook to route through)."""

from __future__ import annotations

from typing import Any

from torch import nn

from cai.shardformer._embedding import VocabParallelEmbedding1D, VocabParallelLMHead1D
from cai.shardformer._layout import padded_vocab
from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription, Policy
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._common import check_divisible

__all__ = [
    "BertForMaskedLMPolicy",
    "BertForPreTrainingPolicy",
    "BertForSequenceClassificationPolicy",
    "BertModelPolicy",
    "BertPolicy",
]


class BertPolicy(Policy):
    """The encoder layers and the word embedding of a `BertModel`, wherever it sits in the model."""

    def config_sanity_check(self) -> None:
        cfg, name = self.model.config, type(self.model).__name__
        tp = self.shard_config.tensor_parallel_size
        if cfg.add_cross_attention:
            raise NotImplementedError(
                f"{name}: add_cross_attention=True (BERT as a decoder with cross-attention) has no cai-shardformer "
                f"policy yet; shard the encoder-only model or pass policy="
            )
        check_divisible(
            name, tp, num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size
        )
        padded_vocab(
            cfg.vocab_size, tp, self.shard_config.make_vocab_size_divisible_by
        )  # raises with the fix

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        nh = self.model.config.num_attention_heads
        head_dim = self.model.config.hidden_size // nh
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        return {
            "BertLayer": ModulePolicyDescription(
                attribute_replacement={
                    "attention.self.num_attention_heads": nh // tp,
                    "attention.self.all_head_size": nh // tp * head_dim,
                },
                sub_module_replacement=[
                    Sub("attention.self.query", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("attention.self.key", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("attention.self.value", Linear1D_Col, {**col, "num_heads": nh}),
                    Sub("attention.output.dense", Linear1D_Row, {"num_heads": nh}),
                    Sub("intermediate.dense", Linear1D_Col),
                    Sub("output.dense", Linear1D_Row),
                ],
                tp_input_regions=["attention.self"],
            ),
            "BertEmbeddings": ModulePolicyDescription(
                sub_module_replacement=[Sub("word_embeddings", VocabParallelEmbedding1D, vocab)]
            ),
        }

    def postprocess(self) -> nn.Module:
        return self.model


class BertModelPolicy(BertPolicy):
    pass


class BertForSequenceClassificationPolicy(BertPolicy):
    pass


class BertForMaskedLMPolicy(BertPolicy):
    """Adds the vocab-parallel masked-LM decoder (logits gathered over the real vocabulary), tied to the word
    embedding when the model ties them, and its bias shared with `cls.predictions.bias` as in Hugging Face."""

    def preprocess(self) -> nn.Module:
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        self._tied = out is not None and out.weight is inp.weight
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        policy = super().module_policy()
        if not policy:
            return policy
        multiple = self.shard_config.make_vocab_size_divisible_by
        head = Sub(
            "decoder",
            VocabParallelLMHead1D,
            {"gather_output": True, "make_vocab_size_divisible_by": multiple},
        )
        return self.append_or_create_submodule_replacement(head, policy, "BertLMPredictionHead")

    def postprocess(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if not isinstance(head, VocabParallelLMHead1D):
            return self.model
        if self._tied:
            head.weight = self.model.get_input_embeddings().weight
        # `cls.predictions.bias` and `cls.predictions.decoder.bias` are one parameter in Hugging Face; it is now
        # the decoder's vocabulary shard (the state protocol reports it through the decoder, see _state.py).
        self.model.cls.predictions.bias = head.bias
        return self.model


class BertForPreTrainingPolicy(BertForMaskedLMPolicy):
    pass
