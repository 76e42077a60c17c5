"""Applying cai kernels to a Hugging Face Llama-family model by module replacement (no copied forwards)."""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import textwrap
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cai.kernels._forward import trim_training_forward
from cai.kernels._fused_ce import fused_linear_cross_entropy
from cai.kernels._norm import RMSNorm
from cai.kernels._projections import share_input
from cai.kernels._residual import fuse_residuals
from cai.kernels._rope import apply_rotary_pos_emb
from cai.kernels._swiglu import SwiGLUMLP

logger = logging.getLogger(__name__)

# Model types whose modeling file uses the Llama rotary convention (rotate_half, cos/sin of the full or
# leading head dims) in a module-level `apply_rotary_pos_emb(q, k, cos, sin, ...)`.
ROPE_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_SILU_NAMES = frozenset({"SiLU", "SiLUActivation"})


class FusedLMHead(nn.Linear):
    """The lm_head `nn.Linear` (same weight and bias parameters) that can defer its matmul to the loss.

    While `defer` is set (by the hook that :func:`patch_hf_model` installs, only for a training forward
    that has labels), `forward` returns its input unchanged and the model's loss function computes
    `fused_linear_cross_entropy(hidden, weight, labels)`; otherwise it is a plain linear layer.
    """

    defer: bool = False

    @classmethod
    def take_over(cls, linear: nn.Linear) -> FusedLMHead:
        head = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        head.weight = linear.weight  # the same Parameter: tied embeddings stay tied
        head.bias = linear.bias
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.defer:
            return x
        return F.linear(x, self.weight, self.bias)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _patch_norms(model: nn.Module) -> int:
    count = 0
    for name, mod in list(model.named_modules()):
        cls = type(mod).__name__
        # Gemma-style norms scale by (1 + weight): a different formula, left alone.
        if not cls.endswith("RMSNorm") or cls.startswith("Gemma") or isinstance(mod, RMSNorm):
            continue
        weight = getattr(mod, "weight", None)
        eps = getattr(mod, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
            continue
        new = RMSNorm(weight.shape[0], eps, device="meta")
        new.weight = weight
        _replace(model, name, new)
        count += 1
    return count


def is_swiglu_mlp(module: nn.Module) -> bool:
    """True for an MLP computing ``down(silu(gate(x)) * up(x))``: cai-kernels' ``SwiGLUMLP``, or a module with
    ``gate_proj``, ``up_proj``, ``down_proj`` and a SiLU ``act_fn`` (Llama, Mistral, Qwen2 and the like)."""
    if isinstance(module, SwiGLUMLP):
        return True
    has_projections = all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj"))
    return has_projections and type(getattr(module, "act_fn", None)).__name__ in _SILU_NAMES


def _patch_mlps(model: nn.Module) -> int:
    count = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, SwiGLUMLP) or not is_swiglu_mlp(mod):
            continue
        _replace(model, name, SwiGLUMLP.from_mlp(mod))
        count += 1
    return count


def _patch_projections(model: nn.Module) -> int:
    return sum(share_input(mod) for mod in model.modules() if type(mod).__name__.endswith("Attention"))


def _patch_rope(model: nn.Module) -> list[str]:
    patched = []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ROPE_MODEL_TYPES:
        logger.warning(
            "rotary not patched: model_type %r is not one of %s", model_type, sorted(ROPE_MODEL_TYPES)
        )
        return patched
    for mod in model.modules():
        if not type(mod).__name__.endswith("Attention"):
            continue
        modeling = sys.modules[type(mod).__module__]
        fn = getattr(modeling, "apply_rotary_pos_emb", None)
        if fn is None or fn is apply_rotary_pos_emb or modeling.__name__ in patched:
            continue
        if list(inspect.signature(fn).parameters)[:4] != ["q", "k", "cos", "sin"]:
            continue
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
        patched.append(modeling.__name__)
    return patched


