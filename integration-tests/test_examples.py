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
def test_benchmark_tiny_with_peers_prints_one_table_and_json(tmp_path: Path) -> None:
    out = _run(
        [str(EXAMPLES / "benchmarks" / "benchmark.py"), "-c", "tiny", "-p", "ddp", "-b", "2", "-l", "32",
         "-s", "2", "-i", "1", "--no-kernels", "--compare", "--peers", "eager,fsdp2"],
        timeout=300,
        env={"OUT": str(tmp_path)},
    )  # fmt: skip
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
