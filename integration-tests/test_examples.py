"""The examples run end to end on CPU: the main job (train, checkpoint, rebuild, resume, accuracy) and the
benchmark harness with its peers. Each runs as a user would start it, in a fresh interpreter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the examples' helper modules (_digits, _perf, _models)


def _run(args: list[str], *, timeout: int, env: dict[str, str] | None = None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)  # the scripts must launch their own workers
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args[0]} exited with {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


@pytest.mark.slow
def test_train_llama_trains_checkpoints_resumes_and_reports_accuracy(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out = _run(
        [str(EXAMPLES / "train_llama.py"), "--steps", "24", "--save-at", "12", "--log-every", "6",
         "--eval-samples", "32", "--ckpt-dir", str(ckpt)],
        timeout=300,
    )  # fmt: skip
    assert "2 x cpu (gloo)" in out, out
    assert re.search(r"step +12/24 .*loss \d+\.\d+ \| [\d,]+ tok/s \| MFU .*% \| mem [\d.]+ GiB", out), out
    assert "saved checkpoint at step 12" in out, out
    # The rebuilt run starts from a different random init: only the checkpoint can make the probe loss agree.
    assert re.search(r"resumed from .* at step 12 \(probe loss [\d.]+, matches the saved run\)", out), out
    assert "step 24/24" in out, out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) \|", out)]
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"
    match = re.search(r"final accuracy: ([\d.]+)% exact match on 32 held-out sequences", out)
    assert match, out
    assert any(p.name.startswith("step-") for p in ckpt.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_train_llama_fp8_trains_in_one_process(recipe: str) -> None:
    """--fp8 (use_fp8=True): the emulated FP8 linear layers on CPU, one process, no checkpoint; --fp8-recipe
    rowwise converts them before boost() and the plugin keeps them."""
    out = _run(
        [str(EXAMPLES / "train_llama.py"), "--fp8", "--fp8-recipe", recipe, "--nproc", "1", "--steps", "12",
         "--save-at", "0", "--log-every", "4", "--eval-samples", "8"],
        timeout=300,
    )  # fmt: skip
    label = "FP8" if recipe == "tensorwise" else "FP8 rowwise"
    assert f"plugin LowLevelZero-2 {label} (fp32) | 1 x cpu (gloo)" in out, out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) \|", out)]
    assert "step 12/12" in out and losses[-1] < losses[0], f"loss did not go down: {losses}\n{out}"


@pytest.mark.slow
def test_train_llama_hybrid_tp2_pp2_trains_checkpoints_resumes_and_reports_accuracy(tmp_path: Path) -> None:
    """The main job through HybridParallelPlugin on 4 gloo processes (tp 2 x pp 2, the 1F1B schedule over 4
    micro-batches, ZeRO-1): training through execute_pipeline, save_state, a rebuilt run that load_states, and
    greedy decoding through the pipeline. 8 steps: the cost is the four workers' start and two boosts."""
    ckpt = tmp_path / "ckpt"
    out = _run(
        [str(EXAMPLES / "train_llama.py"), "--plugin", "hybrid", "--tp", "2", "--pp", "2", "--steps", "8",
         "--save-at", "4", "--log-every", "4", "--eval-samples", "16", "--ckpt-dir", str(ckpt)],
        timeout=300,
    )  # fmt: skip
    assert "plugin HybridParallel tp2 x pp2, ZeRO-1 (fp32) | 4 x cpu (gloo)" in out, out
    assert re.search(r"step 4/8 .*loss \d+\.\d+ \| [\d,]+ tok/s \| MFU .*% \| mem [\d.]+ GiB", out), out
    assert "saved checkpoint at step 4" in out, out
    assert re.search(r"resumed from .* at step 4 \(probe loss [\d.]+, matches the saved run\)", out), out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) \|", out)]
    assert "step 8/8" in out and losses[-1] < losses[0], f"loss did not go down: {losses}\n{out}"
    assert re.search(r"final accuracy: [\d.]+% exact match on 16 held-out sequences", out), out
    assert any(p.name.startswith("step-") for p in ckpt.iterdir())


