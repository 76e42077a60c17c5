"""Whisper policies (WhisperModel, WhisperForConditionalGeneration): the encoder's convolution front end and
both position embeddings replicated; encoder and decoder self-attention, the decoder's cross-attention (q/k/v
column by heads, out_proj row) and the MLPs (fc1 column, fc2 row) sharded; the decoder's token embedding
vocab-parallel and `proj_out` vocab-parallel tied to it, with gathered logits (Whisper computes its loss from the
logits itself). As in T5, the cross-attention's k and v each all-reduce the encoder output's gradient."""

from __future__ import annotations

from typing import Any

from torch import nn

from cai.shardformer._embedding import VocabParallelEmbedding1D, VocabParallelLMHead1D
from cai.shardformer._layout import padded_vocab
from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription, Policy
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies._common import check_divisible

__all__ = ["WhisperForConditionalGenerationPolicy", "WhisperModelPolicy", "WhisperPolicy"]


def _attention(path: str, nh: int, tp: int, cross: bool = False) -> list[Sub]:
    col = {
        "num_heads": nh,
        "reduce_input_grad": False,
    }  # q (and k, v in self-attention) read the region's input
    kv = {"num_heads": nh} if cross else col
    return [
        Sub(f"{path}.q_proj", Linear1D_Col, col),
        Sub(f"{path}.k_proj", Linear1D_Col, kv),
        Sub(f"{path}.v_proj", Linear1D_Col, kv),
        Sub(f"{path}.out_proj", Linear1D_Row, {"num_heads": nh}),
    ]


class WhisperPolicy(Policy):
    def config_sanity_check(self) -> None:
        cfg, tp = self.model.config, self.shard_config.tensor_parallel_size
        check_divisible(
            type(self.model).__name__, tp,
            encoder_attention_heads=cfg.encoder_attention_heads, decoder_attention_heads=cfg.decoder_attention_heads,
            encoder_ffn_dim=cfg.encoder_ffn_dim, decoder_ffn_dim=cfg.decoder_ffn_dim,
        )  # fmt: skip
        padded_vocab(
            cfg.vocab_size, tp, self.shard_config.make_vocab_size_divisible_by
        )  # raises with the fix

    def preprocess(self) -> nn.Module:
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        self._tied = out is not None and out.weight is inp.weight
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        cfg = self.model.config
        enc, dec = cfg.encoder_attention_heads, cfg.decoder_attention_heads
        mlp = [Sub("fc1", Linear1D_Col), Sub("fc2", Linear1D_Row)]
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        return {
            "WhisperEncoderLayer": ModulePolicyDescription(
                attribute_replacement={"self_attn.num_heads": enc // tp},
                sub_module_replacement=[*_attention("self_attn", enc, tp), *mlp],
                tp_input_regions=["self_attn"],
            ),
            "WhisperDecoderLayer": ModulePolicyDescription(
                attribute_replacement={"self_attn.num_heads": dec // tp, "encoder_attn.num_heads": dec // tp},
                sub_module_replacement=[
                    *_attention("self_attn", dec, tp),
                    *_attention("encoder_attn", dec, tp, cross=True),
                    *mlp,
                ],
                tp_input_regions=["self_attn", "encoder_attn"],
            ),
            "WhisperDecoder": ModulePolicyDescription(
                sub_module_replacement=[Sub("embed_tokens", VocabParallelEmbedding1D, vocab)]
            ),
        }

    def postprocess(self) -> nn.Module:
        return self.model


class WhisperModelPolicy(WhisperPolicy):
    pass


class WhisperForConditionalGenerationPolicy(WhisperPolicy):
    """Adds the vocab-parallel `proj_out` (logits gathered over the real vocabulary), tied to the decoder's token
    embedding when the model ties them (Whisper's default)."""

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        policy = super().module_policy()
        if not policy:
            return policy
        multiple = self.shard_config.make_vocab_size_divisible_by
        head = Sub(
            "proj_out",
            VocabParallelLMHead1D,
            {"gather_output": True, "make_vocab_size_divisible_by": multiple},
        )
        return self.append_or_create_submodule_replacement(head, policy, type(self.model).__name__)

    def postprocess(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if self._tied and isinstance(head, VocabParallelLMHead1D):
            head.weight = self.model.get_input_embeddings().weight
        return self.model
