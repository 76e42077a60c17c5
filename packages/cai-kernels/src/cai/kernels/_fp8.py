"""FP8 linear layers for training: dynamic scaling, FP8 operands in all three matmuls.

[Note: fp8 linear]
``y = x W^T`` and its two backward products (``dx = dy W``, ``dW = dy^T x``) each multiply FP8 operands and
accumulate in fp32. The scales are dynamic: ``amax / fp8_max`` of the tensor at hand, every call, so there is no
history to keep or checkpoint. How many scales an operand gets is the recipe ([Note: fp8 recipes]). On a CUDA device
of compute capability 8.9 or more the bf16 products are ``torch._scaled_mm``; elsewhere the same quantised operands
are dequantised and multiplied in fp32 (the emulation the CPU tests check against), which gives the same values up
to the order of accumulation. The parameters stay in their dtype (the optimizer's master copy is untouched): only
the matmul inputs are quantised, each time.

[Note: fp8 recipes]
- ``"tensorwise"`` (the default): one scale per operand. The transposed operands of the backward products are the
  same values written transposed under the same scale: the forward keeps its FP8 input and both scales for the
  backward, which writes ``x^T`` from those bytes, ``W^T`` under the weight's scale and ``dy^T`` from ``dy``'s FP8.
  No operand is reduced twice, the input is not read again in bf16, and what an eager linear keeps for its backward
  is one byte an input element instead of two (in a compiled block the graph's partitioner chooses what to keep;
  on one H200 the step times and peak memory were unchanged). Activations and weights are e4m3; gradients are e5m2
  (``TENSORWISE_GRAD_DTYPE``), whose range covers a whole tensor under one scale.
- ``"rowwise"``: one scale per row of the reduction, so ``W^T``, ``dy^T`` and ``x^T`` are each quantised again
  over the other dimension. Every operand is e4m3, gradients too (``GRAD_DTYPE``): a scale per row already fits each
  row's range, so e4m3's extra mantissa bit is worth more than e5m2's range. cai-shardformer's tensor-parallel
  layers use it because a row's scale is the same on every shard of a column-split weight, so a slice's product is
  the unsharded layer's exactly; one scale per tensor would differ between shards.
Measured on one H200 with compiled blocks (examples/benchmarks/RESULTS.md), each recipe against the bf16 row of
its own run: 1B b8 s2048 1.22x bf16 tensor-wise against 1.10x row-wise; Llama-3-8B shape b2 s2048 with
checkpointing 1.16x against 1.15x. On the main job's 16-32 digit task (1B, 300 steps, two seeds) the tensor-wise
loss stayed within 0.8% of bf16's at steps 50-100 and ended at 0.0067 and 0.0100 against bf16's 0.0060 and 0.0218
(row-wise 0.0092 and 0.0077); exact match 96.1% and 95.3% against 96.9% and 86.7%.

On the eager row-wise path, projections that read the same input (q, k and v; gate and up) would quantise it once
each, in forward and again (transposed) for their weight gradients. The last few quantisations of activations are
kept, keyed by the storage's address, the layout, the version counter and the target dtype; an entry holds the
storage, so no other tensor can take that address while it lives, and an in-place change bumps the version: a hit is
the same bytes quantised the same way. Leaves are never kept there: parameters (quantised per call, or kept
tensor-wise below) and gradients (each read once).

[Note: fp8 kept weights]
A weight changes once an optimizer step, and a step may hold several forwards (accumulation) and, under
checkpointing, a recompute of each: each pass would take the weight's amax and cast it again, and the backward would
cast ``W^T`` from the bf16 weight once more. A layer with ``keep_fp8_weight`` (tensor-wise recipe) keeps its weight
in FP8 with its scale, quantised again only when the weight changed: keyed by its storage address and version
counter. The FP8 bytes are those the forward would write, and ``W^T`` is them transposed, so the products are the
same. The version counter is what tells: torch's optimizers and in-place ops bump it, and cai's own writers of
parameter memory (cai-zero's working buffers, HybridAdam's kernels) bump it by hand; a writer that bypasses both (a
raw kernel, ``param.data.copy_``) must call ``torch.autograd.graph.increment_version`` on the parameters. It costs
one byte a weight element; ``LowLevelZeroPlugin(use_fp8=True)`` turns it on, where the bf16 weights are whole on
every rank anyway. A graph reads a kept weight only inside ``fp8_weights_ready(module)``, which brings the weights
of ``module``'s layers up to date eagerly first (``cai.booster.compile_blocks`` enters it around each call of a
checkpointed block); elsewhere a traced forward quantises the weight in its graph, since a graph cannot check a
version counter. Uncheckpointed compiled blocks do not enter it: with one forward a step their in-graph cast is
fused and was faster than keeping (examples/benchmarks/RESULTS.md).

[Note: fp8 host time]
An FP8 linear is six quantisations and three matmuls where the bf16 one is three matmuls. Launched one by one from
Python (Triton's launcher, allocations, ``_scaled_mm``'s checks), that measured 1.36 ms of host time per linear on
an H200 host, whatever the shape: more than the GPU needs for a 4096 x 4096 projection of 4,096 tokens, so the GPU
waited. Where ``_scaled_mm`` runs all three products (CUDA, bf16 operands, every dimension a multiple of 16), the
forward and the backward of a linear are instead each one ``torch.compile``d function (``_forward_body`` and
``_backward_body`` row-wise, ``_forward_tensorwise`` and ``_backward_tensorwise``): Inductor fuses each quantisation
into one kernel and launches them from generated code, one Python call per direction. The graphs are static, one per
shape (tokens x in x out; a decoder has four or five projection shapes): marking the token count dynamic cost both
host and GPU time (1.65 against 0.90 ms of host time and 1.54 against 1.11 ms in all for a 4096 x 4096 x 4096
linear). The first ``_MAX_GRAPH_SHAPES`` shapes get graphs and later ones take the eager path, so batches of many
lengths do not recompile without end; where compiling fails (no Triton or C compiler for Inductor), one warning is
logged and every linear runs eagerly; in a model that its caller compiles, the bodies join the caller's graph (with
no limit on shapes, and no cache: a graph has no storage addresses). The bodies quantise every operand themselves
(the cache above serves the eager path only). Host time per linear on an H200 host drops from about 1.36 ms to
0.9-1.1 ms this way, still four to five times the bf16 linear's: that is why ``LowLevelZeroPlugin(use_fp8=True)``
compiles whole decoder blocks (``cai.booster.compile_blocks``), where the quantisations also fuse into the norms and
activations around them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from cai.kernels._dispatch import use_triton

__all__ = [
    "Fp8Linear",
    "convert_to_fp8",
    "fp8_linear",
    "fp8_matmul",
    "fp8_tensor_cores",
    "fp8_weights_ready",
    "quantize_rowwise",
]

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
GRAD_DTYPE = E4M3  # the gradients' FP8 type, row-wise (see [Note: fp8 recipes])
TENSORWISE_GRAD_DTYPE = E5M2  # the gradients' FP8 type with one scale a tensor (see [Note: fp8 recipes])
_EPS = 1e-12


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) as FP8 with one fp32 scale per row: ``x ~= q.float() * scale``; returns ``(q, scale (M, 1))``,
    ``q`` row-major whatever the layout of ``x`` (a transposed view is read in place). One or two Triton kernels on
    CUDA (``_fp8_triton``), the same values in torch elsewhere."""
    if use_triton(x) and x.dim() == 2:
        return _quantize_rowwise_triton(x, dtype)
    return _quantize_rowwise_torch(x, dtype)