@pytest.mark.slow
def test_benchmark_tiny_with_peers_prints_one_table_and_json(tmp_path: Path) -> None:
    out = _run(
        [str(EXAMPLES / "benchmarks" / "benchmark.py"), "-c", "tiny", "-p", "ddp", "-b", "2", "-l", "32",
         "-s", "2", "-i", "1", "--no-kernels", "--compare", "--peers", "eager,fsdp2", "--profile", "--accum", "2"],
        timeout=300,
        env={"OUT": str(tmp_path)},
    )  # fmt: skip
    out, profiled = out.split("where a step's time goes")
    rows = [
        line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| configuration")
    ]
    names = [row.split(" | ")[0] for row in rows]
    assert len(rows) == 3, out
    assert (
        names[0].startswith("| PyTorch eager")
        and names[1].startswith("| FSDP2")
        and names[2].startswith("| cai")
    )
    cells = rows[2].strip("| ").split(" | ")
    assert float(cells[1].replace(",", "")) > 0, rows[2]  # tokens/s per GPU
    assert cells[-2].endswith("x") and cells[-1].endswith("x"), rows[2]  # ratio to each peer
    data = json.loads((tmp_path / "benchmark_tiny_ddp.json").read_text())
    assert [r["status"] for r in data["rows"]] == ["ok", "ok", "ok"]
    assert data["args"]["world_size"] == 1 and data["args"]["num_params"] > 0
    assert data["args"]["accum"] == 2 and "b2 s32 x 2 micro-batches a step" in out  # every row accumulates
    # --profile: every row's step split by kind of work, the parts within the step
    assert profiled.count("\n| ") == 10 and "| matmul |" in profiled and "| idle |" in profiled, profiled
    assert profiled.count("largest kernels besides matmul and attention") == 3, profiled
    for r in data["rows"]:
        parts = r["breakdown"]
        assert parts["matmul"] > 0 and parts["optimizer"] > 0 and parts["step"] > 0, (r["name"], parts)
        assert sum(v for k, v in parts.items() if k not in ("step", "communication")) <= 1.01 * parts["step"]


@pytest.mark.slow
def test_benchmark_on_two_ranks_shards_the_fsdp2_peer_too(tmp_path: Path) -> None:
    """Two ranks: FSDP2 and ZeRO-2 over both, and HybridParallelPlugin with two pipeline stages (the step through
    execute_pipeline, micro-batches of 1) in the same processes."""
    out = _run(
        [str(EXAMPLES / "benchmarks" / "benchmark.py"), "-c", "tiny", "-p", "zero2,hybrid", "--pp", "2", "-b", "2",
         "-l", "32", "-s", "2", "-i", "1", "--no-kernels", "--nproc", "2", "--device", "cpu", "--compare",
         "--peers", "eager,fsdp2"],
        timeout=300,
        env={"OUT": str(tmp_path)},
    )  # fmt: skip
    assert "--compare on 2 processes: eager run at world size 1 only, skipped" in out, out
    data = json.loads((tmp_path / "benchmark_tiny_zero2-hybrid_w2.json").read_text())
    assert data["args"]["world_size"] == 2 and data["args"]["layout"]["pp"] == 2
    assert [(r["name"].split(" (")[0], r["status"]) for r in data["rows"]] == [
        ("FSDP2 world 2", "ok"),
        ("cai LowLevelZero-2", "ok"),
        ("cai HybridParallel tp1 x pp2, ZeRO-1", "ok"),
    ]
    assert all(r["tokens_per_s"] > 0 for r in data["rows"]), data["rows"]


