"""Sequence parallelism in the tp group (split_gather, ring) against the same model unsharded in one process, fp32:
5 AdamW steps with losses, gathered gradients and gathered parameters compared every step; the collectives of a
transformer layer counted; the activations a layer saves measured; configuration errors at optimize()."""

import copy
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import Linear1D_Col, ParallelModule, ShardConfig, ShardFormer
from cai.shardformer.policies.llama import LlamaForCausalLMPolicy

VOCAB = 251  # padded at tp 2 and 4
B, S, H, LAYERS, HEADS = 2, 16, 64, 2, 4  # S = 16: 8 tokens per rank at sp 2, 4 at sp 4


@dataclass(frozen=True)
class Case:
    family: str
    mode: str
    kv_heads: int = 2  # at tp 4: each kv head replicated on two ranks
    checkpointing: bool = False  # Hugging Face gradient checkpointing (recomputes each layer in backward)


def _tiny(family: str, kv_heads: int = 2):
    common = dict(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "qwen2":  # q, k and v with biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if family == "qwen3":  # per-head q/k norms inside attention
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=H // HEADS, **common))
    raise ValueError(family)


def _sp(mode: str | None) -> ShardConfig:
    if mode is None:
        return ShardConfig()
    return ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode=mode)


def _gathered(model, grads: bool = False) -> dict:
    """Every parameter (or its gradient) as the full unpadded tensor, by its original name."""
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            local = p.grad if grads else p
            key = f"{mname}.{pname}" if mname else pname
            out[key] = (
                module.full_tensor(pname, local) if isinstance(module, ParallelModule) else local.detach()
            )
    return out


