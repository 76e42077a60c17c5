"""The planner (``cai.booster.plan``, ``cai plan``): predicted peaks against the allocations of real training steps on
the CPU, model presets and configs, the order of a plan, the stored calibration, and the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from cai.booster import (
    Booster,
    Hardware,
    ModelSpec,
    activation_checkpointing,
    calibrate,
    largest_model,
    plan,
)
from cai.booster._plan import Candidate
from cai.booster._plan._spec import PRESETS
from cai.gemini import TransformerShape
from cai.mesh._cli import main
from cai.mesh.testing import run_distributed

transformers = pytest.importorskip("transformers")

GiB = 1024**3
MiB = 1024**2
H200 = Hardware.h200()

# Small enough for a step in about a second, large enough that model states (16 bytes a parameter with Adam, about
# 80 MiB) and one micro-batch's activations (about 65 MiB, a third of it the loss's logits) both weigh in the peak.
SEQ, MICRO_BATCH = 128, 4
CONFIG = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=4096, max_position_embeddings=SEQ, tie_word_embeddings=False,
)  # fmt: skip
TOLERANCE = 0.15


def allocation_peak(prof: profile) -> int:
    """The largest sum of live CPU allocations during ``prof``, counted from its start: the allocator's own events
    (signed bytes) in time order. ``prof.events()`` would count an allocation once for every op around it."""
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_allocation_peak_counts_each_allocation_once() -> None:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(10**7)  # 40 MB
        b = torch.zeros(10**7)  # aten::empty inside aten::zeros: one allocation
        del a
        c = torch.empty(2 * 10**7)  # 80 MB: the peak is b and c
        del b, c
    assert allocation_peak(prof) == 12 * 10**7


# ---- predicted peaks against real allocations ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PeakCase:
    plugin: str
    recompute: str
    accumulation: int = 1

    @property
    def id(self) -> str:
        return f"{self.plugin}-{self.recompute}" + (
            f"-accum{self.accumulation}" if self.accumulation > 1 else ""
        )

    @property
    def candidate(self) -> Candidate:
        return Candidate(
            plugin=self.plugin,
            recompute=self.recompute,
            micro_batch=MICRO_BATCH,
            accumulation=self.accumulation,
        )


PEAK_CASES = [
    PeakCase(plugin="ddp", recompute="none"),
    PeakCase(plugin="ddp", recompute="full", accumulation=2),
    PeakCase(plugin="zero2", recompute="none"),
    PeakCase(plugin="zero2", recompute="full"),
    PeakCase(plugin="zero2", recompute="selective", accumulation=2),
    PeakCase(plugin="gemini", recompute="none"),
    PeakCase(plugin="gemini", recompute="full", accumulation=2),
    PeakCase(plugin="fsdp", recompute="none"),
]


def _measure_peak(case: PeakCase) -> int:
    """Two fp32 training steps of the plugin the candidate names, from building the model on: the allocation peak."""
    from cai.kernels.optim import HybridAdam

    c = case.candidate
    ids = torch.randint(0, CONFIG["vocab_size"], (2, c.accumulation, c.micro_batch, SEQ))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        if c.recompute != "none":
            activation_checkpointing(model, c.recompute)
        plugin = c.plugin_call("fp32").build()
        precision = {} if plugin.capabilities.control_precision else {"mixed_precision": "fp32"}
        booster = Booster(plugin=plugin, device="cpu", **precision)
        optimizer = (torch.optim.AdamW if c.plugin == "fsdp" else HybridAdam)(model.parameters(), lr=1e-3)
        model, optimizer, *_ = booster.boost(model, optimizer)
        for step in ids:
            for i, x in enumerate(step):
                last = i == len(step) - 1
                with contextlib.nullcontext() if last else booster.no_sync(model, optimizer):
                    booster.backward(model(input_ids=x, labels=x).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
    return allocation_peak(prof)


@pytest.mark.parametrize("case", PEAK_CASES, ids=lambda c: c.id)
def test_predicted_peak_matches_the_allocations_of_training(case: PeakCase) -> None:
    measured = run_distributed(_measure_peak, 1, case)[0]
    c = case.candidate
    p = plan(
        ModelSpec.from_config(transformers.LlamaConfig(**CONFIG)), seq_len=SEQ,
        global_batch=c.micro_batch * c.accumulation, device="cpu", precision="fp32", kernels=False, hardware=H200,
        plugins=(c.plugin,), recompute=(c.recompute,), micro_batches=(c.micro_batch,),
    )  # fmt: skip
    row = next(r for r in p.rows if r.candidate == c)
    assert row.host_bytes == 0  # no offload on the CPU: nothing beside the device's peak
    predicted = row.gpu_bytes + row.host_bytes  # on the CPU the device is the host
    error = predicted / measured - 1
    parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in row.estimate.gpu_parts.items())
    assert abs(error) <= TOLERANCE, (
        f"{c.label}: predicted {predicted / MiB:.1f} MiB ({parts}), measured {measured / MiB:.1f} MiB: {error:+.1%}"
    )


# ---- models ----------------------------------------------------------------------------------------------------


def _llama_config(preset: dict[str, int]) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=preset["hidden"], num_hidden_layers=preset["layers"], intermediate_size=preset["ffn"],
        vocab_size=preset["vocab"], num_attention_heads=preset["heads"], num_key_value_heads=preset["kv_heads"],
        tie_word_embeddings=False,
    )  # fmt: skip


def test_presets_count_the_parameters_of_their_llama() -> None:
    for name, preset in PRESETS.items():
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(_llama_config(preset))
        spec = ModelSpec.resolve(name)
        # the same tensors in the same order (Gemini packs them into chunks in that order)
        assert spec.numels == ModelSpec.from_model(model).numels, name
        assert spec.params == sum(p.numel() for p in model.parameters()), name
    assert round(ModelSpec.resolve("8b").params / 1e9, 2) == 8.03


def test_resolve_reads_a_config_file_and_a_model_directory(tmp_path) -> None:
    config = transformers.LlamaConfig(**CONFIG)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    by_file = ModelSpec.resolve(str(tmp_path / "config.json"))
    by_dir = ModelSpec.resolve(str(tmp_path))
    assert by_file.numels == by_dir.numels == ModelSpec.from_model(model).numels
    assert by_file.shape == TransformerShape(hidden=256, layers=4, ffn=688, vocab=4096, heads=4, kv_heads=4)
    assert not by_file.tied


def test_resolve_of_an_unknown_name_says_what_it_takes() -> None:
    with pytest.raises(
        ValueError, match=r"'no such model' is no preset \(1b, 3b, 8b, 13b, 70b\), no config file"
    ):
        ModelSpec.resolve("no such model")
    with pytest.raises(ValueError, match="has no hidden_size, num_hidden_layers, num_attention_heads"):
        ModelSpec.from_config({"vocab_size": 32000}, name="odd")


# ---- the plan --------------------------------------------------------------------------------------------------


def test_plan_puts_what_fits_first_fastest_first() -> None:
    gpu, host = 24 * GiB, 120 * GiB
    p = plan("3b", gpu_budget_bytes=gpu, host_budget_bytes=host, global_batch=16, hardware=H200)
    fits = [r.fits for r in p.rows]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)
    assert all(r.fits == (r.gpu_bytes <= gpu and r.host_bytes <= host) for r in p.rows)
    scores = [r.score for r in p.feasible]
    assert scores == sorted(scores, reverse=True)
    # the score is tokens/s, less a margin that host offload must win by
    assert all(r.score == r.tokens_per_s * (0.98 if r.candidate.host_params_frac else 1) for r in p.rows)
    assert p.best is p.rows[0] and p.best.gpu_bytes <= gpu and p.best.host_bytes <= host
    # what does not fit comes smallest first: the closest misses lead
    rest = [r.gpu_bytes for r in p.rows if not r.fits]
    assert rest == sorted(rest)
    assert p.summary().startswith(p.best.plugin) and "fastest of" in p.summary()


def test_plan_with_nothing_that_fits_says_what_is_needed() -> None:
    p = plan("70b", gpu_budget_bytes=8 * GiB, host_budget_bytes=16 * GiB, hardware=H200)
    assert p.best is None and not p.feasible
    smallest = min(p.rows, key=lambda r: r.gpu_bytes)
    summary = p.summary()
    assert summary.startswith("nothing fits 8.0 GiB of GPU and 16.0 GiB of host memory")
    assert f"({smallest.candidate.label}) needs {smallest.gpu_bytes / GiB:.1f} GiB of GPU" in summary


def test_more_host_offload_never_predicts_more_gpu_memory() -> None:
    p = plan("8b", global_batch=8, hardware=H200, plugins=("zero2", "gemini"))
    runs: dict[tuple, list] = {}
    for r in p.rows:
        c = r.candidate
        runs.setdefault((c.plugin, c.recompute, c.micro_batch, c.offload_param_frac), []).append(r)
    for key, rows in runs.items():
        rows.sort(key=lambda r: r.candidate.host_params_frac)
        gpu = [r.gpu_bytes for r in rows]
        assert len(rows) > 1 and gpu == sorted(gpu, reverse=True), (key, gpu)
    for r in p.rows:  # parameters on the host as well
        c = r.candidate
        if c.offload_param_frac:
            kept = p.find(plugin="gemini", recompute=c.recompute, micro_batch=c.micro_batch,
                          offload_optim_frac=c.offload_optim_frac, offload_param_frac=0.0)  # fmt: skip
            assert r.gpu_bytes <= kept.gpu_bytes, c.label


def test_accumulation_amortises_the_host_optimizer() -> None:
    # the host Adam runs once a step: the more micro-batches a step has, the less of the speed offload costs
    def cost(plugin: str, accumulation: int, **offload) -> float:
        p = plan("8b", global_batch=2 * accumulation, hardware=H200, plugins=(plugin,), recompute=("full",),
                 micro_batches=(2,))  # fmt: skip
        on_host = p.find(**offload)
        on_gpu = p.find(offload=False, offload_optim_frac=0.0, offload_param_frac=0.0)
        return 1 - on_host.tokens_per_s / on_gpu.tokens_per_s

    for plugin, offload in (("zero2", {"offload": True}), ("gemini", {"offload_optim_frac": 1.0})):
        costs = [cost(plugin, k, **offload) for k in (1, 4, 16)]
        assert costs[0] > costs[1] > costs[2], (plugin, costs)


def test_largest_model_is_the_deepest_that_fits() -> None:
    budgets = dict(
        gpu_budget_bytes=8 * GiB, host_budget_bytes=16 * GiB, hardware=H200, plugins=("zero2", "gemini")
    )
    p = largest_model("1b", **budgets)
    s = p.model.shape
    assert p.best is not None and s.layers > 16  # deeper than the preset itself
    assert (s.hidden, s.ffn, s.vocab, s.heads, s.kv_heads) == (2048, 5632, 32000, 16, 16)  # 1b's width
    deeper = ModelSpec.from_shape(dataclasses.replace(s, layers=s.layers + 1))
    assert plan(deeper, **budgets).best is None
    with pytest.raises(ValueError, match="not one decoder layer of 1b's width fits"):
        largest_model("1b", gpu_budget_bytes=GiB // 4, host_budget_bytes=GiB // 4, hardware=H200)


def test_hardware_is_stored_per_device(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CAI_CACHE_DIR", str(tmp_path))
    other = dataclasses.replace(H200, device="another GPU", copy_gbs=1000.0)
    assert Hardware.load(H200.device) is None
    path = H200.save()
    assert path == tmp_path / "plan-calibration.json"
    other.save()  # beside it, not over it
    assert Hardware.load(H200.device) == H200
    assert Hardware.load("another GPU") == other


def test_calibrate_on_the_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CAI_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    hw = calibrate(device="cpu", anchor=False, log=None)
    assert time.perf_counter() - start < 15
    assert hw.device == "cpu" and hw.peak_tflops is None
    rates = [hw.attention_tflops, hw.copy_gbs, hw.pcie_gbs, hw.host_copy_gbs, hw.host_adam_params_per_s]
    assert all(r > 0 for r in rates) and all(tflops > 0 for _, tflops in hw.matmul_tflops), hw
    assert hw.gpu_mem_bytes > 0 and hw.matmul_rate(100) > 0
    hw.save()
    assert Hardware.load("cpu") == hw
    p = plan(ModelSpec.from_config(transformers.LlamaConfig(**CONFIG)), global_batch=4, seq_len=SEQ, hardware=hw,
             device="cpu", precision="fp32", kernels=False)  # fmt: skip
    assert p.best is not None and p.best.tokens_per_s > 0


# ---- cai plan --------------------------------------------------------------------------------------------------


@pytest.fixture
def no_stored_calibration(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CAI_CACHE_DIR", str(tmp_path))


PLAN_3B = ["plan", "--model", "3b", "--gpu-mem", "24", "--host-mem", "120", "--global-batch", "16"]


def test_cli_prints_the_table_with_the_best_row_marked(capsys, no_stored_calibration) -> None:
    assert main(PLAN_3B) == 0
    out = capsys.readouterr().out
    assert "| configuration | activations |" in out
    assert len([line for line in out.splitlines() if line.startswith("| * |")]) == 1
    assert "fastest of" in out


def test_cli_json_has_the_best_row(capsys, no_stored_calibration) -> None:
    assert main([*PLAN_3B, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["best"]
    assert best is not None and best == data["rows"][0]
    assert best["fits"] and best["gpu_gib"] <= 24 and best["host_gib"] <= 120


def test_cli_without_a_model_says_to_give_one(capsys) -> None:
    assert main(["plan"]) == 2
    assert "give --model" in capsys.readouterr().err


def test_cli_largest_names_the_model_it_found(capsys, no_stored_calibration) -> None:
    args = ["--model", "1b", "--largest", "--gpu-mem", "8", "--host-mem", "16", "--plugins", "zero2,gemini"]
    assert main(["plan", *args, "--top", "1"]) == 0
    captured = capsys.readouterr()
    budgets = dict(gpu_budget_bytes=8 * GiB, host_budget_bytes=16 * GiB, plugins=("zero2", "gemini"))
    p = largest_model("1b", hardware=H200, **budgets)
    assert captured.out.startswith(f"largest model that fits: {p.model.shape.layers} layers")
    assert "does not fit" in captured.err  # the search's progress


def test_cli_when_nothing_fits(capsys, no_stored_calibration) -> None:
    assert main(["plan", "--model", "70b", "--gpu-mem", "8", "--host-mem", "16"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_unknown_plugin_or_recompute_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"'zero3' unknown; plugins are ddp, fsdp, zero1, zero2, gemini, hybrid"
    ):
        plan("1b", plugins=("zero3",), hardware=H200)
    with pytest.raises(ValueError, match=r"'partial' unknown.*recompute policies none, selective, full"):
        plan("1b", recompute=("partial",), hardware=H200)


def test_offloaded_layers_trade_recompute_and_gpu_memory_for_pcie_time() -> None:
    fractions = (0.0, 0.25, 0.5, 1.0)
    p = plan("8b", global_batch=2, hardware=H200, plugins=("zero2",), micro_batches=(2,),
             offload_activations=fractions)  # fmt: skip
    assert {r.candidate.offload_activations for r in p.rows} == set(fractions)
    assert all(r.candidate.recompute == "none" for r in p.rows if r.candidate.offload_activations == 1.0)
    for policy in ("none", "selective", "full"):
        rows = [p.find(recompute=policy, offload=False, offload_activations=f) for f in fractions[:3]]
        base, quarter, _ = rows
        saved = [r.estimate.gpu_parts["saved activations"] for r in rows]
        exposed = [r.estimate.time_parts.get("activation offload (exposed)", 0.0) for r in rows]
        assert exposed[0] == 0 < exposed[1] < exposed[2], (policy, exposed)
        if policy == "none":  # the offloaded layers leave the GPU (but those in flight)
            assert saved[0] > saved[1] > saved[2], saved
            assert quarter.gpu_bytes < base.gpu_bytes
        else:  # and run without their recomputation
            assert quarter.estimate.time_parts["compute"] < base.estimate.time_parts["compute"]
    # offload is priced only when asked for, and only beside a GPU
    assert {r.candidate.offload_activations for r in plan("1b", hardware=H200).rows} == {0.0}
    cpu = plan(
        "tiny" if "tiny" in PRESETS else "1b", hardware=H200, device="cpu", offload_activations=(0.0, 0.5)
    )
    assert {r.candidate.offload_activations for r in cpu.rows} == {0.0}
    with pytest.raises(ValueError, match=r"offload_activations=\(1.5,\); give fractions in \[0, 1\]"):
        plan("1b", hardware=H200, offload_activations=(1.5,))


def test_cli_prices_offloaded_activations_when_asked(capsys, no_stored_calibration) -> None:
    args = ["plan", "--model", "8b", "--global-batch", "2", "--plugins", "zero2", "--top", "0", "--json"]
    assert main([*args, "--offload-activations", "0.25"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["candidate"]["offload_activations"] for r in rows} == {0.0, 0.25}
    assert any(r["label"].endswith("+ 0.25 on host, mb 2 x 1") for r in rows)
    assert main([*args, "--offload-activations", "a"]) == 2
    assert "give fractions" in capsys.readouterr().err
