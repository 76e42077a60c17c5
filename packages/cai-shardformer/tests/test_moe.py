"""Expert parallelism against the same mixture-of-experts model in one process, fp32: 5 AdamW steps with losses
(including the auxiliary load-balancing loss), gradients and parameters compared every step; all-to-all bytes
counted per MoE layer; capacity dropping; configuration errors. One 4-rank spawn runs the whole matrix."""

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import ShardConfig, ShardFormer
from cai.shardformer._moe import ExpertParallelExperts

VOCAB, H, LAYERS, EXPERTS, TOP_K, B, S = 251, 32, 2, 8, 2, 2, 8


@dataclass(frozen=True)
class Case:
    family: str  # "mixtral" | "qwen3_moe" | "qwen2_moe" | "deepseek_v3"
    ep: int
    skew: bool = False  # bias the router so most tokens pick expert 0
    capacity_factor: float | None = None


def _tiny(family: str, experts: int = EXPERTS):
    common = dict(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=TOP_K, output_router_logits=True,
        router_aux_loss_coef=0.1, attn_implementation="eager",
    )  # fmt: skip
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=16, num_local_experts=experts, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=experts, norm_topk_prob=True, head_dim=8,
            decoder_sparse_step=1, **common,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # a gated shared expert beside the routed ones
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=experts,
            decoder_sparse_step=1, **common,
        )  # fmt: skip
        cls = transformers.Qwen2MoeForCausalLM
    elif (
        family == "deepseek_v3"
    ):  # sigmoid router with group-limited top-k and a correction bias; no aux loss
        cfg = transformers.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=experts, n_shared_experts=1,
            first_k_dense_replace=0, n_group=2, topk_group=2, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **{**common, "num_key_value_heads": 4},
        )  # fmt: skip
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=16, **common)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # Qwen3-MoE's router starts at zero; random routers make routing non-trivial
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def _experts(model):
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]


def _check_case(case: Case, ep_group) -> None:
    rank, ep = dist.get_rank(ep_group), case.ep
    ref = _tiny(case.family)
    if case.skew:
        # Hidden channel 0 is a large constant in every token (the embedding's column 0) and only expert 0's router
        # row reads it: nearly every token picks expert 0 (whose rank then receives most rows) and one other.
        with torch.no_grad():
            ref.get_input_embeddings().weight[:, 0] = 0.1
            for name, p in ref.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p[:, 0] = 0.0
                    p[0, 0] = 3.0
    model = copy.deepcopy(ref)
    cfg = ShardConfig(enable_tensor_parallelism=False, ep_group=ep_group)
    if case.capacity_factor is None:
        model, _ = ShardFormer(cfg).optimize(model)
    else:
        # Capacity drops rows, which the model's own layer never does: the reference is the same layer at ep 1.
        from cai.shardformer.policies.moe import ExpertParallelPolicy

        model, _ = ShardFormer(cfg).optimize(
            model, ExpertParallelPolicy(capacity_factor=case.capacity_factor)
        )
        ref, _ = ShardFormer(ShardConfig(enable_tensor_parallelism=False)).optimize(
            ref, ExpertParallelPolicy(capacity_factor=case.capacity_factor)
        )
    layers = _experts(model)
    assert len(layers) == LAYERS and all(m.gate_up_proj.shape[0] == EXPERTS // ep for m in layers)
    el = EXPERTS // ep
    # Adam divides by |g| + eps: a gradient within rounding of zero has that rounding amplified by up to lr / eps
    # in the update; eps=1e-4 (as the tensor-parallel policy tests) keeps it under the tolerance.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    g = torch.Generator().manual_seed(1)
    routed = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: routed.append(args[1])) for m in layers]
    for step in range(5):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        routed.clear()
        with CollectiveCounter() as cc:
            out = model(input_ids=ids, labels=ids)
        want = ref(input_ids=ids, labels=ids)
        assert_close(out.loss, want.loss, rtol=1e-5, name=f"{case} step {step} loss")
        if case.family != "deepseek_v3":
            assert_close(out.aux_loss, want.aux_loss, rtol=1e-5, name=f"{case} step {step} aux loss")
            assert out.aux_loss > 0
        events = [e for e in cc.events if e.op == "all_to_all_single"]
        if ep > 1:
            # Per MoE layer: the counts (E int64), the rows to this rank's experts from all ep ranks (each holds
            # the same tokens here), the rows of this rank's own tokens coming back.
            assert len(events) == 3 * LAYERS, [e.op for e in cc.events]
            for layer, idx in enumerate(routed):
                mine = ((idx // el) == rank).sum().item()
                kept = idx.numel()
                if case.capacity_factor is not None:
                    cap = math.ceil(case.capacity_factor * idx.numel() / EXPERTS)
                    counts = torch.bincount(idx.flatten(), minlength=EXPERTS).clamp(max=cap)
                    mine, kept = counts.view(ep, el)[rank].sum().item(), counts.sum().item()
                    assert kept < idx.numel(), "the capacity case must drop rows to test dropping"
                nbytes = [e.nbytes for e in events[3 * layer : 3 * layer + 3]]
                assert nbytes == [EXPERTS * 8, ep * mine * H * 4, kept * H * 4], (case, layer, nbytes)
        else:
            assert not events
        out.loss.backward()
        want.loss.backward()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            r = ref_params[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                r = r[rank * el : (rank + 1) * el]
                p_grad, r_grad = p.grad, ref_params[name].grad[rank * el : (rank + 1) * el]
            else:
                p_grad, r_grad = p.grad, r.grad
            assert_close(
                p_grad,
                r_grad,
                rtol=1e-5,
                atol=1e-5 * float(r_grad.abs().max()),
                name=f"{case} step {step} grad {name}",
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in model.named_parameters():
            r = ref_params[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                r = r[rank * el : (rank + 1) * el]
            assert_close(
                p, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()), name=f"{case} step {step} param {name}"
            )
    for h in hooks:
        h.remove()
    if case.skew:  # the skew really happened: expert 0 took most tokens in the last step
        assert (routed[0] == 0).any(dim=1).float().mean() > 0.9


def _check_errors(ep_group) -> None:
    import pytest

    cfg = ShardConfig(enable_tensor_parallelism=False, ep_group=ep_group)
    with pytest.raises(ValueError, match=r"has 6 experts, which do not split evenly over ep_size=4"):
        ShardFormer(cfg).optimize(_tiny("mixtral", experts=6))
    with pytest.raises(ValueError, match=r"ep_size=4 but LlamaForCausalLM has no mixture-of-experts block"):
        ShardFormer(cfg).optimize(_tiny("llama"))


CASES = [
    Case("mixtral", 2),
    Case("mixtral", 4),
    Case("qwen3_moe", 2),
    Case("qwen3_moe", 4),
    Case("qwen2_moe", 2),
    Case("deepseek_v3", 2),
    Case("mixtral", 4, skew=True),
    Case("mixtral", 2, capacity_factor=0.75),
]


def _matrix() -> None:
    world = dist.get_world_size()
    groups = {ep: None for ep in (2, 4)}
    for ep in groups:  # every rank creates every group, in the same order
        for start in range(0, world, ep):
            g = dist.new_group(list(range(start, start + ep)))
            if start <= dist.get_rank() < start + ep:
                groups[ep] = g
    for case in CASES:
        _check_case(case, groups[case.ep])
    _check_errors(groups[4])


def test_expert_parallel_matches_one_process():
    run_distributed(_matrix, 4, timeout=300)