def _close(actual: dict, expected: dict, name: str) -> None:
    """1e-5 relative, with an absolute floor of 1e-5 of the tensor's largest element (terms that nearly cancel
    carry rounding of the size of the terms; see test_policies)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for k, e in expected.items():
        assert_close(actual[k], e, rtol=1e-5, atol=1e-5 * float(e.abs().max()), name=f"{name} {k}")


def _train(case: Case) -> None:
    ref = _tiny(case.family, case.kv_heads)
    model, _ = ShardFormer(_sp(case.mode)).optimize(copy.deepcopy(ref))
    assert set(model.state_dict()) == set(ref.state_dict())
    if case.checkpointing:  # the split and the regions run again in the recomputation
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # eps=1e-4 as in test_policies: Adam amplifies the rounding of a near-zero gradient by lr / eps.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        where = f"{case} step {step}"
        assert_close(loss, ref_loss, rtol=1e-5, name=f"{where} loss")
        _close(_gathered(model, grads=True), {n: p.grad for n, p in ref.named_parameters()}, f"{where} grad")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        _close(_gathered(model), dict(ref.named_parameters()), f"{where} param")
    # No labels: the gathered final hidden states give the full logits, as the unsharded model.
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        assert_close(
            model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6, name="logits"
        )
    # A length that does not divide by sp is refused with the fix, not padded silently.
    tp = dist.get_world_size()
    with pytest.raises(
        ValueError, match=rf"sequence length {S + 1} does not divide over the {tp} ranks.*pad"
    ):
        model(input_ids=torch.randint(0, VOCAB, (B, S + 1)))


def _matrix(cases: list[Case]) -> None:
    for case in cases:
        _train(case)


MATRIX = [Case(family, mode) for family in ("llama", "qwen3") for mode in ("split_gather", "ring")]
EXTRA = {  # at sp 2 only: biases on the column layers, gradient checkpointing
    2: [
        Case("qwen2", "ring"),
        Case("llama", "split_gather", checkpointing=True),
        Case("llama", "ring", checkpointing=True),
    ],
    4: [],
}


@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_matches_unsharded(sp):
    """Both modes on Llama and Qwen3 at sp (= tp) 2 and 4, one process group per size for the whole matrix."""
    run_distributed(_matrix, sp, MATRIX + EXTRA[sp], timeout=300)


def _collectives(mode: str | None):
    """The collectives of one training forward and backward, as (op, bytes, group size) -> count."""
    model, _ = ShardFormer(_sp(mode)).optimize(_tiny("llama", kv_heads=dist.get_world_size()))
    ids = torch.randint(0, VOCAB, (B, S))
    with CollectiveCounter() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with CollectiveCounter() as bwd:
        loss.backward()
    count = lambda events: Counter((e.op, e.nbytes) for e in events)  # noqa: E731
    assert all(e.group_ranks == tuple(range(dist.get_world_size())) for e in fwd.events + bwd.events)
    return count(fwd.events), count(bwd.events)


def _collectives_all() -> dict:
    return {mode: _collectives(mode) for mode in (None, "split_gather", "ring")}


@pytest.mark.parametrize("sp", [2, 4])
def test_collectives_per_layer(sp):
    """Per transformer layer (L layers), with BSH = b x s x h fp32 bytes:
    plain TP: 2 all-reduces of BSH forward, 2 backward.
    split_gather: forward 2 all-gathers + 2 reduce-scatters of BSH (an all-reduce is a reduce-scatter then an
    all-gather: the same bytes); backward their mirrors (2 reduce-scatters + 2 all-gathers) plus 2 all-gathers
    that re-gather the attention and MLP inputs for the weight gradients (Megatron's, the price of keeping
    1/sp of them), and the 2 norm weights' gradient all-reduces (h floats).
    ring: point-to-point chunks of BSH / sp, sp - 1 sends per ring: forward one gather ring per region (q, k, v
    together; gate and up together) and one reduce-scatter ring per row layer (o, down) = 4 (sp - 1) sends, the
    same bytes as split_gather's forward; backward 2 rings per region and 1 per row layer = 6 (sp - 1) sends,
    the same bytes as split_gather's backward; the 2 norm all-reduces.
    Outside the layers, every mode has the embedding's all-reduce and the loss's all-reduces (forward); the SP
    modes add the final hidden states' all-gather (forward), the split's gradient all-gather and the final
    norm's gradient all-reduce (backward)."""
    got = run_distributed(_collectives_all, sp)[0]
    bsh, L, chunk, norm = B * S * H * 4, LAYERS, B * S * H * 4 // sp, H * 4
    loss = {("all_reduce", 8): 1, ("all_reduce", B * S * 4): 1, ("all_reduce", 3 * B * S * 4): 1}
    fwd, bwd = got[None]
    assert fwd == Counter({("all_reduce", bsh): 2 * L + 2, **loss}), fwd
    assert bwd == Counter({("all_reduce", bsh): 2 * L}), bwd
    fwd, bwd = got["split_gather"]
    assert fwd == Counter(
        {("all_gather_into_tensor", bsh): 2 * L + 1, ("reduce_scatter_tensor", bsh): 2 * L,
         ("all_reduce", bsh): 2, **loss}
    ), fwd  # fmt: skip
    assert bwd == Counter(
        {("reduce_scatter_tensor", bsh): 2 * L, ("all_gather_into_tensor", bsh): 2 * L + 2 * L + 1,
         ("all_reduce", norm): 2 * L + 1}
    ), bwd  # fmt: skip
    fwd, bwd = got["ring"]
    assert fwd == Counter(
        {("isend", chunk): 4 * L * (sp - 1), ("irecv", chunk): 4 * L * (sp - 1),
         ("all_gather_into_tensor", bsh): 1, ("all_reduce", bsh): 2, **loss}
    ), fwd  # fmt: skip
    assert bwd == Counter(
        {("isend", chunk): 6 * L * (sp - 1), ("irecv", chunk): 6 * L * (sp - 1),
         ("all_gather_into_tensor", bsh): 1, ("all_reduce", norm): 2 * L + 1}
    ), bwd  # fmt: skip