@pytest.mark.slow
def test_bench_infer_tiny_runs_every_mode_and_writes_json(tmp_path: Path) -> None:
    """Every mode of bench_infer.py on the tiny preset at small sizes: offline and single stream against every
    transformers peer (hf-compile through dynamo with the eager backend: inductor's C++ build would dominate), the
    HTTP server under Poisson arrivals at two rates, and prefix caching off and on."""
    out = _run(
        [str(EXAMPLES / "benchmarks" / "bench_infer.py"), "-c", "tiny", "-n", "8", "--min-prompt", "8",
         "--max-prompt", "24", "--output-len", "8", "--single-prompt", "16", "--single-new", "16",
         "--max-batch-size", "4", "--compile-backend", "eager", "--rates", "8,32", "--server-requests", "6",
         "--system-len", "64", "--min-suffix", "4", "--max-suffix", "8"],
        timeout=300,
        env={"OUT": str(tmp_path)},
    )  # fmt: skip
    data = json.loads((tmp_path / "bench_infer_tiny.json").read_text())
    assert data["modes"] == ["offline", "single", "server", "prefix"]
    assert list(data["offline"]) == ["hf generate_batch", "hf generate", "cai"], data["offline"]
    assert list(data["single"]) == ["hf generate", "hf generate static+compile", "cai"], data["single"]
    for row in [*data["offline"].values(), *data["single"].values()]:
        assert "error" not in row, row
    assert data["offline"]["cai"]["output_tokens"] == 8 * 8
    assert data["single"]["hf generate static+compile"]["compile_backend"] == "eager"
    server = data["server"]
    assert server["via"] == "http" and server["client"] in ("httpx", "aiohttp"), server
    assert list(server["rates"]) == ["8", "32"]
    for row in server["rates"].values():
        assert (row["ok"], row["errors"], row["short"], row["output_tokens"]) == (6, 0, 0, 6 * 8), row
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 0 < row["tpot_p50_s"] <= row["tpot_p99_s"], row
    prefix = data["prefix"]
    assert prefix["caching off"]["prefix_hit_tokens"] == 0 and prefix["caching on"]["prefix_hit_tokens"] >= 64
    assert prefix["ratio"] > 0
    for header in ("cai vs it", "compile+warmup s", "TTFT p99 ms", "on vs off"):
        assert header in out, out


@pytest.mark.slow
def test_finetune_hf_lora_adapter_reloads_with_peft(tmp_path: Path) -> None:
    """A local HF directory with weights, LoRA under ZeRO-2, the adapter saved and reloaded onto the base."""
    import torch
    from _models import preset_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(preset_config("tiny", max_seq=64)).save_pretrained(tmp_path / "base")
    out = _run(
        [str(EXAMPLES / "finetune_hf.py"), "--model", str(tmp_path / "base"), "--lora-rank", "4", "--plugin",
         "zero2", "--steps", "6", "--log-every", "3", "--eval-samples", "8", "--save-dir", str(tmp_path / "lora")],
        timeout=300,
    )  # fmt: skip
    assert "LoRA r=4" in out and "step 6/6" in out, out
    assert (tmp_path / "lora" / "adapter_config.json").exists()
    assert re.search(
        r"reloaded with from_pretrained: probe loss [\d.]+ \(matches the trained model\)", out
    ), out
    assert "final accuracy:" in out, out


# ---- the helpers, in process (fast) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ("--plugin zero2 --tp 2", "--tp 2: HybridParallelPlugin's flags; add --plugin hybrid"),
        ("--plugin hybrid --tp 2 --pp 2 --nproc 6", "--tp 2 x --pp 2 x --sp 1 = 4 ranks per replica does not divide the world size 6"),
        ("--plugin hybrid --tp 3 --nproc 3", "4 attention heads (--heads) do not divide over --tp 3"),
        ("--plugin hybrid --pp 8 --nproc 8", "4 decoder layers (--layers) are fewer than --pp 8 pipeline stages"),
        ("--plugin hybrid --pp 2 --zero-stage 2", "--zero-stage 2 does not combine with --pp 2"),
        ("--plugin hybrid --pp 2 --microbatches 5", "32 sequences, which do not cut into --microbatches 5"),
        ("--plugin hybrid --sp-mode ring", "--sp-mode ring splits the sequence over the tp group"),
        ("--plugin ddp --fp8", "--fp8 applies to zero1, zero2, gemini and hybrid, not --plugin ddp"),
        ("--plugin hybrid --fp8 --fp8-recipe rowwise", "--fp8-recipe rowwise applies to zero1, zero2 and gemini, not --plugin hybrid"),
        ("--fp8-recipe rowwise", "--fp8-recipe rowwise needs --fp8"),
    ],
    ids=["not-hybrid", "world", "heads", "layers", "zero2-pp", "microbatches", "sp-mode", "fp8-ddp", "fp8-recipe-hybrid",
         "fp8-recipe-alone"],
)  # fmt: skip
def test_train_llama_rejects_hybrid_flags_that_do_not_fit(flags: str, error: str, capsys) -> None:
    from train_llama import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags.split())
    assert error in capsys.readouterr().err


