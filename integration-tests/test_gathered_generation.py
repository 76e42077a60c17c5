"""Generation under sharded plugins: ``with booster.gathered(model): model.generate(...)`` on 2 gloo ranks gives
the tokens of the same trained model in one process, greedy, and gathers each parameter once for the whole call
where a plain ``generate`` gathers them again for every token. Forwards inside issue no collective, so ranks may
evaluate different numbers of batches there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cai.mesh.testing import CollectiveCounter, run_distributed

pytest.importorskip("transformers")

from _booster_cases import VOCAB, gathered_params, hybrid_llama, make_plugin, tiny_llama

NEW = 6  # generated tokens
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object")


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))


def _greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, pad_token_id=0)


def _gemini(offload: bool):
    from cai.booster.plugin import GeminiPlugin
    from cai.gemini import ChunkConfig, GeminiConfig

    # chunks of 2,048 elements: the tiny model is sharded over several of them (at its size Gemini's default
    # search keeps one chunk gathered); with offload their shards live on the host
    chunks = ChunkConfig(chunk_size=2048, min_chunk_size_m=0)
    placement = dict(offload_param_frac=1.0, offload_optim_frac=1.0) if offload else {}
    return GeminiPlugin(config=GeminiConfig(precision="fp32", chunk=chunks, **placement))


def _generate(plugin: str) -> dict:
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelPlugin

    hybrid = plugin.startswith("hybrid")
    build = (lambda: hybrid_llama(tied=False, layers=2)) if hybrid else tiny_llama
    if hybrid:
        chosen = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    elif plugin.startswith("gemini"):
        chosen = _gemini(offload=plugin.endswith("offload"))
    else:
        chosen = make_plugin(plugin)
    booster = Booster(plugin=chosen, device="cpu")
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)  # one step: the weights are the trained ones
    opt.step()
    opt.zero_grad()
    if hasattr(opt.unwrap(), "wait_for_params"):
        opt.unwrap().wait_for_params()

    want_model = build()
    want_model.load_state_dict(gathered_params(booster, model))
    want = _greedy(want_model.eval(), _prompt())

    model.eval()
    with CollectiveCounter() as plain:
        got_plain = _greedy(model, _prompt())
    with CollectiveCounter() as held, booster.gathered(model):
        got = _greedy(model, _prompt())
    uneven = None
    if not hybrid:  # evaluation with uneven batches: no forward inside issues a collective, so no rank waits
        with torch.no_grad(), booster.gathered(model):
            with CollectiveCounter() as inside:
                for _ in range(1 + dist.get_rank()):
                    model(input_ids=ids)
            uneven = len(inside.events)
    if plugin.startswith("gemini"):  # a training forward inside: its backward would release the held chunks
        with pytest.raises(RuntimeError, match="run training forwards outside it"), booster.gathered(model):
            model(input_ids=ids, labels=ids)

    def count(cc: CollectiveCounter) -> int:
        return sum(1 for e in cc.events if e.op in GATHERS)

    return {
        "same": torch.equal(got, want) and torch.equal(got_plain, want),
        "plain": count(plain),
        "held": count(held),
        "uneven": uneven,
    }


# what each plugin gathers per forward: FSDP's units (2 blocks + the root), Gemini's chunks; the others hold whole
# parameters (tp's shards compute whole outputs)
@pytest.mark.parametrize("plugin", ["ddp", "zero2", "fsdp", "gemini", "gemini-offload", "hybrid-tp2"])
def test_generate_inside_gathered_matches_one_process_and_gathers_once(plugin: str) -> None:
    for rank, r in enumerate(run_distributed(_generate, 2, plugin, timeout=180)):
        assert r["same"], f"rank {rank}: tokens differ from one process"
        assert r["uneven"] == (None if plugin == "hybrid-tp2" else 0), (rank, r)
        if plugin.startswith(("fsdp", "gemini")):
            # a plain generate gathers once per forward (NEW of them); inside the context once for the call
            assert r["held"] > 0 and r["plain"] >= NEW * r["held"], (rank, r)
        elif plugin == "hybrid-tp2":  # the logits' gather over tp, once per token: outputs, not parameters
            assert r["held"] == r["plain"] == NEW, (rank, r)
        else:
            assert r["held"] == r["plain"] == 0, (rank, r)


def _pipelined() -> None:
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=1), device="cpu")
    model, *_ = booster.boost(hybrid_llama(tied=False, layers=2))
    with (
        pytest.raises(ValueError, match="with pp_size=2 each rank holds only its stages"),
        booster.gathered(model),
    ):
        pass


def test_gathered_refuses_a_pipeline() -> None:
    run_distributed(_pipelined, 2)
