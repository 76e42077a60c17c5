"""``cai plan``: the configurations a model can train with on this machine, the fastest that fits marked
(registered with the ``cai`` command through the entry-point group ``cai.cli``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_plan_parser"]

GiB = 1024**3


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="list the training configurations that fit, with predicted memory and speed, and mark the fastest",
        description="Price every configuration of training MODEL (plugins x host offload x activation "
        "checkpointing x micro-batch and accumulation) on GPUS GPUs: predicted GPU and host peaks and tokens/s "
        "from this machine's calibrated rates. Example: cai plan --model 8b --gpu-mem 24 --host-mem 120 --gpus 1",
    )
    p.add_argument(
        "--model", help="preset (1b, 3b, 8b, 13b, 70b), a config.json or model directory, or a hub name"
    )
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB one GPU may use (default: the whole GPU)")
    p.add_argument("--host-mem", type=float, default=None, help="GiB of host memory (default: all of it)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the job (default 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step (default 8 a GPU)"
    )
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument(
        "--no-kernels", action="store_true", help="price the model without cai-kernels' fused kernels"
    )
    p.add_argument(
        "--plugins", default=None, help="comma list to consider (ddp,fsdp,zero1,zero2,gemini,hybrid)"
    )
    p.add_argument(
        "--offload-activations",
        default=None,
        metavar="FRACTIONS",
        help="comma list of fractions of the decoder layers whose activations may wait in host memory, priced "
        "beside keeping them all on the GPU (e.g. 0.25,0.5; none by default)",
    )
    p.add_argument(
        "--largest",
        action="store_true",
        help="find the most decoder layers of MODEL's width that still fit the budgets, and plan that model",
    )
    p.add_argument("--top", type=int, default=15, help="rows of the table (0: every feasible row)")
    p.add_argument("--json", action="store_true", help="print every row as JSON instead of the table")
    p.add_argument(
        "--plot", default=None, metavar="FILE", help="save tokens/s against GPU memory (matplotlib)"
    )
    p.add_argument(
        "--calibrate", action="store_true", help="measure this machine's rates first and store them"
    )
    p.add_argument(
        "--hardware", default=None, metavar="FILE", help="a calibration JSON (one Hardware) to use"
    )
    p.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    import json

    from cai.booster._plan import Hardware, calibrate, largest_model, plan

    hw = None
    if args.hardware:
        with open(args.hardware) as f:
            hw = Hardware.from_json(json.load(f))
    if args.calibrate:
        hw = calibrate(log=lambda m: print(m, file=sys.stderr))
        path = hw.save()
        print(f"cai plan: stored the calibration of {hw.device} in {path}", file=sys.stderr)
    if not args.model:
        if args.calibrate:
            print(json.dumps(hw.to_json(), indent=2))
            return 0
        print(
            "cai plan: give --model (a preset such as 8b, or a config path), or --calibrate", file=sys.stderr
        )
        return 2
    plugins = tuple(x for x in args.plugins.split(",") if x) if args.plugins else None
    offload = (0.0,)
    if args.offload_activations:
        try:
            offload += tuple(float(x) for x in args.offload_activations.split(",") if x)
        except ValueError:
            print(
                f"cai plan: --offload-activations {args.offload_activations!r}: give fractions",
                file=sys.stderr,
            )
            return 2
    try:
        search = largest_model if args.largest else plan
        extra = {"log": lambda m: print(f"cai plan: {m}", file=sys.stderr)} if args.largest else {}
        p = search(
            args.model,
            gpu_budget_bytes=int(args.gpu_mem * GiB) if args.gpu_mem else None,
            host_budget_bytes=int(args.host_mem * GiB) if args.host_mem else None,
            gpus=args.gpus,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            precision=args.precision,
            kernels=not args.no_kernels,
            hardware=hw,
            plugins=plugins,
            offload_activations=offload,
            **extra,
        )
    except ValueError as e:
        print(f"cai plan: {str(e).removeprefix('plan: ')}", file=sys.stderr)
        return 2
    if args.json:
        print(p.dumps())
    else:
        if args.largest:
            print(
                f"largest model that fits: {p.model.shape.layers} layers, {p.model.params / 1e9:.2f}B parameters\n"
            )
        print(p.render(limit=args.top or None))
    if args.plot:
        p.plot(args.plot)
        print(f"cai plan: wrote {args.plot}", file=sys.stderr)
    return 0 if p.best else 1
