"""``Booster(plugin="auto")``: AutoPlugin plans at boost(), logs its choice, and then trains exactly as the plugin it
chose; host offload needs a host optimizer; a budget nothing fits raises with what is needed."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from cai.booster import Booster, Hardware, ModelSpec, activation_checkpointing, plan
from cai.booster._plan._spec import PRESETS
from cai.booster.plugin import AutoPlugin
from cai.kernels.optim import HybridAdam
from cai.mesh.testing import run_distributed

transformers = pytest.importorskip("transformers")

GiB = 1024**3
CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=32, tie_word_embeddings=False,
)  # fmt: skip
BATCH, SEQ, STEPS = 4, 32, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def _loader() -> DataLoader:
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(
        TensorDataset(ids.repeat(STEPS, 1)), batch_size=BATCH
    )  # one (BATCH, SEQ) batch, STEPS times


def _train(booster: Booster, model: torch.nn.Module) -> list[float]:
    optimizer = HybridAdam(model.parameters(), lr=3e-3)
    model, optimizer, _, loader, _ = booster.boost(model, optimizer, None, _loader())
    losses = []
    for (ids,) in loader:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _auto_and_by_hand(precision: str | None) -> dict:
    """Train with AutoPlugin (``Booster(plugin="auto")`` when ``precision`` is None), then the same model with the
    plugin it chose, built by hand."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("cai")
    logger.addHandler(handler)
    cache = os.environ.get("CAI_CACHE_DIR")
    os.environ["CAI_CACHE_DIR"] = tempfile.mkdtemp()  # no stored calibration: the built-in rates
    try:
        booster = Booster(
            plugin="auto" if precision is None else AutoPlugin(precision=precision), device="cpu"
        )
        auto = booster.plugin
        losses = _train(booster, _model())
    finally:
        logger.removeHandler(handler)
        if cache is None:
            del os.environ["CAI_CACHE_DIR"]
        else:
            os.environ["CAI_CACHE_DIR"] = cache
    chosen = auto.chosen.candidate
    plugin = chosen.plugin_call(auto.precision).build()
    model = _model()
    if chosen.recompute != "none":
        activation_checkpointing(model, chosen.recompute)
    mixed = {} if plugin.capabilities.control_precision else {"mixed_precision": auto.precision}
    reference = _train(Booster(plugin=plugin, device="cpu", **mixed), model)
    return {
        "losses": losses,
        "reference": reference,
        "chosen": chosen,
        "plugin": type(booster.plugin).__name__,
        "expected": type(plugin).__name__,
        "messages": [r.getMessage() for r in records if "AutoPlugin" in r.getMessage()],
    }


@pytest.mark.parametrize("precision", [None, "fp32"], ids=["auto", "auto-fp32"])
def test_auto_chooses_logs_and_trains_as_the_plugin_it_chose(precision: str | None) -> None:
    out = run_distributed(_auto_and_by_hand, 1, precision)[0]
    assert out["plugin"] == out["expected"] != "AutoPlugin"
    assert out["chosen"].micro_batch == BATCH and out["chosen"].accumulation == 1
    assert len(out["messages"]) == 1 and out["messages"][0].startswith("AutoPlugin chose "), out["messages"]
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["reference"]), rtol=1e-6, atol=0)
    assert out["losses"][-1] < out["losses"][0], out  # the same batch every step


def test_auto_needs_a_host_optimizer_to_offload() -> None:
    # a 1B model where only host-offload rows fit the GPU budget
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=PRESETS["1b"]["hidden"], num_hidden_layers=PRESETS["1b"]["layers"],
                intermediate_size=PRESETS["1b"]["ffn"], vocab_size=PRESETS["1b"]["vocab"],
                num_attention_heads=PRESETS["1b"]["heads"], tie_word_embeddings=False,
            )
        )  # fmt: skip
    p = plan(ModelSpec.from_model(model), global_batch=1, seq_len=2048, kernels=False, hardware=Hardware.h200(),
             plugins=("ddp", "fsdp", "zero2", "gemini"), micro_batches=(1,))  # fmt: skip
    budget = min(r.gpu_bytes for r in p.rows if not r.candidate.host_params_frac) - 1
    assert any(r.gpu_bytes <= budget for r in p.rows if r.candidate.host_params_frac)

    def auto() -> AutoPlugin:
        return AutoPlugin(micro_batch=1, seq_len=2048, gpu_budget_bytes=budget, host_budget_bytes=512 * GiB,
                          kernels=False, hardware=Hardware.h200())  # fmt: skip

    with pytest.raises(ValueError, match="AutoPlugin: nothing fits"):
        auto().resolve(model, torch.optim.AdamW(model.parameters()), None, torch.device("cuda"))
    host = auto()
    host.resolve(model, HybridAdam(model.parameters()), None, torch.device("cuda"))
    assert host.chosen.candidate.host_params_frac > 0 and host.chosen.gpu_bytes <= budget


def test_auto_raises_at_boost_when_nothing_fits() -> None:
    booster = Booster(plugin=AutoPlugin(gpu_budget_bytes=1), device="cpu")
    model = _model()
    with pytest.raises(
        ValueError, match=r"AutoPlugin: nothing fits 0\.0 GiB of GPU .* needs [\d.]+ GiB of GPU"
    ):
        booster.boost(model, HybridAdam(model.parameters()), None, _loader())


def test_auto_needs_the_batch_shape() -> None:
    booster = Booster(plugin="auto", device="cpu")
    assert isinstance(booster.plugin, AutoPlugin) and booster.plugin.precision == "bf16"
    model = _model()
    with pytest.raises(ValueError, match="pass the data loader to boost"):
        booster.boost(model, HybridAdam(model.parameters()))


def _choose_with_rank_budgets(budgets: list[int]) -> str:
    import torch.distributed as dist

    auto = AutoPlugin(micro_batch=BATCH, seq_len=SEQ, gpu_budget_bytes=budgets[dist.get_rank()],
                      host_budget_bytes=64 * GiB, kernels=False, hardware=Hardware.h200())  # fmt: skip
    model = _model()
    auto.resolve(model, HybridAdam(model.parameters()), None, torch.device("cpu"))
    return auto.chosen.candidate.label


def test_ranks_with_different_budgets_choose_the_same_plugin() -> None:
    # the fastest configuration fits rank 0's budget but not rank 1's: both must plan for rank 1's, or their first
    # collectives would belong to different plugins and hang
    p = plan(ModelSpec.from_model(_model()), gpus=2, global_batch=2 * BATCH, seq_len=SEQ, device="cpu",
             kernels=False, hardware=Hardware.h200(), micro_batches=(BATCH,),
             plugins=("ddp", "fsdp", "zero1", "zero2", "gemini"), host_offload=True)  # fmt: skip
    fastest = p.rows[0]
    small = fastest.gpu_bytes - 1
    expected = next(
        r for r in p.rows if r.gpu_bytes <= small and r.candidate.plugin != "fsdp"
    ).candidate.label
    labels = run_distributed(_choose_with_rank_budgets, 2, [64 * GiB, small])
    assert labels[0] == labels[1] == expected != fastest.candidate.label, (
        labels,
        expected,
        fastest.candidate.label,
    )