# [Note: where the head's output goes]
# Deferring the head hands the hidden states to whatever the model's forward does with the head's output. That is
# the loss only where the forward passes the output, untouched, to ``self.loss_function``: Llama, Mistral, Qwen,
# GPT-2, OPT, Falcon and most causal LMs. Gemma 2/3 soft-cap the logits first, Granite and Cohere scale them, T5 and
# Whisper call their own CrossEntropyLoss: deferred, each would compute a loss of the hidden states, silently
# wrong. So the forward's source is read: one name is assigned ``self.lm_head(...)`` (or its ``.contiguous()``)
# and never written again, and every ``self.loss_function`` call is given that name as its logits.


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _head_call(node: ast.AST) -> bool:
    """``self.lm_head(...)`` or ``self.lm_head(...).contiguous()``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "contiguous":
        node = node.func.value
    return isinstance(node, ast.Call) and _is_self_attr(node.func, "lm_head")


@functools.cache
def head_feeds_loss(cls: type) -> bool:
    """Whether ``cls.forward`` hands its lm_head's output untouched to ``self.loss_function`` (see
    [Note: where the head's output goes]); False where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    writes: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], None
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                writes.setdefault(target.id, []).append(value)
    heads = [name for name, values in writes.items() if any(v is not None and _head_call(v) for v in values)]
    if len(heads) != 1 or len(writes[heads[0]]) != 1:
        return False
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_self_attr(n.func, "loss_function")]

    def given_head_output(call: ast.Call) -> bool:
        named = [k.value for k in call.keywords if k.arg == "logits"]
        arg = named[0] if named else call.args[0] if call.args else None
        return isinstance(arg, ast.Name) and arg.id == heads[0]

    return bool(calls) and all(given_head_output(c) for c in calls)


def defer_lm_head_loss(
    model: nn.Module,
    head: nn.Module,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor, int, str], torch.Tensor],
) -> None:
    """Compute a Hugging Face causal LM's training loss from the hidden states, never building the logits.

    ``head`` is the model's lm_head and has a ``defer`` flag: while it is set, its forward returns its input. For a
    training-mode forward with ``labels``, a hook sets it, the model hands the hidden states to its
    ``loss_function`` in the logits slot, and the wrapper installed here calls
    ``loss(head, hidden, shifted_labels, ignore_index, reduction)`` (labels shifted as Hugging Face's
    ForCausalLMLoss does, tokens < n predicting n; ``num_items_in_batch`` honoured); the output's ``logits`` is then
    None. In eval mode or without labels everything is unchanged. cai-kernels' fused linear cross-entropy and
    cai-shardformer's vocab-parallel one both come in this way.

    ``head`` is the head of the model that runs: a copy of ``model`` (a pipeline stage is a deep copy that shares
    or copies modules) shares these hooks, and its own output embeddings are found when its forward starts.
    """
    original = model.loss_function
    signature = inspect.signature(model.forward)
    running = [head]  # the head of the model whose forward is running (see above)

    def loss_function(
        logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw
    ):
        head = running[0]
        if not head.defer:
            return original(
                logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kw,
            )  # fmt: skip
        head.defer = False
        hidden = logits  # the deferred lm_head returned its input: (B, T, H) hidden states
        if shift_labels is None:  # tokens < n predict n, as Hugging Face's ForCausalLMLoss
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        out = loss(head, hidden, shift_labels.to(hidden.device), ignore_index, reduction)
        return out / num_items_in_batch if num_items_in_batch is not None else out

    def pre_hook(module, args, kwargs):
        labels = signature.bind_partial(*args, **kwargs).arguments.get("labels")
        own = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        running[0] = own if hasattr(own, "defer") else head
        running[0].defer = module.training and labels is not None

    def post_hook(module, args, kwargs, output):
        if not module.training or getattr(output, "logits", None) is None:
            return output
        bound = signature.bind_partial(*args, **kwargs).arguments
        if bound.get("labels") is None:
            return output
        # The "logits" slot holds hidden states when the matmul was deferred: drop it rather than mislead.
        running[0].defer = False
        if isinstance(output, tuple):
            return output
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})

    model.loss_function = loss_function
    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)


