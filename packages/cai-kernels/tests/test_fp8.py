"""FP8 linear layers: row-wise and tensor-wise quantisation within FP8's rounding error, the emulated matmul equal to
the product of the dequantised operands, forward and both gradients within FP8's known error of fp32 in both
recipes, and a tiny Llama trained in FP8 to the fp32 run's loss band."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from cai.kernels import Fp8Linear, convert_to_fp8, fp8_matmul, quantize_rowwise
from cai.kernels._fp8 import (
    E4M3,
    E5M2,
    GRAD_DTYPE,
    RECIPES,
    TENSORWISE_GRAD_DTYPE,
    _quantize_rowwise_torch,
    _quantize_rowwise_triton,
    _quantize_tensorwise_torch,
)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().float() - want.detach().float()).norm() / want.detach().float().norm())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_rowwise_quantisation_error_is_fp8_rounding(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    )  # rows of very different scales
    q, scale = quantize_rowwise(x, dtype)
    assert q.dtype == dtype and scale.shape == (64, 1)
    back = q.float() * scale
    fmax = torch.finfo(dtype).max
    assert torch.equal(q.float().abs().amax(1), torch.full((64,), fmax))  # each row's amax maps to fp8's max
    mantissa = {E4M3: 3, E5M2: 2}[dtype]
    tiny = {E4M3: 2.0**-9, E5M2: 2.0**-16}[dtype]  # the smallest subnormal, in units of the scale
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), tiny / 2 * scale)  # half an ulp
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tensorwise_quantisation_has_one_scale_for_both_layouts(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 80, generator=g) * torch.logspace(-2, 2, 48)[:, None]
    q, scale = _quantize_tensorwise_torch(x, dtype)
    fmax = torch.finfo(dtype).max
    assert scale.dim() == 0 and q.float().abs().max() == fmax  # the tensor's amax maps to fp8's max
    mantissa = {E4M3: 3, E5M2: 2}[dtype]
    tiny = {E4M3: 2.0**-9, E5M2: 2.0**-16}[dtype]
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), tiny / 2 * scale)
    assert ((q.float() * scale - x).abs() <= bound * (1 + 1e-6)).all()
    # a transposed view comes back row-major with the same scale and the same bytes, transposed
    qt, scale_t = _quantize_tensorwise_torch(x.t(), dtype)
    assert qt.is_contiguous() and torch.equal(scale_t, scale)
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
@pytest.mark.parametrize("programs", [1, 1024], ids=["split-rows", "whole-rows"])
def test_triton_quantiser_is_bitwise_the_torch_one(dtype, layout, programs, device) -> None:
    # Ragged shapes (rows and columns not multiples of the tiles), rows of very different scales and an all-zero
    # row; `programs` forces each of the two launch plans: few programs wanted (whole rows a program) or many (a
    # row split over programs, amaxes combined atomically).
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 1100, generator=g) * torch.logspace(-4, 4, 37)[:, None]
    x[5] = 0.0
    x = x.to(device, torch.bfloat16)
    if layout == "transposed":
        x = x.t().contiguous().t()  # the same values stored column-major, as a weight gradient's operands are
    q, scale = _quantize_rowwise_triton(x, dtype, programs=programs)
    q_ref, scale_ref = _quantize_rowwise_torch(x, dtype)
    assert q.is_contiguous() and q.shape == (37, 1100) and scale.shape == (37, 1)
    assert torch.equal(scale, scale_ref)
    # equal values; the bytes too on a GPU (the interpreter's cast turns -0.0 into +0.0)
    assert torch.equal(q.float(), q_ref.float())
    if q.is_cuda:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_emulated_matmul_is_the_product_of_the_dequantised_operands() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 128, generator=g), torch.randn(48, 128, generator=g)
    qa, sa = quantize_rowwise(a)
    qb, sb = quantize_rowwise(b)
    want = (qa.float() * sa) @ (qb.float() * sb).t()
    torch.testing.assert_close(fp8_matmul(a, b, torch.float32), want, rtol=0, atol=0)
    assert _rel(fp8_matmul(a, b, torch.float32), a @ b.t()) < 0.05  # e4m3 on both sides, K = 128


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_forward_and_gradients_within_fp8_error(impl, recipe) -> None:
    g = torch.Generator().manual_seed(2)
    ref = nn.Linear(128, 64, bias=True)
    fp8 = copy.deepcopy(ref)
    fp8.__class__ = Fp8Linear
    fp8.recipe = recipe
    x = torch.randn(4, 16, 128, generator=g, requires_grad=True)
    x8 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(4, 16, 64, generator=g)
    y, y8 = ref(x), fp8(x8)
    (y * dy).sum().backward()
    (y8 * dy).sum().backward()
    assert _rel(y8, y) < 0.05
    assert _rel(x8.grad, x.grad) < 0.1  # FP8 gradients times FP8 weights
    assert _rel(fp8.weight.grad, ref.weight.grad) < 0.1
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # the bias gradient is an exact sum
    fp8.eval()
    torch.testing.assert_close(fp8(x8), ref(x8))  # evaluation runs the plain linear


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(model, steps: int = 40) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    starts = torch.randint(0, 128, (8, 2, 1), generator=gen)
    data = (starts + 3 * torch.arange(32)) % 128  # each token follows from the one before: learnable
    losses = []
    for step in range(steps):
        ids = data[step % 8]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_convert_keeps_parameters_and_a_tiny_llama_trains_to_the_fp32_band(recipe) -> None:
    base = _llama()
    model = copy.deepcopy(base)
    names = list(model.state_dict())
    assert convert_to_fp8(model, recipe=recipe) == 2 * 7  # every projection; not the lm_head
    assert {m.recipe for m in model.modules() if isinstance(m, Fp8Linear)} == {recipe}
    assert type(model.lm_head) is nn.Linear and list(model.state_dict()) == names
    assert convert_to_fp8(nn.Sequential(nn.Linear(10, 16))) == 0  # features not multiples of 16 stay
    ref, got = _train(base), _train(model)
    assert got[-1] < 0.5 * got[0]  # it learns
    assert abs(sum(got[-8:]) / 8 - sum(ref[-8:]) / 8) < 0.05 * sum(ref[-8:]) / 8


def _projections(monkeypatch, cache_size: int):
    """Three FP8 projections of one activation (q, k, v), forward and backward, counting the quantisations."""
    from cai.kernels import _fp8

    monkeypatch.setattr(_fp8, "_CACHE_SIZE", cache_size)
    _fp8._cache.clear()
    calls = []

    def counting(t, dtype=E4M3):
        calls.append((tuple(t.shape), dtype))
        return quantize_rowwise(t, dtype)

    monkeypatch.setattr(_fp8, "quantize_rowwise", counting)
    torch.manual_seed(0)
    layers = [Fp8Linear(48, 16, bias=False) for _ in range(3)]
    for layer in layers:
        layer.recipe = "rowwise"  # the eager path's cache serves row-wise quantisation
    x = torch.randn(4, 8, 48, requires_grad=True)
    h = x * 2.0  # an activation, as inside a model
    out = sum(layer(h) for layer in layers)
    out.square().sum().backward()
    _fp8._cache.clear()
    return out, x.grad, [layer.weight.grad for layer in layers], calls


def test_projections_of_one_input_quantise_it_once(monkeypatch) -> None:
    out, dx, dws, calls = _projections(monkeypatch, cache_size=4)
    ref_out, ref_dx, ref_dws, ref_calls = _projections(monkeypatch, cache_size=0)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
    assert all(torch.equal(a, b) for a, b in zip(dws, ref_dws, strict=True))
    # the activation (32 x 48) once forward and once transposed (48 x 32) for the weight gradients, not three times;
    # the weights and the gradients (leaves) every time
    assert calls.count(((32, 48), E4M3)) == 1 and ref_calls.count(((32, 48), E4M3)) == 3
    assert calls.count(((48, 32), E4M3)) == 1 and ref_calls.count(((48, 32), E4M3)) == 3
    assert calls.count(((16, 48), E4M3)) == 3 and calls.count(((32, 16), GRAD_DTYPE)) == 3
    assert len(calls) == len(ref_calls) - 4


def test_whole_body_functions_are_the_eager_products() -> None:
    # the bodies the CUDA path compiles ([Note: fp8 host time]), run here with the emulated product, give the
    # eager path's three products bit for bit
    from cai.kernels import _fp8

    g = torch.Generator().manual_seed(3)
    x, w, dy = (
        torch.randn(32, 48, generator=g),
        torch.randn(16, 48, generator=g),
        torch.randn(32, 16, generator=g),
    )
    _fp8._cache.clear()
    y, saved = _fp8._forward_body(x, w, product=_fp8._emulated_product)
    assert torch.equal(y, fp8_matmul(x, w, torch.float32)) and saved is x
    dx, dw = _fp8._backward_body(dy, w, x, product=_fp8._emulated_product)
    assert torch.equal(dx, fp8_matmul(dy, w.t(), torch.float32, a_dtype=GRAD_DTYPE))
    assert torch.equal(dw, fp8_matmul(dy.t(), x.t(), torch.float32, a_dtype=GRAD_DTYPE))


def test_tensorwise_products_are_those_of_the_dequantised_operands() -> None:
    # each of the three products multiplies operands quantised with one scale each, the transposed ones under the
    # scale of the tensor they transpose; gradients in e5m2
    from cai.kernels import _fp8

    g = torch.Generator().manual_seed(6)
    x = torch.randn(32, 48, generator=g) * torch.logspace(-1, 1, 32)[:, None]
    w, dy = torch.randn(16, 48, generator=g), torch.randn(32, 16, generator=g)

    def dequantised(t, dtype):
        scale = t.abs().amax() / torch.finfo(dtype).max
        return (t / scale).to(dtype).float() * scale

    x_, w_, dy_ = dequantised(x, E4M3), dequantised(w, E4M3), dequantised(dy, TENSORWISE_GRAD_DTYPE)
    y, *saved = _fp8._forward_tensorwise(x, w, product=_fp8._emulated_product)
    torch.testing.assert_close(y, x_ @ w_.t())
    dx, dw = _fp8._backward_tensorwise(dy, w, *saved, product=_fp8._emulated_product)
    torch.testing.assert_close(dx, dy_ @ w_)
    torch.testing.assert_close(dw, dy_.t() @ x_)
    # the backward's transposed operands, from the forward's FP8 bytes and scales, are the transposed tensors
    # quantised afresh, bit for bit: one amax serves both layouts
    qx, sx, sw = saved
    for t, q, s in ((x, qx, sx), (w, _fp8._quantize_tensorwise_torch(w, E4M3)[0], sw)):
        q_t, s_t = _fp8._quantize_tensorwise_torch(t.t(), E4M3)
        assert torch.equal(q.t().contiguous().view(torch.uint8), q_t.view(torch.uint8))
        assert torch.equal(s, s_t)
    # the layer's eager path on CPU is these bodies
    xl = x.clone().requires_grad_(True)
    wl = w.clone().requires_grad_(True)
    out = _fp8.fp8_linear(xl, wl, recipe="tensorwise")
    out.backward(dy)
    assert torch.equal(out, y)
    assert torch.equal(xl.grad, dx) and torch.equal(wl.grad, dw)
    with pytest.raises(ValueError, match="recipe 'blockwise' is not one of"):
        _fp8.fp8_linear(x, w, recipe="blockwise")
    with pytest.raises(ValueError, match="recipe 'blockwise' is not one of"):
        convert_to_fp8(nn.Linear(16, 16), recipe="blockwise")


def test_layers_already_fp8_keep_their_recipe() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    assert convert_to_fp8(model, recipe="rowwise", skip=("1",)) == 1
    assert convert_to_fp8(model) == 1  # a plugin's use_fp8 after the user's own conversion
    assert (model[0].recipe, model[1].recipe) == ("rowwise", "tensorwise")


def test_compiled_bodies_are_kept_to_a_few_shapes(monkeypatch) -> None:
    # the first _MAX_GRAPH_SHAPES shapes get graphs, later ones the eager path: no recompiling per batch length
    from cai.kernels import _fp8

    monkeypatch.setattr(_fp8, "_graph_shapes", set())
    w = torch.empty(16, 32)
    taken = [_fp8._graph_for(torch.empty(16 * n, 32), w) for n in range(1, _fp8._MAX_GRAPH_SHAPES + 3)]
    assert taken == [True] * _fp8._MAX_GRAPH_SHAPES + [False, False]
    assert _fp8._graph_for(torch.empty(16, 32), w)  # a shape that has its graphs keeps them


def test_a_failed_compile_falls_back_to_the_eager_path(monkeypatch) -> None:
    # where Inductor cannot compile (no Triton, no compiler), the linear runs eagerly with the same values, once
    # warned, and does not try again
    from cai.kernels import _fp8

    calls = []

    def failing(body):
        def run(*args):
            calls.append(body.__name__)
            raise torch._dynamo.exc.TorchDynamoException("no compiler")

        return run

    monkeypatch.setattr(_fp8, "_compiled", failing)
    monkeypatch.setattr(_fp8, "_compile_failed", False)
    # the CUDA condition, here on CPU, and the eager path's emulated product
    monkeypatch.setattr(_fp8, "_whole_body", lambda x2, weight: not _fp8._compile_failed)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, 32, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, generator=g, dtype=torch.bfloat16, requires_grad=True)
    warned = []  # the logger itself: cai's log setup may stop records from reaching the root logger
    monkeypatch.setattr(_fp8.logger, "warning", lambda msg, *args: warned.append(msg % args))
    y = _fp8.fp8_linear(x, w, recipe="rowwise")
    y.float().square().sum().backward()
    assert calls == ["_forward_body"] and _fp8._compile_failed
    assert len(warned) == 1 and "running them eagerly (no compiler)" in warned[0]
    _fp8._cache.clear()
    x2 = x.detach().reshape(-1, 32)
    assert torch.equal(y.reshape(-1, 16), fp8_matmul(x2, w.detach(), torch.bfloat16))
    dy = 2 * y.detach().float().to(torch.bfloat16).reshape(-1, 16)
    assert torch.equal(w.grad, fp8_matmul(dy.t(), x2.t(), torch.bfloat16, a_dtype=GRAD_DTYPE))


def test_inside_a_compiled_caller_the_body_joins_its_graph(monkeypatch) -> None:
    # a model compiled as a whole traces the FP8 bodies into its own graph instead of calling a second compile
    from cai.kernels import _fp8

    def no_nested_compile(body):
        raise AssertionError("compiled again inside a compiled caller")

    monkeypatch.setattr(_fp8, "_compiled", no_nested_compile)
    x = torch.randn(4, 8)
    out = torch.compile(lambda t: _fp8._in_graph(lambda a: a * 2 + 1, t), backend="eager", fullgraph=True)(x)
    assert torch.equal(out, x * 2 + 1)


def _kept_pair(dtype: torch.dtype) -> tuple[Fp8Linear, Fp8Linear]:
    """Two copies of one tensor-wise FP8 layer, the second keeping its weight in FP8."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 32).to(dtype))
    kept = copy.deepcopy(plain)
    convert_to_fp8(plain)
    convert_to_fp8(kept, keep_weights=True)
    assert kept[0].keep_fp8_weight and not plain[0].keep_fp8_weight
    return plain[0], kept[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_kept_weight_gives_the_unkept_layers_products_and_follows_the_weight(monkeypatch, dtype) -> None:
    # [Note: fp8 kept weights]: the kept bytes are those the forward writes and W^T is them transposed, so the
    # products are bit for bit those of a layer that quantises its weight every pass; the weight is quantised again
    # only after it changed (its version counter), not per forward (accumulation) or per recompute
    from cai.kernels import _fp8

    requantised = []
    real = _fp8._requantise
    monkeypatch.setattr(_fp8, "_requantise", lambda w, qw, sw: (requantised.append(1), real(w, qw, sw)))
    plain, kept = _kept_pair(dtype)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, kept)]
    for step in range(3):
        for _ in range(2):  # two micro-batches accumulated
            x = torch.randn(3, 5, 64, dtype=dtype)
            outs = []
            for m in (plain, kept):
                xi = x.clone().requires_grad_()
                y = m(xi)
                (y.float().square().sum()).backward()
                outs.append((y, xi.grad))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert torch.equal(plain.weight.grad, kept.weight.grad)
        assert torch.equal(plain.bias.grad, kept.bias.grad)
        assert len(requantised) == step + 1
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert list(kept.state_dict()) == ["weight", "bias"]  # what is kept is no state