def _saved_by_layer(mode: str | None) -> dict[str, int]:
    """Bytes of the activations the first decoder layer saves for backward (parameters excluded, each storage
    once), split into those saved inside its attention and MLP blocks (the tp regions) and outside them."""
    model, _ = ShardFormer(_sp(mode)).optimize(_tiny("llama", kv_heads=dist.get_world_size()))
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    where = ["outside"]
    saved = {"outside": 0, "inside": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[where[-1]] += t.untyped_storage().nbytes()
        return t

    probe = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def enter(*_):
        probe.__enter__()

    def leave(*_):
        probe.__exit__(None, None, None)

    def inside(*_):
        where.append("inside")

    def outside(*_):
        where.pop()

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
    for block in (layer.self_attn, layer.mlp):
        # Before the policy's region hooks: what they save on entry (the ring's slice) is the region's.
        block.register_forward_pre_hook(inside, prepend=True)
        block.register_forward_hook(outside)
    ids = torch.randint(0, VOCAB, (B, S))
    model(input_ids=ids, labels=ids).loss.backward()  # the saved references unpack as in training
    return saved


def _saved_all() -> dict:
    return {mode: _saved_by_layer(mode) for mode in (None, "split_gather", "ring")}


@pytest.mark.parametrize("sp", [2, 4])
def test_saved_activations_shrink_by_sp(sp):
    """Plain TP keeps every activation outside the tp regions (norm inputs and statistics) at full length on every
    rank, and inside them the attention and MLP inputs (b x s x h each, saved by the column layers); the rest of
    a region is already split by tp. With split_gather and ring all of that replicated part is 1/sp: the layer's
    own activations are saved on the sequence slice, and the region inputs are kept as the slice (split_gather
    gathers it again in backward, ring passes it round again)."""
    got = run_distributed(_saved_all, sp)[0]
    tp = got[None]
    inputs = 2 * B * S * H * 4  # the attention and MLP inputs
    split_by_tp = tp["inside"] - inputs  # q, k, v, attention, MLP activations: the same in every mode
    replicated = tp["outside"] + inputs
    for mode in ("split_gather", "ring"):
        assert got[mode]["outside"] * sp == tp["outside"], (mode, got)
        assert got[mode]["inside"] == split_by_tp + inputs // sp, (mode, got)
        assert sum(got[mode].values()) - split_by_tp == replicated // sp, (mode, got)


class _NoSequencePolicy(LlamaForCausalLMPolicy):
    sequence_parallel_modes = ()


def _errors() -> dict:
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes each
    alone = singles[dist.get_rank()]
    attempts = {
        "unknown_mode": lambda: _sp("ulysses"),
        "tp_disabled": lambda: ShardConfig(enable_tensor_parallelism=False, enable_sequence_parallelism=True),
        "tp_of_one": lambda: ShardFormer(
            ShardConfig(tensor_parallel_process_group=alone, enable_sequence_parallelism=True)
        ).optimize(_tiny("llama")),
        "other_sp_group": lambda: ShardFormer(
            ShardConfig(
                sequence_parallel_process_group=alone,
                enable_sequence_parallelism=True,
                sequence_parallelism_mode="ring",
            )
        ).optimize(_tiny("llama")),
        "policy_without_sp": lambda: ShardFormer(_sp("split_gather")).optimize(
            _tiny("llama"), policy=_NoSequencePolicy()
        ),
    }
    out = {}
    for kind, attempt in attempts.items():
        try:
            attempt()
            out[kind] = None
        except (ValueError, NotImplementedError) as e:
            out[kind] = (type(e).__name__, str(e))
    return out


ERRORS = {
    "unknown_mode": ("ValueError", ["'ulysses'", "split_gather", "ring"]),
    "tp_disabled": ("ValueError", ["'split_gather'", "enable_tensor_parallelism=False", "all_to_all"]),
    "tp_of_one": ("ValueError", ["'split_gather'", "1 rank", "tensor_parallel_process_group of 2 or more"]),
    "other_sp_group": ("ValueError", ["'ring'", "[0, 1]", "sequence_parallel_process_group=None"]),
    "policy_without_sp": ("NotImplementedError", ["_NoSequencePolicy", "'split_gather'", "turn sequence"]),
}


def test_bad_configuration_fails_at_optimize_with_the_fix():
    got = run_distributed(_errors, 2)[0]
    for kind, (want_type, fragments) in ERRORS.items():
        assert got[kind] is not None, f"{kind}: no error raised"
        assert got[kind][0] == want_type, (kind, got[kind])
        for f in fragments:
            assert f in got[kind][1], (kind, f, got[kind][1])


def _column_keeps_the_slice() -> None:
    """A standalone split_gather column layer saves its input slice, not the gathered input, and gathers it again
    in every backward that needs it (also a second one over a retained graph)."""
    torch.manual_seed(0)
    native = nn.Linear(H, 32)
    layer = Linear1D_Col.from_native_module(copy.deepcopy(native), None, seq_parallel_mode="split_gather")
    x = torch.randn(B, S, H)
    xin = x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = layer(xin)
    assert (B, S, H) not in saved and list(xin.shape) in [list(s) for s in saved], saved
    with CollectiveCounter() as cc:
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    assert cc.count("all_gather_into_tensor") == 2 and cc.count("reduce_scatter_tensor") == 2, cc.events
    ref = native(x)
    ref.sum().backward()
    assert_close(layer.full_tensor("weight", layer.weight.grad), 2 * native.weight.grad, rtol=1e-5, atol=1e-6)


def test_split_gather_column_keeps_the_slice_and_regathers():
    run_distributed(_column_keeps_the_slice, 2)
