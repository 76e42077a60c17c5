"""Multi-process training through the Booster: mixed precision under every plugin, and no_sync skipping
communication during gradient accumulation. (fp32 step-by-step parity for every plugin is the parity matrix in
integration-tests/test_parity_matrix.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.booster import Booster
from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
from cai.mesh.testing import CollectiveCounter, TinyTransformer, make_batch, run_distributed

STEPS = 8


@dataclass(frozen=True, kw_only=True)
class PrecisionCase:
    plugin: str
    precision: str

    @property
    def id(self) -> str:
        return f"{self.plugin}-{self.precision}"


def build(plugin: str, precision: str) -> tuple[Booster, object]:
    if plugin == "ddp":
        return Booster(plugin=TorchDDPPlugin(), mixed_precision=precision, device="cpu"), None
    factory = {
        "fsdp": lambda: TorchFSDPPlugin(precision=precision),
        # Colossal-AI's default initial_scale for ZeRO is 2**32, which skips the first ~30 fp16 steps.
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision=precision, initial_scale=2**16),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision=precision, initial_scale=2**16),
        "gemini": lambda: GeminiPlugin(precision=precision),
    }
    return Booster(plugin=factory[plugin](), device="cpu"), None


def _train(plugin: str, precision: str) -> list[float]:
    booster, _ = build(plugin, precision)
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, *_ = booster.boost(model, opt)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, labels = make_batch(batch_size=4, seq_len=16, seed=0)
    losses = []
    for _ in range(STEPS):
        x, y = ids.chunk(world)[rank], labels.chunk(world)[rank]
        loss = TinyTransformer.loss(model(x), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    scaler = getattr(opt, "scaler", None)
    if precision == "fp16" and plugin in ("ddp", "fsdp", "zero1", "zero2"):
        assert scaler is not None and scaler.scale > 1, "fp16 must train with a loss scaler"
    if precision == "bf16":
        assert scaler is None, "bf16 never uses a loss scaler"
    return losses


PRECISION_CASES = [
    PrecisionCase(plugin=p, precision=m)
    for p in ("ddp", "fsdp", "zero1", "zero2", "gemini")
    for m in ("bf16", "fp16")
]


@pytest.mark.parametrize("case", PRECISION_CASES, ids=lambda c: c.id)
def test_mixed_precision_trains_close_to_fp32(case: PrecisionCase) -> None:
    low = run_distributed(_train, 2, case.plugin, case.precision)[0]
    ref = run_distributed(_train, 2, case.plugin, "fp32")[0]
    # Same trajectory as fp32 within the precision's rounding, and the loss goes down.
    torch.testing.assert_close(torch.tensor(low), torch.tensor(ref), rtol=3e-2, atol=0)
    assert low[-1] < low[0] - 0.05


def _count_no_sync(plugin: str) -> dict[str, int]:
    booster, _ = build(plugin, "fp32")
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    ids, labels = make_batch(batch_size=2, seq_len=8, seed=1)
    with CollectiveCounter() as inside, booster.no_sync(model, opt):
        booster.backward(TinyTransformer.loss(model(ids), labels), opt)
    with CollectiveCounter() as outside:
        booster.backward(TinyTransformer.loss(model(ids), labels), opt)
        opt.step()
    return {"inside": len(inside.events), "outside": len(outside.events)}


@pytest.mark.parametrize("plugin", ["zero1", "zero2", "gemini"])
def test_no_sync_skips_gradient_communication(plugin: str) -> None:
    for counts in run_distributed(_count_no_sync, 2, plugin):
        assert counts["inside"] == 0 and counts["outside"] > 0, counts


def _ddp_no_sync_equivalence() -> bool:
    """Under DDP, two micro-steps with no_sync on the first equal one step on the joined batch."""
    booster = Booster(plugin=TorchDDPPlugin(), device="cpu")
    model = TinyTransformer(seed=0)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref = TinyTransformer(seed=0)
    ids, labels = make_batch(batch_size=8, seq_len=8, seed=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine_ids, mine_labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
    for i, (x, y) in enumerate(zip(mine_ids.chunk(2), mine_labels.chunk(2))):
        ctx = booster.no_sync(model, opt) if i == 0 else torch.enable_grad()
        with ctx:
            booster.backward(TinyTransformer.loss(model(x), y) / 2, opt)
    TinyTransformer.loss(ref(ids), labels).backward()
    for (_, p), (_, q) in zip(model.unwrap().named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    return True


def test_ddp_no_sync_accumulation_matches_the_joined_batch() -> None:
    assert run_distributed(_ddp_no_sync_equivalence, 2) == [True, True]


GRAD_NORM_STEPS = 2
MAX_NORM = 0.3  # below the gradient norm of every step here, so clipping is active


def _ref_norm(model: torch.nn.Module, norm_type: float = 2.0) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, norm_type=norm_type))


def _grad_norms(plugin: str, clip: bool) -> dict[str, list[float]]:
    """get_grad_norm (and clip_grad_by_norm) through the Booster beside the same model trained in one process on
    the whole batch; every rank returns what it read."""
    booster, _ = build(plugin, "fp32")
    model = TinyTransformer(seed=0)  # odd sizes: FSDP's row shards and ZeRO's buckets are uneven at dp 2
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref = TinyTransformer(seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, list[float]] = {
        k: [] for k in ("got", "want", "got_inf", "want_inf", "clip", "after", "ref_after")
    }
    for step in range(GRAD_NORM_STEPS):
        # every row has the same number of counted labels, so the mean of the ranks' means is the batch mean
        ids, labels = make_batch(batch_size=4, seq_len=16, seed=step)
        booster.backward(TinyTransformer.loss(model(ids.chunk(world)[rank]), labels.chunk(world)[rank]), opt)
        TinyTransformer.loss(ref(ids), labels).backward()
        out["got"].append(opt.get_grad_norm())
        out["want"].append(_ref_norm(ref))
        if plugin in ("zero1", "zero2"):
            with pytest.raises(ValueError, match="norm_type=inf is not supported under ZeRO"):
                opt.get_grad_norm(norm_type=float("inf"))
        else:
            out["got_inf"].append(opt.get_grad_norm(norm_type=float("inf")))
            out["want_inf"].append(_ref_norm(ref, float("inf")))
        if clip:
            out["clip"].append(float(opt.clip_grad_by_norm(MAX_NORM)))  # the norm before clipping
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            out["after"].append(opt.get_grad_norm())
            out["ref_after"].append(_ref_norm(ref))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return out


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("plugin", ["ddp", "fsdp", "zero1", "zero2", "gemini"])
def test_get_grad_norm_is_the_global_norm(plugin: str, clip: bool) -> None:
    results = run_distributed(_grad_norms, 2, plugin, clip)
    for rank, r in enumerate(results):
        # the second step's gradients come from parameters that the (clipped) first step updated
        assert r["got"] == pytest.approx(r["want"], rel=1e-5), (rank, r)
        assert r["got_inf"] == pytest.approx(r["want_inf"], rel=1e-5), (rank, r)
        if clip:
            assert all(w > MAX_NORM * 1.5 for w in r["want"]), "clipping would be inactive: lower MAX_NORM"
            assert r["clip"] == pytest.approx(r["want"], rel=1e-5), (rank, r)
            assert r["after"] == pytest.approx(r["ref_after"], rel=1e-5), (rank, r)
            assert r["after"] == pytest.approx([MAX_NORM] * GRAD_NORM_STEPS, rel=1e-4), (rank, r)


def _tiny_llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip


def _caches(_: int) -> tuple:
    config = _tiny_llama_config()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.config.use_cache
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"), device="cpu")
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    train = model(input_ids=ids, labels=ids)
    asked = model(input_ids=ids, labels=ids, use_cache=True)
    booster.backward(train.loss, opt)
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=ids)
    return (
        train.past_key_values is None,
        asked.past_key_values is not None,
        evaluated.past_key_values is not None,
    )


def test_training_forward_builds_no_kv_cache_unless_asked() -> None:
    # Hugging Face models build a KV cache whenever config.use_cache is on, in training too (a copy of every
    # layer's keys and values, held by the outputs): a boosted model's training forward turns it off, while
    # an explicit use_cache=True and evaluation keep theirs.
    [(none_in_training, asked, evaluated)] = run_distributed(_caches, 1, 0)
    assert none_in_training
    assert asked and evaluated


def _packed_checks(_: int) -> dict:
    config = _tiny_llama_config()
    from transformers import LlamaForCausalLM

    from cai.kernels import _forward

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"), device="cpu")
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    original = _forward._packed_check_original
    calls = []

    def counted(position_ids):
        calls.append(position_ids.shape)
        return original(position_ids)

    _forward._packed_check_original = counted
    try:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)  # two sequences packed in each row
        out = {}
        out["own positions"] = (model(input_ids=ids, labels=ids).loss.item(), len(calls))
        out["packed positions"] = (
            model(input_ids=ids, labels=ids, position_ids=packed).loss.item(),
            len(calls),
        )
        model.eval()
        with torch.no_grad():
            out["evaluation"] = (model(input_ids=ids, labels=ids, use_cache=False).loss.item(), len(calls))
        with torch.no_grad():
            out["reference own"] = reference(input_ids=ids, labels=ids, use_cache=False).loss.item()
            out["reference packed"] = reference(
                input_ids=ids, labels=ids, position_ids=packed, use_cache=False
            ).loss.item()
    finally:
        _forward._packed_check_original = original
    return out


def test_training_forward_skips_the_packed_sequence_check_only_for_its_own_positions() -> None:
    # [Note: packed-sequence check] A training forward without positions, mask or cache does not run transformers'
    # packed-sequence check (a host read of the device); positions the caller passes, and evaluation, are checked
    # as before, and the losses are the unboosted model's (packed positions give another loss).
    [r] = run_distributed(_packed_checks, 1, 0)
    assert r["own positions"] == (pytest.approx(r["reference own"], rel=1e-6), 0)
    assert r["packed positions"] == (pytest.approx(r["reference packed"], rel=1e-6), 1)
    assert r["evaluation"] == (pytest.approx(r["reference own"], rel=1e-6), 2)
    assert abs(r["reference packed"] - r["reference own"]) > 1e-4


def _bf16_loaded(plugin: str, pure_bf16: bool = False) -> dict:
    """A model that comes in bf16, boosted with no precision switch ([Note: fp32 master weights whatever the load
    dtype]); 3 AdamW steps at lr 1e-5, below a bf16 weight's resolution. ``pure_bf16``: the same steps taken on the
    bf16 parameters themselves, in one process, as they would be without the Booster."""
    model = TinyTransformer(seed=0).to(torch.bfloat16)
    model.pos.requires_grad_(False)  # frozen: stays as it came under autocast
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    if not pure_bf16:
        booster = Booster(plugin=TorchDDPPlugin() if plugin == "ddp" else TorchFSDPPlugin(), device="cpu")
        model, opt, *_ = booster.boost(model, opt)
    inner = model.unwrap() if not pure_bf16 else model
    outputs: list[torch.dtype] = []
    inner.head.register_forward_hook(lambda _m, _i, out: outputs.append(out.dtype))
    rank, world = (dist.get_rank(), dist.get_world_size()) if not pure_bf16 else (0, 1)
    ids, labels = make_batch(batch_size=4, seq_len=16, seed=0)
    for _ in range(3):
        loss = TinyTransformer.loss(model(ids.chunk(world)[rank]), labels.chunk(world)[rank])
        if pure_bf16:
            loss.backward()
        else:
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()

    params = {n: full(p) for n, p in inner.named_parameters()}
    trained = [n for n, p in inner.named_parameters() if p.requires_grad]
    moved = sum(int((params[n] != start[n]).sum()) for n in trained) / sum(start[n].numel() for n in trained)
    return {
        "trainable": {str(p.dtype) for p in inner.parameters() if p.requires_grad},
        "frozen": {str(p.dtype) for p in inner.parameters() if not p.requires_grad},
        "compute": str(outputs[0]),
        "moved": moved,
        "params": params,
    }


@pytest.mark.parametrize("plugin", ["ddp", "fsdp"])
def test_a_model_that_comes_in_bf16_steps_fp32_master_weights(plugin: str) -> None:
    # In bf16 itself most of these updates round away; the boosted model keeps them, on every rank alike.
    [pure] = run_distributed(_bf16_loaded, 1, plugin, True)
    assert pure["trainable"] == {"torch.bfloat16"} and pure["moved"] < 0.1, pure["moved"]
    results = run_distributed(_bf16_loaded, 2, plugin)
    for r in results:
        assert r["trainable"] == {"torch.float32"} and r["moved"] > 0.95, (r["trainable"], r["moved"])
        # DDP computes in the dtype the model came in, under autocast, and leaves frozen parameters as they
        # came; FSDP's units hold one dtype, and it computes in its precision (fp32 unless given)
        want = (
            ("torch.bfloat16", {"torch.bfloat16"})
            if plugin == "ddp"
            else ("torch.float32", {"torch.float32"})
        )
        assert (r["compute"], r["frozen"]) == want, r
    for name, value in results[1]["params"].items():
        assert torch.equal(value, results[0]["params"][name]), name