def _patch_loss(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or not hasattr(model, "loss_function"):
        return False
    if not head_feeds_loss(type(model)):
        logger.info(
            "fused loss not applied: %s.forward does not hand its lm_head output untouched to self.loss_function "
            "(see [Note: where the head's output goes])",
            type(model).__name__,
        )
        return False
    if isinstance(head, FusedLMHead):  # already patched: the loss wrapper and hooks are in place
        return True
    head = FusedLMHead.take_over(head)
    model.lm_head = head
    defer_lm_head_loss(
        model,
        head,
        lambda head, hidden, labels, ignore_index, reduction: fused_linear_cross_entropy(
            hidden, head.weight, labels, bias=head.bias, ignore_index=ignore_index, reduction=reduction
        ),
    )
    return True


def patch_hf_model(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    swiglu: bool = True,
    rope: bool = True,
    fused_loss: bool = True,
    shared_qkv: bool = True,
    fused_residual: bool = True,
    training_forward: bool = True,
) -> nn.Module:
    """Use cai kernels in a Hugging Face Llama-family model (Llama, Mistral, Qwen2/3), in place.

    What is replaced, exactly:
    - `rms_norm`: every `*RMSNorm` module with `weight` and `variance_epsilon` (Gemma's `1 + weight` norms
      excluded) becomes :class:`cai.kernels.RMSNorm` holding the same weight Parameter.
    - `swiglu`: every MLP with `gate_proj`, `up_proj`, `down_proj` and a SiLU `act_fn` becomes
      :class:`cai.kernels.SwiGLUMLP` holding the same three Linear modules.
    - `rope`: the module-level `apply_rotary_pos_emb` of the attention module's modeling file (for example
      `transformers.models.llama.modeling_llama`) is set to :func:`cai.kernels.apply_rotary_pos_emb`.
      Attention forwards look the function up in that module at call time and transformers 5.x offers no
      per-instance hook for it; the patch therefore affects every model of that family in the process (the
      two functions compute the same values). Only for `config.model_type` in `ROPE_MODEL_TYPES`.
    - `fused_loss`: `lm_head` becomes :class:`FusedLMHead` (same Parameters, so tied embeddings stay tied),
      `model.loss_function` is wrapped, and forward hooks are added. In a training-mode forward with
      `labels`, the lm_head returns the hidden states and the loss is
      :func:`cai.kernels.fused_linear_cross_entropy` (labels shifted as Hugging Face does, `num_items_in_batch`
      honoured): the logits are never materialised and `outputs.logits` is None. In eval mode, or without
      labels, the forward is unchanged. With `return_dict=False` the logits slot is left as returned. Only for a
      model whose forward hands its lm_head output untouched to `self.loss_function` (:func:`head_feeds_loss`,
      [Note: where the head's output goes]); others (soft-capped or self-computed losses) keep their head.
    - `shared_qkv`: the `q_proj`, `k_proj` and `v_proj` (plain `nn.Linear`) of every `*Attention` module get a
      `forward` instance attribute that computes the three in one autograd function, whose backward adds the
      input gradients inside the matmuls ([Note: shared-input projections]); the modules stay `nn.Linear`.
    - `fused_residual`: every decoder layer of the pre-norm form (Llama, Mistral, Qwen2/3 and the like) whose two
      norms are now cai's gets a `forward` instance attribute that does its first residual add, and the gradient
      adds of both, inside the norm kernels ([Note: residual adds in the norms]); the layer keeps its class.
    - `training_forward`: :func:`cai.kernels.trim_training_forward`: training forwards build no KV cache unless
      asked for one, and skip transformers' host test for packed sequences when the model numbers the tokens
      itself ([Note: packed-sequence check]).

    State dict keys are unchanged. Returns `model`.

    Example:
        >>> model = patch_hf_model(LlamaForCausalLM(config))
        >>> model(input_ids=ids, labels=ids).loss.backward()
    """
    norms = _patch_norms(model) if rms_norm else 0
    mlps = _patch_mlps(model) if swiglu else 0
    rope_modules = _patch_rope(model) if rope else []
    loss = _patch_loss(model) if fused_loss else False
    attentions = _patch_projections(model) if shared_qkv else 0
    layers = fuse_residuals(model) if fused_residual else 0
    trimmed = trim_training_forward(model) if training_forward else False
    logger.info(
        "cai kernels: %d RMSNorm, %d MLP, rotary in %s, fused loss %s, %d shared q/k/v, %d layers with fused "
        "residual adds, trimmed training forward %s",
        norms, mlps, rope_modules, loss, attentions, layers, trimmed,
    )  # fmt: skip
    return model
