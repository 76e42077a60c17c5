"""Where a model's pipeline pieces are: the embeddings, the list of blocks, the final norm and the head.

The layout is data (module paths), given by a cai-shardformer policy, by the user, or read from the model
itself: a Hugging Face config's ``base_model_pp_plan`` names the base model's children in the order the data
flows (embeddings, then the block list, then the final norm) and the causal-LM class's ``_pp_plan`` names the
head. cai-pipeline has no knowledge of model families of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["PipelineLayout", "layout_from_pp_plan"]


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Module paths (relative to the model given to ``split_model``) of the pieces a pipeline splits.

    Args:
        layers: the ``nn.ModuleList`` of blocks, cut into consecutive ranges, one per stage.
        embeddings: modules that run before the blocks, on the first stage only (token and position embeddings).
        final: modules that run after the blocks, on the last stage only (the final norm).
        head: the output head (``lm_head``), on the last stage only; it runs inside the model's own forward.
        base: the base model that stages other than the last call (``"model"``, ``"transformer"``); ``""`` when
            the model has no head and is its own base.

    Example (GPT-2, whose config has no ``base_model_pp_plan``)::

        PipelineLayout(base="transformer", embeddings=("transformer.wte", "transformer.wpe"),
                       layers="transformer.h", final=("transformer.ln_f",), head=("lm_head",))
    """

    layers: str
    embeddings: tuple[str, ...] = ()
    final: tuple[str, ...] = ()
    head: tuple[str, ...] = ()
    base: str = ""

    def __post_init__(self) -> None:
        for name in ("embeddings", "final", "head"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        base, owned = self.base, [self.layers, *self.embeddings, *self.final]
        outside = [p for p in owned if base and not p.startswith(base + ".")]
        if outside:
            raise ValueError(
                f"PipelineLayout: {outside} lie outside the base model {base!r}; embeddings, layers and final "
                "modules are children of the base model, only the head sits beside it"
            )


def layout_from_pp_plan(model: nn.Module) -> PipelineLayout:
    """The layout that a Hugging Face model declares: ``config.base_model_pp_plan`` (embeddings, the block list,
    the final norm, in order) and the model class's ``_pp_plan`` (the head)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"{type(model).__name__}: its config has no base_model_pp_plan, so the pipeline does not know which "
            "modules are the embeddings, the blocks and the final norm; pass layout=PipelineLayout(...) (a "
            "cai-shardformer policy's pipeline layout, or your own module paths)"
        )
    prefix = getattr(model, "base_model_prefix", "")
    base = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    paths = [f"{base}.{k}" if base else k for k in plan]
    lists = [p for p in paths if isinstance(model.get_submodule(p), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(
            f"{type(model).__name__}: base_model_pp_plan {list(plan)} should name exactly one nn.ModuleList of "
            f"blocks, found {lists}; pass layout=PipelineLayout(...)"
        )
    i = paths.index(lists[0])
    # An instance's _pp_plan also lists the base model's entries under their full paths; the head is the rest.
    head = tuple(k for k in getattr(model, "_pp_plan", None) or {} if base and not k.startswith(base + "."))
    return PipelineLayout(
        base=base, embeddings=tuple(paths[:i]), layers=paths[i], final=tuple(paths[i + 1 :]), head=head
    )
