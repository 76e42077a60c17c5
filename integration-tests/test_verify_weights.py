"""``Booster.verify_weights``: a model filled from a Hugging Face checkpoint at ``boost()`` (``from_pretrained``
inside ``LazyInitContext``) equals it piece by piece under every layout on 2 gloo ranks; a piece changed on one
rank is named on every rank, and so are a checkpoint that lacks a tensor and one with a tensor that no rank holds
(the keys Hugging Face skips on load aside); with the debug checks on, ``boost()``
runs the check itself.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from cai.mesh.testing import run_distributed

pytest.importorskip("transformers")

from _booster_cases import PLUGINS, hybrid_llama, make_plugin, shared_tmpdir

LAYOUTS = {
    "hybrid-tp2": dict(tp_size=2, pp_size=1),
    "hybrid-pp2": dict(tp_size=1, pp_size=2, num_microbatches=1),
}


def _verify(plugin: str, root: str) -> dict:
    import transformers
    from safetensors.torch import load_file, save_file

    from cai.booster import Booster, LazyInitContext
    from cai.booster.plugin import HybridParallelPlugin

    path = shared_tmpdir(root)
    pretrained, partial = os.path.join(path, "pretrained"), os.path.join(path, "partial")
    extra = os.path.join(path, "extra")
    if dist.get_rank() == 0:
        hybrid_llama(tied=True, layers=2).save_pretrained(pretrained)
        # the same checkpoint without one tensor
        os.makedirs(partial)
        tensors = load_file(os.path.join(pretrained, "model.safetensors"))
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
        # ... and with a third layer's tensor and an old rotary buffer (which Hugging Face skips) beside them all
        tensors = load_file(os.path.join(pretrained, "model.safetensors"))
        tensors["model.layers.2.mlp.down_proj.weight"] = tensors[
            "model.layers.1.mlp.down_proj.weight"
        ].clone()
        tensors["model.rotary_emb.inv_freq"] = torch.ones(4)
        os.makedirs(extra)
        save_file(tensors, os.path.join(extra, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()

    def boosted():
        with LazyInitContext():
            model = transformers.LlamaForCausalLM.from_pretrained(pretrained)
        chosen = HybridParallelPlugin(precision="fp32", **LAYOUTS[plugin]) if plugin in LAYOUTS else None
        booster = Booster(plugin=chosen or make_plugin(plugin), device="cpu")
        return booster, booster.boost(model)[0]

    with mock.patch("cai.booster._booster.debug_checks_on", lambda: True):
        booster, model = boosted()  # boost() verifies here
    booster.verify_weights(model)
    out = {}
    with pytest.raises(ValueError) as missing:
        booster.verify_weights(model, partial)
    out["missing"] = str(missing.value)
    with pytest.raises(ValueError) as unexpected:
        booster.verify_weights(model, extra)
    out["unexpected"] = str(unexpected.value)
    # one rank's piece of one tensor moved
    state = booster.plugin.model_state(model).sharded_state_dict()
    # rank 1's first block tensor (the ranks may hold pieces of different tensors; the tied embedding has two names)
    name = [next(n for n in sorted(state) if ".layers." in n)]
    dist.broadcast_object_list(name, src=1)
    name = name[0]
    if dist.get_rank() == 1:
        entry = state[name]
        piece = entry[0] if isinstance(entry, list) else entry
        with torch.no_grad():
            piece.tensor.view(-1)[:1].add_(0.5)
    with pytest.raises(ValueError) as changed:
        booster.verify_weights(model)
    out["changed"], out["name"] = str(changed.value), name
    return out


@pytest.mark.parametrize("plugin", [*PLUGINS, *LAYOUTS])
def test_verify_weights_finds_what_differs_from_the_checkpoint(plugin: str, root: str) -> None:
    for r in run_distributed(_verify, 2, plugin, root, timeout=180):
        assert "model.layers.1.mlp.down_proj.weight (not in the checkpoint)" in r["missing"], r["missing"]
        assert f"rank 1: {r['name']} (max abs difference 0.5)" in r["changed"], r["changed"]
        assert "rank 0:" not in r["changed"], r["changed"]
        assert r["unexpected"].endswith(
            "1 tensor(s) in it that no rank holds: model.layers.2.mlp.down_proj.weight"
        ), r["unexpected"]
        assert "differ" not in r["unexpected"] and "tensor(s) in it" not in r["missing"]