def test_train_llama_hybrid_spawns_a_replica_of_tp_x_pp_ranks_on_cpu(monkeypatch) -> None:
    from train_llama import parse_args

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    args = parse_args(["--plugin", "hybrid", "--tp", "2", "--pp", "2", "--device", "cpu"])
    assert args.world == 4 and args.layout.num_microbatches == 4 and args.layout.zero_stage == 1
    zero2 = parse_args(["--device", "cpu"])
    assert zero2.world == 2 and zero2.layout is None


@pytest.mark.parametrize(
    ("preset", "tokens_per_s", "mfu"),
    [("1b", 63.9e3, 0.42), ("1b", 78.0e3, 0.515), ("8b", 6.8e3, 0.35)],
    ids=["1b-eager", "1b-compile", "8b-fsdp2"],
)
def test_mfu_of_presets_reproduces_the_peer_figures(preset: str, tokens_per_s: float, mfu: float) -> None:
    """BENCHMARKS.md quotes tokens/s and MFU together; the presets' shapes and our formula must link them."""
    import torch
    from _models import preset_config
    from _perf import ModelShape, Throughput
    from transformers import LlamaForCausalLM

    config = preset_config(preset, max_seq=2048)
    with torch.device("meta"):
        shape = ModelShape.of(LlamaForCausalLM(config), config)
    perf = Throughput.measure(shape, tokens=int(tokens_per_s), seconds=1.0, seq_len=2048)
    assert abs(perf.mfu - mfu) < 0.006, (preset, perf.mfu)


def test_flop_formulas_against_a_counted_forward_and_backward() -> None:
    """The formulas against torch's FlopCounterMode over one training step of a tiny Llama (matmul FLOPs).

    Eager attention (its two batched matmuls are counted in full, as the formulas count the s x s scores), one
    KV head per head and ffn = 8h/3, so that the SwiGLU MLP has the 8 h^2 weights Megatron's 4h GELU MLP has.
    """
    import torch
    from _perf import ModelShape, Throughput
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, vocab, s, b = 48, 2, 96, 32, 2
    config = LlamaConfig(
        hidden_size=h,
        intermediate_size=8 * h // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=s,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (b, s))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted, tokens = counter.get_total_flops(), b * s

    # 6 N counts the weights that multiply activations; the embedding table is a lookup and norms are elementwise
    matmul_params = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n
    )
    other_params = sum(p.numel() for p in model.parameters()) - matmul_params
    perf = Throughput.measure(
        ModelShape(num_params=matmul_params, num_layers=layers, hidden_size=h, vocab_size=vocab),
        tokens=tokens,
        seconds=1.0,
        seq_len=s,
        peak_flops=1.0,
    )
    # exact up to the rotary table's tiny (hd/2 x 1) @ (1 x s) matmul per forward
    assert perf.mfu == pytest.approx(counted, rel=1e-4)
    # MFU as reported counts every parameter (the PaLM convention): the excess is exactly the lookup and norms
    full = ModelShape.of(model, config)
    excess = tokens * full.flops_per_token(s) - counted
    assert excess == pytest.approx(6 * other_params * tokens, rel=2e-3)
    # Colossal-AI's Megatron count without recomputation scales the logits by 3 (4.5 V h per token) where a step
    # does 6 V h; everything else is exact, so it is low by 1.5 V h per token (1.7% at this size)
    megatron = full.megatron_flops(tokens, s, grad_ckpt=False)
    assert counted - megatron == pytest.approx(1.5 * vocab * h * tokens, rel=5e-3)
    # Colossal-AI's 2 (3 + ckpt) N leaves out the attention scores and counts the embedding table
    assert full.simple_flops(tokens, grad_ckpt=False) == pytest.approx(counted, rel=0.05)


