"""InferenceConfig validation, the engine's limits and errors, aborts, loading from a path with a tokenizer, copy
on write between identical prompts, and the block accounting after each of them."""

from __future__ import annotations

import string

import pytest
import torch
import transformers
from transformers import GenerationConfig

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams


def test_config_defaults_dtypes_and_errors():
    c = InferenceConfig()
    assert (c.max_batch_size, c.max_input_len, c.max_output_len, c.block_size, c.dtype) == (
        8,
        256,
        256,
        16,
        torch.float16,
    )
    assert c.total_blocks == 8 * 32  # Colossal-AI's pool: max_batch_size * ceil((in + out) / block_size)
    for name, want in (
        ("bf16", torch.bfloat16),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ):
        assert InferenceConfig(dtype=name).dtype == want
    with pytest.raises(ValueError, match="dtype='int8' is not a known dtype"):
        InferenceConfig(dtype="int8")
    with pytest.raises(ValueError, match="max_batch_size=0 must be a positive int"):
        InferenceConfig(max_batch_size=0)
    with pytest.raises(ValueError, match=r"top_p=1.5 must be in \(0, 1\]"):
        InferenceConfig(top_p=1.5)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 is below max_batch_size=8"):
        InferenceConfig(max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="num_blocks=0"):
        InferenceConfig(num_blocks=0)
    with pytest.raises(ValueError, match="start_token_size=32 must be <= block_size=16"):
        InferenceConfig(start_token_size=32, enable_streamingllm=True)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="use_cuda_graph=1 must be True, False or None"):
        InferenceConfig(use_cuda_graph=1)
    with pytest.raises(ValueError, match="use_cuda_graph=True with tp_size=2"):
        InferenceConfig(use_cuda_graph=True, tp_size=2)


def test_cuda_paths_default_off_the_gpu(make_model, engines):
    engine = InferenceEngine(make_model(), None, InferenceConfig(dtype="fp32"))
    engines.append(engine)
    assert engine.runner.graphs is None  # None: where CUDA graphs run, which a CPU model is not
    with pytest.raises(ValueError, match="use_cuda_graph=True but the model is on cpu"):
        InferenceEngine(make_model(), None, InferenceConfig(dtype="fp32", use_cuda_graph=True))


def test_features_not_built_are_refused_by_name(make_model):
    with pytest.raises(NotImplementedError, match="pp_size=2, which cai-infer does not build yet"):
        InferenceEngine(make_model(), None, InferenceConfig(pp_size=2, dtype="fp32"))


def test_requests_that_can_never_fit_are_refused(make_model, engines):
    config = InferenceConfig(dtype="fp32", block_size=4, num_blocks=5, max_input_len=16, max_output_len=8)
    engine = InferenceEngine(make_model(), None, config)
    engines.append(engine)
    with pytest.raises(ValueError, match="17-token prompt, over max_input_len=16"):
        engine.add_request(prompts_token_ids=list(range(17)))
    with pytest.raises(ValueError, match="max_new_tokens=9, over max_output_len=8"):
        engine.add_request(prompts_token_ids=[1, 2], generation_config=GenerationConfig(max_new_tokens=9))
    with pytest.raises(
        ValueError, match=r"needs up to 16 \+ 8 tokens of KV cache but the pool holds 20 \(5 blocks of 4\)"
    ):
        engine.add_request(prompts_token_ids=list(range(16)))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(prompts_token_ids=[[]])
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        engine.add_request(prompts="hi")
    with pytest.raises(ValueError, match="repeat within one call"):
        engine.add_request(request_ids=["b", "b"], prompts_token_ids=[[1], [2]])
    engine.add_request(request_ids="a", prompts_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="request id 'a' is already queued"):
        engine.add_request(request_ids="a", prompts_token_ids=[4])
    assert len(engine.generate()) == 1


def test_abort_frees_blocks_and_others_finish(make_model, engines):
    engine = InferenceEngine(
        make_model(), None, InferenceConfig(dtype="fp32", block_size=2, max_input_len=16, max_output_len=8)
    )
    engines.append(engine)
    ids = engine.add_request(request_ids=["x", "y", "z"], prompts_token_ids=[[1, 2, 3], [4, 5, 6, 7, 8], [9]])
    engine.step()
    engine.step()
    used = engine.blocks.num_blocks - engine.num_free_blocks
    engine.abort_request("y")  # running
    assert engine.blocks.num_blocks - engine.num_free_blocks < used
    engine.add_request(request_ids="w", prompts_token_ids=[3, 3])
    engine.abort_request("w")  # still waiting
    engine.abort_request("nope")  # unknown ids are ignored
    _, toks = engine.generate(return_token_ids=True)
    assert len(toks) == 2 and all(len(t) == 8 for t in toks) and ids == ["x", "y", "z"]


def test_identical_prompts_share_blocks_with_copy_on_write(make_model, engines):
    model = make_model("llama")
    prompt = [11, 12, 13, 14, 15, 16]  # one full block of 4 and a partial one
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[
        0, 6:
    ].tolist()
    engine = InferenceEngine(
        model, None, InferenceConfig(dtype="fp32", block_size=4, max_input_len=16, max_output_len=6)
    )
    engines.append(engine)
    gen = GenerationConfig(max_new_tokens=6)
    engine.add_request(request_ids="first", prompts_token_ids=prompt, generation_config=gen)
    engine.step()  # prefill of the first: both of its blocks are now cached
    engine.add_request(request_ids="second", prompts_token_ids=prompt, generation_config=gen)
    _, got = engine.generate(return_token_ids=True)
    assert got == [want, want]
    assert engine.blocks.num_hit_tokens == 6  # the second found the whole prompt cached
    # the first appended its first token to a copy of the cached partial block, and the second rewrote its last
    # prompt token (recomputed for its logits) into another copy: the cached block itself stays intact
    assert engine.blocks.num_copies == 2


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_loads_model_and_tokenizer_from_a_path(tmp_path, engines):
    tokenizer = _char_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = ["Hello", "The sky is"]
    want = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        want.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    engine = InferenceEngine(str(tmp_path), inference_config=InferenceConfig(dtype="fp32", max_output_len=5))
    engines.append(engine)
    assert engine.model.dtype == torch.float32 and engine.model.config._attn_implementation == "cai_paged"
    assert engine.generate(prompts=prompts) == want

    # stop strings: the text ends before the first one, the reason is "stop"
    free = engine.generate(
        prompts=["Hello"], generation_config=SamplingParams(max_new_tokens=5, ignore_eos=True)
    )[0]
    assert len(free) >= 3, free
    stop = free[1:3]
    engine.add_request(
        request_ids="s", prompts="Hello", sampling_params=SamplingParams(max_new_tokens=5, stop=(stop,))
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].text == free[: free.index(stop)] and outs[-1].finish_reason == "stop"


def test_loads_a_cai_ckpt_checkpoint(make_model, tmp_path, engines):
    import cai.ckpt as ck

    model = make_model("mistral")
    ck.save_model(model, tmp_path / "model", dtype=torch.float32)  # HF safetensors shards + config.json
    prompt = [2, 71, 82, 93, 104]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[
        0, 5:
    ].tolist()
    engine = InferenceEngine(tmp_path / "model", inference_config=CONFIG_FP32)
    engines.append(engine)
    assert engine.generate(prompts_token_ids=[prompt], return_token_ids=True)[1] == [want]


CONFIG_FP32 = InferenceConfig(dtype="fp32", block_size=4, max_input_len=16, max_output_len=6)
