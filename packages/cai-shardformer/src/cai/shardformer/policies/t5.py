"""T5 policies (T5Model, T5ForConditionalGeneration, T5EncoderModel): self- and cross-attention q/k/v
column-parallel by heads and o row-parallel, the relative attention bias split by heads (it is one column per
head), the feed-forward (plain or gated) column then row, the shared embedding vocab-parallel with every layer tied
to it, and the lm_head vocab-parallel with gathered logits (T5 computes its loss from the logits itself).

Cross-attention reads the encoder output for k and v: q enters the tp region with the decoder hidden states, k
and v each all-reduce the encoder output's gradient (three all-reduces backward for a cross-attention, not one)."""

from __future__ import annotations

from typing import Any

from torch import nn

from cai.shardformer._embedding import Embedding1D, VocabParallelEmbedding1D, VocabParallelLMHead1D
from cai.shardformer._layout import padded_vocab
from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription, Policy
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._common import check_divisible, retie, tied_names

__all__ = ["T5BasePolicy", "T5EncoderPolicy", "T5ForConditionalGenerationPolicy", "T5ModelPolicy"]


def _attention(path: str, nh: int, tp: int, d_kv: int, in_region: bool) -> ModulePolicyDescription:
    """One T5Attention at `path` (relative to its T5Layer*Attention); `in_region`: k and v read the same input
    as q (self-attention), so the module's input enters the tp region once for the three."""
    col = {"num_heads": nh, "reduce_input_grad": False}
    kv = col if in_region else {"num_heads": nh}
    return ModulePolicyDescription(
        attribute_replacement={f"{path}.n_heads": nh // tp, f"{path}.inner_dim": nh // tp * d_kv},
        sub_module_replacement=[
            Sub(f"{path}.q", Linear1D_Col, col),
            Sub(f"{path}.k", Linear1D_Col, kv),
            Sub(f"{path}.v", Linear1D_Col, kv),
            Sub(f"{path}.o", Linear1D_Row, {"num_heads": nh}),
            # (num_buckets, n_heads): a rank's heads are its columns, and each rank reads only its own.
            Sub(
                f"{path}.relative_attention_bias",
                Embedding1D,
                {"gather_output": False},
                ignore_if_not_exist=True,
            ),
        ],
        tp_input_regions=[path],
    )


class T5BasePolicy(Policy):
    """The encoder and decoder stacks and the shared embedding."""

    def config_sanity_check(self) -> None:
        cfg, tp = self.model.config, self.shard_config.tensor_parallel_size
        check_divisible(type(self.model).__name__, tp, num_heads=cfg.num_heads, d_ff=cfg.d_ff)
        padded_vocab(
            cfg.vocab_size, tp, self.shard_config.make_vocab_size_divisible_by
        )  # raises with the fix

    def preprocess(self) -> nn.Module:
        self._ties = tied_names(self.model, "shared.weight")  # embed_tokens of the stacks, the lm_head
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        cfg = self.model.config
        nh, d_kv = cfg.num_heads, cfg.d_kv
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        embeddings = [Sub("shared", VocabParallelEmbedding1D, vocab)]
        for stack in ("encoder", "decoder"):
            embeddings.append(
                Sub(f"{stack}.embed_tokens", VocabParallelEmbedding1D, vocab, ignore_if_not_exist=True)
            )
        col = {"reduce_input_grad": False}  # see [Note: one all-reduce per region]
        ff = ModulePolicyDescription(  # T5DenseActDense (wi) or T5DenseGatedActDense (wi_0, wi_1)
            sub_module_replacement=[
                Sub("DenseReluDense.wi", Linear1D_Col, col, ignore_if_not_exist=True),
                Sub("DenseReluDense.wi_0", Linear1D_Col, col, ignore_if_not_exist=True),
                Sub("DenseReluDense.wi_1", Linear1D_Col, col, ignore_if_not_exist=True),
                Sub("DenseReluDense.wo", Linear1D_Row),
            ],
            tp_input_regions=["DenseReluDense"],
        )
        cross = _attention("EncDecAttention", nh, tp, d_kv, in_region=False)
        return {
            "T5LayerSelfAttention": _attention("SelfAttention", nh, tp, d_kv, in_region=True),
            "T5LayerCrossAttention": cross,
            "T5LayerFF": ff,
            type(self.model).__name__: ModulePolicyDescription(sub_module_replacement=embeddings),
        }

    def postprocess(self) -> nn.Module:
        if self.shard_config.tensor_parallel_size > 1:
            retie(self.model, "shared.weight", self._ties)
        return self.model


class T5ModelPolicy(T5BasePolicy):
    pass


class T5EncoderPolicy(T5BasePolicy):
    pass


class T5ForConditionalGenerationPolicy(T5BasePolicy):
    """Adds the vocab-parallel lm_head, logits gathered over the real vocabulary (tied to the shared embedding
    when the model ties them)."""

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        policy = super().module_policy()
        if not policy:
            return policy
        multiple = self.shard_config.make_vocab_size_divisible_by
        head = Sub(
            "lm_head",
            VocabParallelLMHead1D,
            {"gather_output": True, "make_vocab_size_divisible_by": multiple},
        )
        return self.append_or_create_submodule_replacement(head, policy, type(self.model).__name__)
