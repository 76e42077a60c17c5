"""The training steps that benchmark.py times: cai through the Booster, and the peers of BENCHMARKS.md
(plain PyTorch eager with fused AdamW, torch.compile, FSDP2 at world size 1) on the same model and batch, each
optionally with Liger-Kernel's Llama kernels.

Each builder returns a ``Workload``: a zero-argument ``step()`` that runs one full training step (forward,
backward, optimizer step, zero grad) and a ``close()`` that drops every reference so the next workload starts
from free memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR = 1e-5  # small: random weights on random tokens must not diverge during the timed steps


@dataclass(kw_only=True)
class Workload:
    name: str
    step: Callable[[], None]
    close: Callable[[], None]


def build_model(
    config, device: torch.device, *, grad_ckpt: bool | str, offload_activations: float = 0.0
) -> LlamaForCausalLM:
    """Random-weight fp32 model built directly on ``device`` (no host copy of an 8B model). ``grad_ckpt``: False,
    True or "full" (every block recomputed), or "selective" (matmul and attention outputs kept), the same for cai
    and the peers. ``offload_activations``: the leading fraction of blocks whose activations wait in host memory
    (the checkpointing policy then applies to the others)."""
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    if grad_ckpt or offload_activations:
        from cai.booster import activation_checkpointing

        # Non-reentrant checkpointing works under FSDP2 and torch.compile as well as eager.
        policy = "selective" if grad_ckpt == "selective" else "full" if grad_ckpt else "none"
        activation_checkpointing(model, policy, offload=offload_activations)
    return model


@contextmanager
def restoring_llama_module() -> Iterator[None]:
    """Put back every name of transformers' Llama modeling module, and ``LlamaForCausalLM.forward``, on exit."""
    from transformers.models.llama import modeling_llama

    names = dict(vars(modeling_llama))
    forward = vars(modeling_llama.LlamaForCausalLM)["forward"]
    try:
        yield
    finally:
        for name in vars(modeling_llama).keys() - names.keys():
            delattr(modeling_llama, name)
        vars(modeling_llama).update(names)
        modeling_llama.LlamaForCausalLM.forward = forward


def _apply_liger(model: LlamaForCausalLM) -> None:
    """Liger-Kernel's RoPE, RMSNorm and SwiGLU kernels, and its fused linear cross-entropy: in training mode the
    forward computes the loss from ``labels=`` chunk by chunk and never materialises the logits. The RoPE patch
    replaces a function of transformers' Llama module for the whole process: run under ``restoring_llama_module``."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as exc:
        raise ImportError(f"liger-kernel missing (pip install liger-kernel): {exc}") from exc

    apply_liger_kernel_to_llama(
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=True,
        model=model,
    )


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _adamw(params, device: torch.device) -> torch.optim.Optimizer:
    # fused=True is torch's fastest AdamW on GPU; the CPU smoke run uses the default implementation.
    return torch.optim.AdamW(params, lr=LR, fused=device.type == "cuda")


def _autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=_DTYPES[precision], enabled=precision != "fp32")


def eager(
    config,
    batch: torch.Tensor,
    *,
    precision: str,
    grad_ckpt: bool,
    compile: bool = False,
    pure: bool = False,
    liger: bool = False,
    accum: int = 1,
) -> Workload:
    """Plain PyTorch with fused AdamW: fp32 master weights and ``torch.autocast`` compute in ``precision``, or with
    ``pure`` the parameters themselves in ``precision`` (no master copy: less memory, less exact). ``liger``:
    Liger-Kernel's Llama kernels, before ``torch.compile``. ``accum`` micro-batches (``batch`` each) a step."""
    device = batch.device
    model = build_model(config, device, grad_ckpt=grad_ckpt)
    if liger:
        _apply_liger(model)
    if pure:
        model.to(_DTYPES[precision])
    optimizer = _adamw(model.parameters(), device)
    forward = torch.compile(model) if compile else model
    state = {"model": model, "forward": forward, "optimizer": optimizer}

    def step() -> None:
        for _ in range(accum):
            with _autocast(device, "fp32" if pure else precision):
                loss = state["forward"](input_ids=batch, labels=batch).loss / accum
            loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad(set_to_none=True)

    def close() -> None:
        state.clear()
        if compile:
            torch._dynamo.reset()
        release()

    label = ("torch.compile" if compile else "PyTorch eager") + (" + Liger" if liger else "")
    if precision == "fp32":
        mode = "fp32"
    elif pure:
        mode = f"{precision} parameters"
    else:
        mode = f"{precision} autocast, fp32 master"
    return Workload(name=f"{label} ({mode}, AdamW)", step=step, close=close)


