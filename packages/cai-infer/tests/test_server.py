"""``cai serve`` as a subprocess on a tiny model and tokenizer saved to a temp dir: completions and chat, streamed
and not, models, health and metrics, and bad requests answered with 4xx while the server keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import tomllib
import torch
import transformers

from cai.mesh import free_port

pytest.importorskip("fastapi", reason="cai-infer[serve] is not installed")

PACKAGE = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(240)]
SPECIAL = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _save_model(path: Path) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", chat_template=TEMPLATE
    )
    tokenizer.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    return tokenizer


def _entry_points(site: Path) -> None:
    # `cai` finds subcommands through installed entry points; the editable install of this environment may
    # predate the one cai-infer declares, so the declared table is installed here as its own distribution.
    table = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]["entry-points"]["cai.cli"]
    info = site / "cai_infer_serve_test-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cai-infer-serve-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[cai.cli]\n" + "".join(f"{k} = {v}\n" for k, v in table.items()))


def _events(response: httpx.Response) -> list[dict]:
    lines = [ln for ln in response.text.split("\n\n") if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def test_cai_serve(tmp_path):
    model_dir = tmp_path / "tiny"
    tokenizer = _save_model(model_dir)
    _entry_points(tmp_path / "site")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]),
    }
    script = Path(sys.executable).with_name("cai")  # the console script of this environment
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "cai.mesh._cli"]
    args = ["serve", str(model_dir), "--port", str(port), "--dtype", "fp32", "--served-model-name", "tiny"]
    args += ["--max-input-len", "24", "--max-output-len", "8", "--block-size", "4", "--log-level", "warning"]
    args += [
        "--spec-tokens",
        "2",
    ]  # prompt-lookup speculation: greedy output stays generate's, token for token
    proc = subprocess.Popen(cmd + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"cai serve exited with {proc.returncode}:\n{proc.stdout.read()}")
                try:
                    if client.get("/health").json() == {"status": "ok"}:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "cai serve did not answer /health in 120 s"
                time.sleep(0.3)
            _check(client, tokenizer, model_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _check(client: httpx.Client, tokenizer, model_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def reference(ids: list[int], n: int) -> tuple[str, int, str]:
        # the text, the number of tokens and the finish reason of transformers' greedy generate
        new = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[
            0, len(ids) :
        ]
        reason = "stop" if int(new[-1]) == tokenizer.eos_token_id else "length"
        return tokenizer.decode(new, skip_special_tokens=True), len(new), reason

    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"

    # completions: greedy text equals transformers' generate; streaming deltas add up to the same text
    prompt = "w3 w17 w200 w5"
    want, n_completion, reason = reference(tokenizer(prompt)["input_ids"], 6)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["text"] == want
    assert got["choices"][0]["finish_reason"] == reason
    assert got["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": n_completion,
        "total_tokens": 4 + n_completion,
    }
    events = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == reason
    assert len(events) == n_completion  # one event per token

    # chat: the tokenizer's template
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w9 w8 w7"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    want_chat, n_chat, _ = reference(list(ids), 5)
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": want_chat}
    events = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want_chat

    # concurrent requests share batches and still get their own greedy continuations
    others = ["w40 w41", "w7 w7 w7 w7 w7 w7", "w230"]
    wants = [reference(tokenizer(p)["input_ids"], 8) for p in others]
    with ThreadPoolExecutor(len(others)) as pool:
        answers = list(
            pool.map(
                lambda p: client.post(
                    "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}
                ),
                others,
            )
        )
    assert [a.json()["choices"][0]["text"] for a in answers] == [w[0] for w in wants]

    # bad requests: 4xx with a message; the server keeps serving
    bad = [
        ("/v1/completions", {"prompt": " ".join(["w1"] * 30), "max_tokens": 2}, 400, "max_input_len=24"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "w1"}, 404, "'gpt-9' does not exist"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": -3}, 400, "max_tokens=-3"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": 99}, 400, "max_output_len=8"),
        ("/v1/completions", {"prompt": {"x": 1}}, 400, "prompt must be"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages must be"),
    ]
    for path, payload, status, message in bad:
        r = client.post(path, json=payload)
        assert r.status_code == status, (payload, r.text)
        assert message in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "w3 w17 w200 w5", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want

    metrics = client.get("/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if not line.startswith("#")
    }
    assert values['cai_requests_total{outcome="ok"}'] == 5 + len(others)
    assert values['cai_requests_total{outcome="error"}'] == len(bad) + 1
    assert values["cai_generation_tokens_total"] == n_completion * 3 + n_chat * 2 + sum(w[1] for w in wants)
    assert values["cai_time_to_first_token_seconds_count"] == 5 + len(others)
    assert values["cai_kv_blocks_used"] == 0 and values["cai_queue_length"] == 0
    assert values["cai_kv_blocks_total"] > 0
    # the first concurrent prompt's continuation repeats itself, so prompt lookup drafted and was right
    assert values["cai_spec_accepted_tokens_total"] > 0