def _quantize_rowwise_torch(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(_EPS)
    scale = amax / torch.finfo(dtype).max
    q = (x.float() / scale).to(dtype).contiguous()
    return q, scale


def _quantize_tensorwise_torch(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as FP8 with one fp32 scale for the whole tensor (a 0-dim tensor), row-major whatever its layout: a
    transposed view is written transposed, so one amax serves both layouts of an operand."""
    amax = x.detach().abs().amax().float().clamp_min(_EPS)
    scale = amax / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype).contiguous(), scale


# Tiles of 4,096 elements: BLOCK_M x BLOCK_K, long along the contiguous dimension of x (whole 128-byte lines for
# a bf16 row-major tensor; 32-byte sectors of 16 rows for a transposed one).
_ROW_MAJOR_TILE = (8, 512)
_TRANSPOSED_TILE = (16, 256)


def _quantize_rowwise_triton(
    x: torch.Tensor, dtype: torch.dtype, programs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # programs: how many programs fill the device (None: two per SM), below which rows are split across programs
    import triton

    from cai.kernels._fp8_triton import quantize_rows_kernel, quantize_split_kernel, row_amax_kernel
    from cai.kernels._norm_triton import _sm_count

    M, K = x.shape
    q = torch.empty(M, K, dtype=dtype, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, scale.fill_(_EPS / torch.finfo(dtype).max)
    block_m, block_k = _ROW_MAJOR_TILE if x.stride(1) == 1 else _TRANSPOSED_TILE
    block_k = min(block_k, triton.next_power_of_2(K))
    row_blocks = triton.cdiv(M, block_m)
    # on CPU (the interpreter) any count exercises both paths
    programs = programs or 2 * (_sm_count(x.device.index or 0) if x.is_cuda else 64)
    fp8_max = torch.finfo(dtype).max
    if row_blocks >= programs or block_k >= K:
        quantize_rows_kernel[(row_blocks,)](
            x, q, scale, M, K, x.stride(0), x.stride(1), FP8_MAX=fp8_max, EPS=_EPS, BLOCK_M=block_m, BLOCK_K=block_k,
        )  # fmt: skip
        return q, scale
    splits = min(triton.cdiv(programs, row_blocks), triton.cdiv(K, block_k))
    chunk = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, chunk)
    amax = torch.zeros(M, dtype=torch.float32, device=x.device)
    grid = (row_blocks, splits)
    row_amax_kernel[grid](x, amax, M, K, x.stride(0), x.stride(1), chunk, BLOCK_M=block_m, BLOCK_K=block_k)
    quantize_split_kernel[grid](
        x, q, amax, scale, M, K, x.stride(0), x.stride(1), chunk,
        FP8_MAX=fp8_max, EPS=_EPS, BLOCK_M=block_m, BLOCK_K=block_k,
    )  # fmt: skip
    return q, scale


_CACHE_SIZE = 4
_cache: OrderedDict[tuple, tuple[torch.UntypedStorage, torch.Tensor, torch.Tensor]] = OrderedDict()


def _quantized(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(x, dtype)``, or the kept result of the same call on the same bytes (see
    [Note: fp8 linear])."""
    if torch.compiler.is_compiling():  # a graph has no storage addresses to key on
        return quantize_rowwise(x, dtype)
    owner = x._base if x._base is not None else x
    if owner.grad_fn is None:
        return quantize_rowwise(x, dtype)
    storage = x.untyped_storage()
    key = (storage.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x._version, dtype)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit[1], hit[2]
    q, scale = quantize_rowwise(x, dtype)
    _cache[key] = (storage, q, scale)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return q, scale


@functools.cache
def _fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9) and hasattr(torch, "_scaled_mm")


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether the FP8 linears' products run on ``device``'s FP8 tensor cores (``torch._scaled_mm``): a CUDA device
    of compute capability 8.9 or more. Elsewhere they are emulated (see [Note: fp8 linear])."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    # under dynamo, the uncached function: dynamo reads the capability as a constant but warns at a cached one
    if torch.compiler.is_compiling():
        return _fp8_tensor_cores.__wrapped__(index)
    # asked three times a linear a step: the device's answer is looked up once
    return _fp8_tensor_cores(index)


def _scaled_mm_ok(a: torch.Tensor) -> bool:
    return fp8_tensor_cores(a.device)


def _scaled_product(qa, sa, qb, sb, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` from quantised operands ``qa`` (M, K) and ``qb`` (N, K) on the FP8 tensor cores; the scales are
    row-wise ((M, 1) and (N, 1)) or tensor-wise (0-dim)."""
    # the second operand must be column-major: qb is (N, K) row-major, so qb.t() is (K, N) column-major
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)


def _emulated_product(qa, sa, qb, sb, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product as :func:`_scaled_product` from the dequantised operands, in fp32."""
    return ((qa.float() * sa) @ (qb.float() * sb).t()).to(out_dtype)


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    a_dtype: torch.dtype = E4M3,
    b_dtype: torch.dtype = E4M3,
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` (M, K) and ``b`` (N, K), both quantised row-wise over K (see [Note: fp8 linear])."""
    qa, sa = _quantized(a, a_dtype)
    qb, sb = _quantized(b, b_dtype)
    if out_dtype == torch.bfloat16 and _scaled_mm_ok(a) and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0:
        return _scaled_product(qa, sa, qb, sb, out_dtype)
    return _emulated_product(qa, sa, qb, sb, out_dtype)


def _forward_body(x2: torch.Tensor, weight: torch.Tensor, *, product=_scaled_product):
    """``(x2 @ weight.T, x2)`` in FP8, the quantisations in torch (what ``torch.compile`` fuses; [Note: fp8 host
    time]); the tensors after the product are what the backward reads (here the input, quantised again there)."""
    qx, sx = _quantize_rowwise_torch(x2, E4M3)
    qw, sw = _quantize_rowwise_torch(weight, E4M3)
    return product(qx, sx, qw, sw, x2.dtype), x2


def _backward_body(
    dy2: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, *, product=_scaled_product
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy2 @ weight, dy2.T @ x2)`` in FP8 as :func:`_forward_body` does it."""
    qd, sd = _quantize_rowwise_torch(dy2, GRAD_DTYPE)
    qwt, swt = _quantize_rowwise_torch(weight.t(), E4M3)
    dx = product(qd, sd, qwt, swt, x2.dtype)
    qdt, sdt = _quantize_rowwise_torch(dy2.t(), GRAD_DTYPE)
    qxt, sxt = _quantize_rowwise_torch(x2.t(), E4M3)
    return dx, product(qdt, sdt, qxt, sxt, weight.dtype)


def _forward_tensorwise(x2: torch.Tensor, weight: torch.Tensor, *, product=_scaled_product):
    """:func:`_forward_body` with one scale per operand (see [Note: fp8 recipes]); the backward reads the quantised
    input and both scales: ``(y, qx, sx, sw)``."""
    qx, sx = _quantize_tensorwise_torch(x2, E4M3)
    qw, sw = _quantize_tensorwise_torch(weight, E4M3)
    return product(qx, sx, qw, sw, x2.dtype), qx, sx, sw


def _backward_tensorwise(
    dy2: torch.Tensor,
    weight: torch.Tensor,
    qx: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    *,
    product=_scaled_product,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_backward_body` with one scale per operand. Each transposed operand is the forward's FP8 bytes
    written transposed under the forward's scale, so nothing is reduced twice: ``x^T`` from ``qx``, ``W^T`` from
    ``weight`` under ``sw``, ``dy^T`` from ``dy``'s own FP8 (see [Note: fp8 recipes])."""
    qd, sd = _quantize_tensorwise_torch(dy2, TENSORWISE_GRAD_DTYPE)
    qwt = (weight.t().float() / sw).to(E4M3).contiguous()
    dx = product(qd, sd, qwt, sw, dy2.dtype)  # y, and so dy, has the input's dtype
    return dx, product(qd.t().contiguous(), sd, qx.t().contiguous(), sx, weight.dtype)


def _forward_kept(x2: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, *, product=_scaled_product):
    """:func:`_forward_tensorwise` from the layer's kept FP8 weight ([Note: fp8 kept weights]): ``(y, qx, sx)``."""
    qx, sx = _quantize_tensorwise_torch(x2, E4M3)
    return product(qx, sx, qw, sw, x2.dtype), qx, sx


def _backward_kept(
    dy2: torch.Tensor,
    qw: torch.Tensor,
    qx: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    *,
    product=_scaled_product,
    weight_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_backward_tensorwise` with ``W^T`` the kept FP8 weight's bytes transposed (the same values)."""
    qd, sd = _quantize_tensorwise_torch(dy2, TENSORWISE_GRAD_DTYPE)
    dx = product(qd, sd, qw.t().contiguous(), sw, dy2.dtype)
    return dx, product(qd.t().contiguous(), sd, qx.t().contiguous(), sx, weight_dtype or dy2.dtype)


def _requantise_into(weight: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> None:
    q, scale = _quantize_tensorwise_torch(weight, E4M3)
    qw.copy_(q)
    sw.copy_(scale)


@functools.cache
def _compiled_requantise():
    return torch.compile(_requantise_into, fullgraph=True)


def _requantise(weight: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> None:
    """Write ``weight`` in FP8 into ``qw`` and its scale into ``sw``, in place: one compiled graph on a GPU (two
    kernels, where eager torch takes five passes over the weight), eager elsewhere."""
    global _compile_failed
    if weight.is_cuda and not _compile_failed:
        try:
            return _compiled_requantise()(weight, qw, sw)
        except torch._dynamo.exc.TorchDynamoException as e:
            _compile_failed = True
            logger.warning("cai-kernels FP8: compiling the weight cast failed, running it eagerly (%s)", e)
    _requantise_into(weight, qw, sw)


_weights_ready = False  # inside fp8_weights_ready(): traced forwards read the layers' kept FP8 weights


def _kept_weight(linear: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's weight in FP8 and its scale, quantised again only when the weight changed ([Note: fp8 kept
    weights]); None where the layer keeps none or a traced forward cannot trust what it kept."""
    if not linear.keep_fp8_weight or linear.recipe != "tensorwise":
        return None
    if torch.compiler.is_compiling():
        return linear.__dict__.get("_cai_fp8_weight") if _weights_ready else None
    weight = linear.weight
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, tuple(weight.shape))
    kept = linear.__dict__.get("_cai_fp8_weight")
    if kept is not None and linear.__dict__["_cai_fp8_key"] == key:
        return kept
    if kept is None or kept[0].shape != weight.shape or kept[0].device != weight.device:
        kept = (
            torch.empty(weight.shape, dtype=E4M3, device=weight.device),
            torch.empty((), dtype=torch.float32, device=weight.device),
        )
    with torch.no_grad():
        _requantise(weight.detach(), *kept)
    # in __dict__, not as buffers: a module's .to(dtype) would cast them, and state dicts must not hold them
    linear.__dict__["_cai_fp8_weight"], linear.__dict__["_cai_fp8_key"] = kept, key
    return kept


@contextlib.contextmanager
def fp8_weights_ready(module: nn.Module):
    """Bring the kept FP8 weights of ``module``'s layers up to date, and let forwards traced by ``torch.compile``
    inside this context read them ([Note: fp8 kept weights]). Checkpointed compiled blocks
    (``cai.booster.compile_blocks``) enter it around each call; a caller compiling its own model around layers that keep their weights enters it
    around the compiled call."""
    global _weights_ready
    for m in module.modules():
        if isinstance(m, Fp8Linear):
            _kept_weight(m)
    before, _weights_ready = _weights_ready, True
    try:
        yield
    finally:
        _weights_ready = before


_BODIES = {
    "rowwise": (_forward_body, _backward_body),
    "tensorwise": (_forward_tensorwise, _backward_tensorwise),
}
RECIPES = tuple(_BODIES)


@functools.cache
def _compiled(body):
    return torch.compile(body, dynamic=False, fullgraph=True)


def _in_graph(body, *tensors: torch.Tensor):
    """``body(*tensors)`` through its compiled graph, or None once compiling has failed here (no Triton for
    Inductor, no compiler): the caller then takes the eager path, which computes the same values."""
    global _compile_failed
    if torch.compiler.is_compiling():  # inside the caller's own torch.compile: its graph takes the body in
        return body(*tensors)
    try:
        # detached: the bodies are the autograd function's insides, and an input that requires grad would have
        # dynamo trace a backward of _scaled_mm, which has none
        return _compiled(body)(*(t.detach() for t in tensors))
    except torch._dynamo.exc.TorchDynamoException as e:
        _compile_failed = True
        logger.warning("cai-kernels FP8: compiling the linear layers failed, running them eagerly (%s)", e)
        return None


_compile_failed = False
_MAX_GRAPH_SHAPES = 6  # below dynamo's recompile limit (8 graphs a function), with room for stride variants
_graph_shapes: set[tuple[int, int, int]] = set()


def _graph_for(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x2 @ weight.T``'s shape has, or may take, compiled bodies: the first ``_MAX_GRAPH_SHAPES``
    shapes do; later ones take the eager path (batches of many lengths would otherwise recompile without end)."""
    key = (x2.shape[0], x2.shape[1], weight.shape[0])
    if key not in _graph_shapes and len(_graph_shapes) < _MAX_GRAPH_SHAPES:
        _graph_shapes.add(key)
    return key in _graph_shapes


def _scaled_mm_takes(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``_scaled_mm`` runs all three products of ``x2 @ weight.T``: FP8 tensor cores, bf16 activations and
    every dimension a multiple of 16 (the tokens too: the weight gradient reduces over them)."""
    return (
        _scaled_mm_ok(x2)
        and x2.dtype == torch.bfloat16
        and x2.shape[0] % 16 == 0
        and x2.shape[1] % 16 == 0
        and weight.shape[0] % 16 == 0
    )


def _whole_body(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this linear runs as two compiled bodies ([Note: fp8 host time]): all three products on
    ``_scaled_mm`` (:func:`_scaled_mm_takes`) with bf16 weights too."""
    return (
        not _compile_failed
        and _scaled_mm_takes(x2, weight)
        and weight.dtype == torch.bfloat16
        # a caller's graph (the compiled blocks) has its own shape rules
        and (torch.compiler.is_compiling() or _graph_for(x2, weight))
    )


def _eager_product(tensor_cores: bool):
    """The product the eager tensor-wise path takes: FP8 tensor cores where they take every product
    (:func:`_scaled_mm_takes`), else the emulation."""
    return _scaled_product if tensor_cores else _emulated_product


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: str,
        qw: torch.Tensor | None = None,
        sw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # qw, sw: the layer's kept FP8 weight and its scale, tensor-wise ([Note: fp8 kept weights])
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # decided once for both directions: the backward has no x2 to ask about on the tensor-wise path
        ctx.graph, ctx.tensor_cores = _whole_body(x2, weight), _scaled_mm_takes(x2, weight)
        ctx.kept, ctx.weight_dtype = qw is not None, weight.dtype
        product = _eager_product(ctx.tensor_cores)
        if ctx.kept:
            out = _in_graph(_forward_kept, x2, qw, sw) if ctx.graph else None
            y, qx, sx = out if out is not None else _forward_kept(x2, qw, sw, product=product)
            saved = (qw, qx, sx, sw)
        else:
            forward_body = _BODIES[recipe][0]
            out = _in_graph(forward_body, x2, weight) if ctx.graph else None
            if out is None:
                if recipe == "rowwise":
                    out = fp8_matmul(x2, weight, out_dtype=x.dtype), x2
                else:
                    out = forward_body(x2, weight, product=product)
            y, *rest = out
            saved = (weight, *rest)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(*saved)
        ctx.has_bias = bias is not None
        ctx.shape = shape
        ctx.recipe = recipe
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dy2 = dy.reshape(-1, dy.shape[-1])
        graph = ctx.graph and not _compile_failed and dy2.dtype == torch.bfloat16
        product = _eager_product(ctx.tensor_cores)
        if ctx.kept:
            saved = ctx.saved_tensors
            grads = _in_graph(_backward_kept, dy2, *saved) if graph else None
            if grads is None:
                grads = _backward_kept(dy2, *saved, product=product, weight_dtype=ctx.weight_dtype)
            dx, dw = grads
        else:
            weight, *saved = ctx.saved_tensors
            backward_body = _BODIES[ctx.recipe][1]
            grads = _in_graph(backward_body, dy2, weight, *saved) if graph else None
            if grads is not None:
                dx, dw = grads
            elif ctx.recipe == "rowwise":
                (x2,) = saved
                # dx = dy @ W: reduce over out_features, so W's columns are the rows to scale
                # (transposed views: the quantiser reads them in place and writes row-major FP8)
                dx = fp8_matmul(dy2, weight.t(), out_dtype=x2.dtype, a_dtype=GRAD_DTYPE)
                # dW = dy^T @ x: reduce over tokens
                dw = fp8_matmul(dy2.t(), x2.t(), out_dtype=weight.dtype, a_dtype=GRAD_DTYPE)
            else:
                dx, dw = backward_body(dy2, weight, *saved, product=product)
        db = dy2.sum(0).to(ctx.weight_dtype) if ctx.has_bias else None
        return dx.reshape(ctx.shape), dw, db, None, None, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "tensorwise"
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and both backward matmuls in FP8 (see [Note: fp8 linear]);
    ``recipe`` is ``"rowwise"`` or ``"tensorwise"`` ([Note: fp8 recipes])."""
    if recipe not in _BODIES:
        raise ValueError(f"fp8_linear: recipe {recipe!r} is not one of {RECIPES}")
    return _Fp8LinearFunction.apply(x, weight, bias, recipe)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls run in FP8 with dynamic scales (the same
    ``weight`` and ``bias`` Parameters; state dicts are unchanged). Built by :func:`convert_to_fp8`; ``recipe``
    says how the operands are scaled ([Note: fp8 recipes])."""

    recipe: str = "tensorwise"
    keep_fp8_weight: bool = False  # keep the weight in FP8 between its changes ([Note: fp8 kept weights])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)  # evaluation runs in the parameters' precision
        kept = _kept_weight(self)
        if kept is None:
            return fp8_linear(x, self.weight, self.bias, self.recipe)
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self.recipe, *kept)


def convert_to_fp8(
    model: nn.Module,
    *,
    skip: tuple[str, ...] = ("lm_head",),
    recipe: str = "tensorwise",
    keep_weights: bool = False,
) -> int:
    """Turn ``model``'s ``nn.Linear`` layers into :class:`Fp8Linear`, in place; returns how many.

    Skipped: module names ending in one of ``skip`` (the output head by default: its logits feed the loss and
    FP8 there costs accuracy for little time), and layers whose features are not multiples of 16 (what the FP8
    tensor cores take). ``recipe``: ``"tensorwise"`` or ``"rowwise"`` scales ([Note: fp8 recipes]). Layers that
    are FP8 already keep theirs: ``convert_to_fp8(model, recipe="rowwise")`` before ``boost()`` keeps row-wise
    scales under a plugin's ``use_fp8=True``. ``keep_weights``: the converted layers keep their weights in FP8
    between changes, one byte a weight element, tensor-wise only ([Note: fp8 kept weights]).
    """
    if recipe not in _BODIES:
        raise ValueError(f"convert_to_fp8: recipe {recipe!r} is not one of {RECIPES}")
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.split(".")[-1] in skip:
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        module.__class__ = Fp8Linear  # same Parameters, hooks and name; only forward changes
        module.recipe = recipe
        module.keep_fp8_weight = keep_weights and recipe == "tensorwise"
        count += 1
    return count