def test_digit_samples_label_only_the_answer_and_collate_pads() -> None:
    import torch
    from _digits import BOS, EOS, IGNORE, PAD, SEP, DigitReversal, DigitTask, collate

    task = DigitTask(min_digits=3, max_digits=6)
    data = DigitReversal(task, num_samples=50, seed=3)
    assert torch.equal(data[7]["input_ids"], DigitReversal(task, num_samples=50, seed=3)[7]["input_ids"])
    for i in range(50):
        ids, labels = data[i]["input_ids"], data[i]["labels"]
        n = (ids.numel() - 3) // 2
        assert 3 <= n <= 6 and ids[0] == BOS and ids[n + 1] == SEP and ids[-1] == EOS
        assert torch.equal(ids[n + 2 : -1], ids[1 : n + 1].flip(0))
        assert (labels[: n + 2] == IGNORE).all() and torch.equal(labels[n + 2 :], ids[n + 2 :])
    batch = collate([data[i] for i in range(8)])
    width = batch["input_ids"].shape[1]
    assert width == max(data[i]["input_ids"].numel() for i in range(8))
    for row in range(8):
        n_tok = data[row]["input_ids"].numel()
        assert (batch["input_ids"][row, n_tok:] == PAD).all() and (
            batch["labels"][row, n_tok:] == IGNORE
        ).all()
    with pytest.raises(ValueError, match="min_digits=5, max_digits=2"):
        DigitTask(min_digits=5, max_digits=2)


class _Oracle:
    """Stands in for a model: puts the logit peak on the right next token, or on a wrong digit when ``wrong``."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong

    def __call__(self, input_ids):
        import torch
        from _digits import EOS, SEP, VOCAB_SIZE

        B, T = input_ids.shape
        logits = torch.zeros(B, T, VOCAB_SIZE)
        for b in range(B):
            row = input_ids[b].tolist()
            n = row.index(SEP) - 1
            k = T - (n + 2)  # answer tokens produced so far
            target = row[n - k] if k < n else EOS
            if self.wrong and k == 0:
                target = (target + 1) % 10
            logits[b, -1, target] = 1.0
        return logits


def test_exact_match_decodes_greedily() -> None:
    from _digits import DigitTask, exact_match

    task = DigitTask(min_digits=2, max_digits=5)
    assert exact_match(_Oracle(), task, num_samples=40, seed=1, device="cpu") == 1.0
    assert exact_match(_Oracle(wrong=True), task, num_samples=40, seed=1, device="cpu") == 0.0


def test_overlap_analysis_counts_exposed_collective_time() -> None:
    sys.path.insert(0, str(EXAMPLES / "benchmarks"))
    from profile_overlap import analyse, report

    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {
        "traceEvents": [
            kernel("ncclDevKernel_ReduceScatter_Sum_bf16", 0, 100),  # compute covers 0-60 of it
            kernel("sm90_xmma_gemm", 0, 40),
            kernel("flash_fwd_kernel", 30, 30),  # overlaps the gemm: the union is 0-60
            kernel("ncclDevKernel_AllGather", 200, 50),  # nothing runs beside it: exposed
            {"cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 50},  # host events do not count
        ]
    }
    o = analyse(trace)
    assert (o.comm_us, o.hidden_us, o.compute_us) == (150.0, 60.0, 60.0)
    assert o.exposed_fraction == pytest.approx(0.6)
    assert "exposed 60.0%" in report(o)
    assert "nothing to measure" in report(analyse({"traceEvents": []}))
