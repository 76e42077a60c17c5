"""``cai serve MODEL``: the OpenAI-compatible server, registered with the ``cai`` command (entry-point group
``cai.cli``). With ``--tp-size N`` it runs as N processes (``torchrun --nproc_per_node N --no-python cai serve
MODEL --tp-size N``): rank 0 serves HTTP, the other ranks follow its steps (_lockstep.py [Note: lockstep driver])."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_serve_parser", "serve_command"]


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a causal LM over an OpenAI-compatible HTTP API",
        description="Load MODEL (a path or hub name, with its tokenizer) into cai-infer's engine and serve "
        "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Needs cai-infer[serve].",
    )
    p.add_argument("model", help="model path or hub name (AutoModelForCausalLM / AutoTokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: MODEL)")
    p.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"], help="weights and KV cache")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-input-len", type=int, default=1024, help="longest prompt in tokens")
    p.add_argument("--max-output-len", type=int, default=512, help="most tokens one request may generate")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: a full batch)")
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        help="decode speculatively with prompt-lookup drafts of up to this many tokens (0: off)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="shard the model over this many processes, one per GPU, started by torchrun (default 1)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn's log level")
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    n = args.tp_size
    if n < 1:
        print(f"cai serve: --tp-size {n} must be at least 1", file=sys.stderr)
        return 2
    if n > 1 and not dist.is_initialized() and "RANK" not in os.environ:
        print(
            f"cai serve: --tp-size {n} runs one process per rank; start it with `torchrun --nproc_per_node {n} "
            f"--no-python cai serve {args.model} --tp-size {n} ...`",
            file=sys.stderr,
        )
        return 2

    from ._server import _fastapi, build_app

    _fastapi()  # fail before loading the model when the extra is missing
    import uvicorn

    from ._async import AsyncInferenceEngine
    from ._config import InferenceConfig
    from ._engine import InferenceEngine
    from ._lockstep import LockstepDriver

    if n > 1 and not dist.is_initialized():
        from cai.mesh import launch_from_torch

        launch_from_torch(verbose=False)  # one GPU per local rank; the engine checks the world size
    config = InferenceConfig(
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        tp_size=n,
    )
    engine = InferenceEngine(args.model, inference_config=config)
    if args.spec_tokens:
        engine.enable_spec_dec(n_spec_tokens=args.spec_tokens)
    if n == 1:
        app = build_app(AsyncInferenceEngine(engine), args.served_model_name or args.model)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    driver = LockstepDriver(engine)
    if not driver.is_leader:
        driver.follow()  # until rank 0 stops serving
        return 0
    try:
        app = build_app(AsyncInferenceEngine(driver), args.served_model_name or args.model)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        driver.close()  # also when uvicorn fails to start: the followers must not wait for ever
    return 0