def test_a_weight_written_without_torch_knowing_is_requantised_once_its_version_is_bumped() -> None:
    plain, kept = _kept_pair(torch.float32)
    x = torch.randn(4, 64)
    kept(x)
    with torch.no_grad():
        kept.weight.data.mul_(3.0)  # through .data: torch does not count it
        plain.weight.mul_(3.0)
    assert not torch.equal(kept(x), plain(x))  # the kept FP8 weight is the old one
    torch.autograd.graph.increment_version(kept.weight)  # what cai-zero and HybridAdam do after their writes
    assert torch.equal(kept(x), plain(x))


def test_compiled_forwards_read_a_kept_weight_only_inside_fp8_weights_ready() -> None:
    from cai.kernels import fp8_weights_ready

    plain, kept = _kept_pair(torch.float32)
    x = torch.randn(4, 64)
    kept(x)  # the kept weight exists
    kept.__dict__["_cai_fp8_weight"][0].zero_()  # spoilt: a graph must not read it unless brought up to date
    compiled = torch.compile(lambda m, t: m(t), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(kept, x), plain(x))  # traced outside the context: quantised in the graph
    with torch.no_grad():
        plain.weight.mul_(0.5)
        kept.weight.mul_(0.5)
    with fp8_weights_ready(kept):  # brings it up to date (the version changed), then the graph reads it
        assert torch.equal(compiled(kept, x), plain(x))
    kept.__dict__["_cai_fp8_weight"][0].zero_()
    with fp8_weights_ready(kept):  # the version did not change: the graph reads what is kept, spoilt here
        assert not torch.equal(compiled(kept, x), plain(x))
