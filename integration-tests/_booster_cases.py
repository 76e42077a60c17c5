"""What the Booster integration tests share: the tiny Llama, the plugins by name, full parameters from shards, a
directory every rank writes into."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import transformers

from cai.mesh import LocalShard, ShardSpec, assemble

# Odd sizes on purpose (see [Note: odd test sizes] in cai.mesh.testing): a prime vocabulary and a width of 33 make
# the embeddings, the norms and the 33-row projections split unevenly at dp 2 and 4, so every flat layout (ZeRO
# buckets, Gemini chunks, FSDP's row shards) ends with padding on the last rank.
VOCAB = 251
PLUGINS = ("ddp", "fsdp", "zero1", "zero2", "gemini")


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=33,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=8,  # rotary needs an even head size, which 33 / 3 is not
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def hybrid_llama(tied: bool, layers: int = 8) -> torch.nn.Module:
    """A tiny Llama that tensor parallelism (4 heads, 2 kv heads) and pipelines (8 blocks: pp 4 x 2 chunks) can
    cut; the prime vocabulary is padded under tp and must never leak out."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def tiny_moe(family: str, *, aux: bool) -> torch.nn.Module:
    """A tiny mixture-of-experts causal LM (8 experts, top-2, 2 layers) with random routers (Qwen3-MoE's start at
    zero); ``aux`` adds the load-balancing loss to the model's loss."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=aux, router_aux_loss_coef=0.1,
        attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=16, num_local_experts=8, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=8, norm_topk_prob=True, head_dim=8,
            decoder_sparse_step=1, **common,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def make_plugin(name: str):
    from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    if name == "ddp":
        return TorchDDPPlugin()
    if name == "fsdp":
        return TorchFSDPPlugin(precision="fp32")
    if name in ("zero1", "zero2"):
        return LowLevelZeroPlugin(stage=int(name[-1]), precision="fp32")
    if name == "gemini":
        return GeminiPlugin(precision="fp32")
    raise ValueError(name)


def gathered_params(booster, model, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter assembled from all ranks' pieces of the plugin's state (the checkpoint's source of truth).

    ``names``: which tensors (default: the unwrapped model's parameter names; ``"all"``: every name of the state,
    buffers included, for a pipelined model whose own names are not the checkpoint's)."""
    pieces: dict[str, list] = {}
    for n, entry in booster.plugin.model_state(model).sharded_state_dict().items():
        for s in entry if isinstance(entry, list) else [entry]:  # a list: several blocks of one tensor
            pieces.setdefault(n, []).append((s.tensor.detach().float().cpu().clone(), s.spec))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    if names is None:
        names = {n for n, _ in model.unwrap().named_parameters()}
    elif names == "all":
        names = {n for r in everyone for n in r}
    return {n: assemble([LocalShard(*p) for r in everyone for p in r.get(n, [])]) for n in sorted(names)}


def last_rank_padding(plugin: str, model, optimizer) -> int:
    """Elements of padding in this rank's flat pieces when it is the last rank: ZeRO buckets and Gemini chunks
    that end inside its shard, or FSDP parameters whose rows do not split evenly. The parity tests assert it is
    positive, so a change of model sizes cannot silently stop covering the padded last piece."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank != world - 1 or world == 1:
        return 0
    if plugin in ("zero1", "zero2"):
        return sum(
            b.padded - max(b.numel, rank * b.shard) for b in optimizer.unwrap().buckets if b.numel < b.padded
        )
    if plugin == "gemini":
        return sum(
            c.chunk_size - max(c.used, rank * c.shard_size)
            for c in model._cai_gemini.chunks
            if c.used < c.chunk_size
        )
    if plugin == "fsdp":
        return sum(-p.shape[0] % world for p in model.unwrap().parameters() if p.dim())
    return 0


def grad_pieces(plugin: str, model, optimizer) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    """This rank's pieces of the reduced gradients by parameter name, read where each plugin keeps them. Call
    between the last backward of a step and ``step()``."""
    if plugin == "ddp":
        return {n: (p.grad, ShardSpec.full(p.shape)) for n, p in model.unwrap().named_parameters()}
    if plugin == "fsdp":  # DTensor row shards; full_tensor() assembles them from every rank (a collective)
        return {
            n: (p.grad.full_tensor(), ShardSpec.full(p.shape)) for n, p in model.unwrap().named_parameters()
        }
    if plugin == "gemini":
        return dict(model._cai_gemini.sharded_grads())
    zo = optimizer.unwrap()
    zo.grad_norm()  # reduces whatever is pending, so the bucket shards are final
    rank, out = dist.get_rank(), {}
    for b in zo.buckets:
        lo = rank * b.shard  # recomputed, not read from the bucket: [Note: bucket layout] in cai-zero
        for s in b.slots:
            a, z = max(s.offset, lo), min(s.offset + s.numel, lo + b.shard)
            if a < z:
                spec = ShardSpec(global_shape=s.shape, flat_range=(a - s.offset, z - s.offset))
                out[s.name] = (b.grad_shard[a - lo : z - lo], spec)
    return out


def shared_tmpdir(root: str) -> str:
    """A new directory under ``root``, made by rank 0 and named to every rank."""
    obj = [tempfile.mkdtemp(dir=root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]
