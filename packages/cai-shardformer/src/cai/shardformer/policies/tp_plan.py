"""The automatic policy: a model without a cai-shardformer policy is sharded from the tensor-parallel plan that
transformers ships with it (`config.base_model_tp_plan` and the head model's `_tp_plan`, merged as
`model.tp_plan`), each plan style mapped to cai's layers.

[Note: plan styles]
    colwise                          Linear1D_Col, output split by heads (an attention projection) or features
    rowwise                          Linear1D_Row, input split (by heads in an attention output projection)
    colwise_gather_output, _rep      Linear1D_Col(gather_output=True); on the lm_head VocabParallelLMHead1D
                                     (gathered logits, or the vocab-parallel loss); on an embedding Embedding1D
    rowwise_split_input, _rep        Linear1D_Row(input_is_parallel=False): a replicated input is split first
    embedding_rowwise                VocabParallelEmbedding1D
    replicated_with_grad_allreduce   replicated, gradients all-reduced (`reduce_param_grads`: per-head q/k norms)
    sequence_parallel                replicated: cai's sequence parallelism is chosen by ShardConfig, and
                                     transformers' style splits no activation under plain tp either
Anything else (packed and MoE styles, MLA, all_reduce) raises naming the style and the module path.

An attention projection is a planned layer whose parent module has an integer `head_dim`; its head count is its
width over `head_dim`, and when its output stays split the parent's head counts (`num_heads`,
`num_key_value_heads`, ... and `num_key_value_groups`) become the per-rank ones. A parent holding both split
column layers and a row layer (an attention or MLP block) is one tp input region (see [Note: one all-reduce per
region]); column layers elsewhere all-reduce their own input gradient.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from cai.shardformer._embedding import Embedding1D, VocabParallelEmbedding1D, VocabParallelLMHead1D
from cai.shardformer._layout import padded_vocab
from cai.shardformer._linear import Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import ModulePolicyDescription, Policy, reduce_param_grads
from cai.shardformer._policy import SubModuleReplacementDescription as Sub
from cai.shardformer.policies.llama import install_vocab_parallel_loss

__all__ = ["TpPlanPolicy", "model_tp_plan"]

_GATHERED_COL = ("colwise_gather_output", "colwise_rep")
_SPLIT_ROW = ("rowwise_split_input", "rowwise_rep")
_REPLICATED = ("sequence_parallel",)
STYLES = ("colwise", "rowwise", *_GATHERED_COL, *_SPLIT_ROW, "embedding_rowwise", "replicated_with_grad_allreduce", *_REPLICATED)  # fmt: skip
_Q_HEADS = ("num_heads", "num_attention_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan (module-path pattern, `*` for a layer index -> style), or {}."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    return dict(getattr(config, "base_model_tp_plan", None) or {})


@dataclass(frozen=True)
class _Entry:
    path: str  # the module's path in the model
    style: str
    module: nn.Module
    parent: str  # the parent module's path ("" for the root)


def _pattern(key: str) -> re.Pattern:
    return re.compile(r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split(".")))


def _head_dim(module: nn.Module) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    return head_dim if isinstance(head_dim, int) and head_dim > 0 else None


class TpPlanPolicy(Policy):
    """Shards any Hugging Face model from its `tp_plan` (see [Note: plan styles]); `get_autopolicy` returns it for
    a model whose class has no policy of its own."""

    def config_sanity_check(self) -> None:
        model, tp = self.model, self.shard_config.tensor_parallel_size
        name = type(model).__name__
        plan = model_tp_plan(model)
        if not plan:
            raise NotImplementedError(
                f"{name} has no base_model_tp_plan; write a policy and pass it as policy="
            )
        self._entries: list[_Entry] = []
        self._tied = False
        if tp == 1:
            return  # nothing is sharded, so no style needs a mapping (a MoE plan at tp 1 is fine)
        modules = dict(model.named_modules())
        entries = []
        for key, style in plan.items():
            pattern = _pattern(key)
            for path, module in modules.items():
                if not pattern.fullmatch(path):
                    continue
                if style not in STYLES:
                    raise NotImplementedError(
                        f"{name}: the tp plan gives {path} the style {style!r}, which cai-shardformer does not map "
                        f"(it maps {list(STYLES)}); write a policy for {name} and pass it as policy="
                    )
                parent = path.rsplit(".", 1)[0] if "." in path else ""
                entries.append(_Entry(path, style, module, parent))
        self._entries = sorted(entries, key=lambda e: e.path)
        self._output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._input = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        out, inp = self._output, self._input
        self._tied = out is not None and inp is not None and out.weight is inp.weight
        for e in self._entries:
            self._check(e, tp, name, modules)
        planned = {e.module for e in self._entries}
        if self._tied and (self._output in planned) != (self._input in planned):
            # The tied partner the plan leaves out is replaced too (see _vocab_parallel).
            partner = self._input if self._output in planned else self._output
            path = next(p for p, m in modules.items() if m is partner)
            style = "embedding_rowwise" if partner is self._input else "colwise_gather_output"
            self._check(_Entry(path, style, partner, path.rpartition(".")[0]), tp, name, modules)
        multiple = self.shard_config.make_vocab_size_divisible_by
        for e in self._entries:  # raises with the fix
            if e.module is self._output:
                padded_vocab(e.module.out_features, tp, multiple)
            elif e.style == "embedding_rowwise":
                padded_vocab(e.module.num_embeddings, tp, multiple)

    def _check(self, e: _Entry, tp: int, name: str, modules: dict[str, nn.Module]) -> None:
        if e.style in ("replicated_with_grad_allreduce", *_REPLICATED):
            return
        if e.style == "embedding_rowwise" or (
            isinstance(e.module, nn.Embedding) and e.style in _GATHERED_COL
        ):
            kind = nn.Embedding
        else:
            kind = nn.Linear
        if not isinstance(e.module, kind):
            raise NotImplementedError(
                f"{name}: the tp plan gives {e.path} the style {e.style!r}, but it is a {type(e.module).__name__}, "
                f"not an nn.{kind.__name__}; write a policy for {name} and pass it as policy="
            )
        if type(e.module).forward is not kind.forward:
            # Gemma's scaled word embedding multiplies in its forward: the parallel layer would drop that.
            raise NotImplementedError(
                f"{name}: {e.path} is a {type(e.module).__name__}, an nn.{kind.__name__} with its own forward, "
                f"which the parallel layer for style {e.style!r} would not run; write a policy for {name} and pass "
                f"it as policy="
            )
        head_dim = _head_dim(modules[e.parent])
        if kind is nn.Linear and e.module is not self._output:
            width = e.module.out_features if e.style.startswith("colwise") else e.module.in_features
            heads = width // head_dim if head_dim and e.style in ("colwise", "rowwise") else None
            if heads is not None and (heads % tp and (e.style == "rowwise" or tp % heads)):
                raise ValueError(
                    f"{name}: {e.path} has {heads} heads of {head_dim}, which do not divide over "
                    f"tensor_parallel_size={tp}; use a tp size that divides {heads}"
                )
            if heads is None and width % tp:
                raise ValueError(
                    f"{name}: {e.path} splits {width} features over tensor_parallel_size={tp}, which does not "
                    f"divide them; use a tp size that divides {width}"
                )

    def _vocab_parallel(self) -> bool:
        """Whether the embedding becomes vocab-parallel: the plan says so, or it is tied to a planned lm_head (a
        tie holds only between two layers that split the vocabulary alike; a tied lm_head the plan leaves out
        follows a vocab-parallel embedding for the same reason)."""
        styles = {e.module: e.style for e in self._entries}
        if isinstance(self._input, nn.Embedding) and styles.get(self._input) == "embedding_rowwise":
            return True
        return self._tied and self._output in styles

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        if tp == 1:
            return {}
        modules = dict(self.model.named_modules())
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        # Parents that hold split column layers and a row layer enter the tp region once.
        split_cols = {e.parent for e in self._entries if e.style == "colwise"}
        rows = {e.parent for e in self._entries if e.style == "rowwise"}
        regions = sorted(split_cols & rows)
        subs, attrs, params = [], {}, []
        vocab_parallel = self._vocab_parallel()
        if vocab_parallel:
            input_path = next(p for p, m in modules.items() if m is self._input)
            subs.append(Sub(input_path, VocabParallelEmbedding1D, vocab))
            planned = {e.module for e in self._entries}
            if self._tied and self._output not in planned:  # the tied head splits its vocabulary alike
                output_path = next(p for p, m in modules.items() if m is self._output)
                subs.append(Sub(output_path, VocabParallelLMHead1D, {"gather_output": True, **vocab}))
        heads: dict[str, list[int]] = {}  # attention parent -> head counts of its split column layers
        for e in self._entries:
            head_dim = _head_dim(modules[e.parent])
            if e.module is self._input and vocab_parallel:
                continue  # above
            if e.style == "embedding_rowwise":
                subs.append(Sub(e.path, VocabParallelEmbedding1D, vocab))
            elif isinstance(e.module, nn.Embedding) and e.style in _GATHERED_COL:
                subs.append(Sub(e.path, Embedding1D, {"gather_output": True}))
            elif e.module is self._output:
                subs.append(Sub(e.path, VocabParallelLMHead1D, {"gather_output": True, **vocab}))
            elif e.style == "colwise":
                kw: dict[str, Any] = {"reduce_input_grad": e.parent not in regions}
                if head_dim:
                    kw["num_heads"] = e.module.out_features // head_dim
                    heads.setdefault(e.parent, []).append(kw["num_heads"])
                subs.append(Sub(e.path, Linear1D_Col, kw))
            elif e.style in _GATHERED_COL:
                subs.append(Sub(e.path, Linear1D_Col, {"gather_output": True}))
            elif e.style == "rowwise":
                subs.append(Sub(e.path, Linear1D_Row, {"num_heads": e.module.in_features // head_dim} if head_dim else {}))  # fmt: skip
            elif e.style in _SPLIT_ROW:
                subs.append(Sub(e.path, Linear1D_Row, {"input_is_parallel": False}))
            elif e.style == "replicated_with_grad_allreduce":
                names = [f"{e.path}.{n}" for n, _ in e.module.named_parameters(recurse=False)]
                params.append(
                    reduce_param_grads(*names, group=self.shard_config.tensor_parallel_process_group)
                )
        for parent, counts in heads.items():
            attrs.update(_local_heads(parent, modules[parent], max(counts), min(counts), tp))
        desc = ModulePolicyDescription(
            attribute_replacement=attrs,
            param_replacement=params,
            sub_module_replacement=subs,
            tp_input_regions=regions,
        )
        return {type(self.model): desc}

    def postprocess(self) -> nn.Module:
        model = self.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, VocabParallelLMHead1D):
            return model
        if self._tied:
            head.weight = model.get_input_embeddings().weight
        # The deferred loss computes head(x) from what the model passes as logits, right for a head followed by a
        # scale (Granite, Cohere) but not by a soft cap.
        capped = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        if (
            self.shard_config.parallel_output
            and type(model).__name__.endswith("ForCausalLM")
            and hasattr(model, "loss_function")
            and not capped
        ):
            install_vocab_parallel_loss(model, head)
        return model


def _local_heads(path: str, attention: nn.Module, q_heads: int, kv_heads: int, tp: int) -> dict[str, int]:
    """The per-rank head attributes of an attention module whose q/k/v outputs are split over tp ranks."""
    local_q, local_kv = q_heads // tp, max(kv_heads // tp, 1)  # one replicated kv head per rank when kv < tp
    prefix = f"{path}." if path else ""
    out = {}
    for attr in (*_Q_HEADS, *_KV_HEADS):
        value = getattr(attention, attr, None)
        if isinstance(value, int) and value in (q_heads, kv_heads):
            out[prefix + attr] = local_q if attr in _Q_HEADS else local_kv
    if isinstance(getattr(attention, "num_key_value_groups", None), int):
        out[prefix + "num_key_value_groups"] = local_q // local_kv
    return out