def fsdp2(
    config,
    batch: torch.Tensor,
    *,
    precision: str,
    grad_ckpt: bool,
    cpu_offload: bool,
    liger: bool = False,
    accum: int = 1,
) -> Workload:
    """FSDP2 ``fully_shard`` per decoder layer and at the root: ``precision`` compute, fp32 master and reduce.
    ``liger``: Liger-Kernel's Llama kernels, applied before sharding (the root's forward computes the fused loss
    while the root unit, lm_head included, is unsharded). ``accum`` micro-batches a step, gradients reduced after
    the last only."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = batch.device
    model = build_model(config, device, grad_ckpt=grad_ckpt)
    if liger:
        _apply_liger(model)
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # With offload the parameters live on the host, where the fused CUDA kernel does not apply.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda" and not cpu_offload)
    state = {"model": model, "optimizer": optimizer}

    def step() -> None:
        for i in range(accum):
            state["model"].set_requires_gradient_sync(i == accum - 1)
            loss = state["model"](input_ids=batch, labels=batch).loss / accum
            loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad(set_to_none=True)

    def close() -> None:
        state.clear()
        release()

    offload = ", CPUOffloadPolicy" if cpu_offload else ""
    world = dist.get_world_size() if dist.is_initialized() else 1
    name = f"FSDP2 world {world}{' + Liger' if liger else ''} ({precision} compute, fp32 master{offload})"
    return Workload(name=name, step=step, close=close)


def cai(
    config,
    batch_of: Callable[[int], torch.Tensor],
    *,
    device: torch.device,
    choice,
    grad_ckpt: bool,
    kernels: bool,
    lazy: bool = False,
    offload_activations: float = 0.0,
    accum: int = 1,
    compile_blocks: bool = False,
) -> Workload:
    """The model through ``Booster.boost`` with the plugin ``choice`` names and HybridAdam (Colossal-AI's
    benchmark setup; AdamW under FSDP); ``kernels`` swaps in cai's fused kernels first. ``batch_of(r)`` is
    data-parallel rank r's batch; with pipeline parallelism the step goes through ``execute_pipeline``. ``accum``
    micro-batches a step (``no_sync`` but for the last; pipelined rows take one). ``compile_blocks``: the decoder
    layers' forwards under ``torch.compile`` (``cai.booster.compile_blocks``; FP8 rows compile them anyway).

    Run it after the peers: ``patch_hf_model`` replaces the rotary function of the transformers modeling module
    for the whole process, which would otherwise leak into the peers' models.
    """
    from _plugins import convert_fp8_before_boost, make_booster

    from cai.kernels.optim import HybridAdam

    booster = make_booster(choice)
    batch = batch_of(booster.plugin.dp_rank)
    if lazy:
        # Parameters stay on the meta device until boost() has sharded the model: no full fp32 copy on the GPU.
        # Built under the GPU's device, materialising replays the initialisation there, not on the host.
        from cai.booster import LazyInitContext

        with LazyInitContext(default_device=device):
            model = build_model(config, device, grad_ckpt=grad_ckpt, offload_activations=offload_activations)
    else:
        model = build_model(config, device, grad_ckpt=grad_ckpt, offload_activations=offload_activations)
    if kernels:
        from cai.kernels import patch_hf_model

        patch_hf_model(model)
    convert_fp8_before_boost(model, choice)
    if choice.name == "fsdp":
        # HybridAdam's host kernel does not take FSDP2's DTensor parameters (it crashes the process on CPU);
        # torch's AdamW is what FSDP2 users run anyway.
        optimizer = _adamw(model.parameters(), device)
    else:
        optimizer = HybridAdam(model.parameters(), lr=LR)
    model, optimizer, *_ = booster.boost(model, optimizer)
    if compile_blocks:
        from cai.booster import compile_blocks as compile_

        compile_(model)
    state = {"booster": booster, "model": model, "optimizer": optimizer}

    def step() -> None:
        if choice.pipelined:
            state["booster"].execute_pipeline(
                iter([{"input_ids": batch, "labels": batch}]), state["model"], _hf_loss, state["optimizer"]
            )
        else:
            model, optimizer = state["model"], state["optimizer"]
            for i in range(accum):
                last = i == accum - 1
                with nullcontext() if last else state["booster"].no_sync(model, optimizer):
                    loss = model(input_ids=batch, labels=batch).loss / accum
                    state["booster"].backward(loss, optimizer)
        state["optimizer"].step()
        state["optimizer"].zero_grad()

    def close() -> None:
        state.clear()
        release()

    extras = (" + cai kernels" if kernels else "") + (", compiled blocks" if compile_blocks else "")
    extras += ", lazy init" if lazy else ""
    return Workload(name=f"cai {choice.label} ({choice.precision}){extras}", step=step, close=close)


def _hf_loss(outputs, batch) -> torch.Tensor:
    """The pipeline's criterion: labels are in the batch, so the model computed the loss."""
    return outputs["loss"]
