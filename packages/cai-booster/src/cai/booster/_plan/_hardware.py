"""The machine as the planner's cost model sees it: rates measured once by ``calibrate()`` (``cai plan
--calibrate``), stored per device name, and reused.

[Note: calibration]
Every rate is measured on the machine with the work the planner prices: bf16 matmuls at several token counts
(their rate falls for small micro-batches), causal flash attention forward and backward, device and host copy
bandwidth, pinned host<->device copies, and cai-kernels' host Adam (fp32 master and moments, bf16 gradient, the
bf16 copy-out an offloaded step makes). A model step is more than those parts (launches, the elementwise work the
fused kernels leave, the allocator), so calibration also times one real forward and backward of a small Llama (4 layers
at hidden 2048, cai kernels, fused Adam) and stores its measured time over the model's prediction as
``step_overhead``; predictions scale their compute time by it. Nothing is fitted to the configurations the planner
is later checked against.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

__all__ = ["Hardware", "calibrate", "calibration_path"]

GiB = 1024**3
# bytes the host Adam moves a parameter: fp32 master, first and second moments read and written, the bf16 gradient
# read and the bf16 working copy written
ADAM_BYTES = 3 * 2 * 4 + 2 + 2


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Rates and sizes of one machine (one GPU and its host).

    Attributes:
        device: the accelerator's name (``torch.cuda.get_device_name``) or ``"cpu"``.
        gpu_mem_bytes, host_mem_bytes: total memory of one device and of the host.
        matmul_tflops: ``[[tokens, TFLOP/s], ...]``: bf16 matmuls of a ``(tokens, 4096) x (4096, 4096)`` shape.
        attention_tflops: causal flash attention forward + backward, counting the causal half of the work.
        copy_gbs: device memory bandwidth (a device-to-device copy, bytes read plus written).
        pcie_gbs: pinned host<->device copies, the slower direction.
        host_copy_gbs: host memory bandwidth: the faster of a large copy and a large ``a + b`` over every core,
            bytes read plus written.
        host_adam_params_per_s: cai-kernels' host Adam, parameters a second with every host core.
        comm_gbs: all-reduce bus bandwidth between this host's GPUs (assumed unless calibrated on several).
        step_overhead: a measured small-model step over its predicted time (see [Note: calibration]).
        host_base_bytes: resident host memory of a training process before it holds any model state (torch, the
            CUDA context and libraries, compiled kernels).
        peak_tflops: the device's dense bf16 peak that MFU is counted against (None: unknown, no MFU).
        source: how the figures were obtained.
    """

    device: str
    gpu_mem_bytes: int
    host_mem_bytes: int
    matmul_tflops: list[list[float]] = field(default_factory=list)
    attention_tflops: float
    copy_gbs: float
    pcie_gbs: float
    host_copy_gbs: float
    host_adam_params_per_s: float
    comm_gbs: float = 300.0
    step_overhead: float = 1.0
    host_base_bytes: int = 3 * GiB
    peak_tflops: float | None = None
    source: str = "measured"

    def matmul_rate(self, tokens: float) -> float:
        """FLOP/s of bf16 matmuls over ``tokens`` rows, interpolated in log(tokens) between the measured points."""
        pts = sorted(self.matmul_tflops)
        if tokens <= pts[0][0]:
            return pts[0][1] * 1e12 * tokens / pts[0][0]  # below the smallest measured shape: launch-bound
        for (t0, r0), (t1, r1) in itertools.pairwise(pts):
            if tokens <= t1:
                a = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
                return (r0 + a * (r1 - r0)) * 1e12
        return pts[-1][1] * 1e12

    @classmethod
    def h200(cls) -> Hardware:
        """``calibrate()`` on one NVIDIA H200 with 16 host cores and 128 GiB (torch 2.11; examples/benchmarks/
        RESULTS.md), used until ``cai plan --calibrate`` has run on the machine."""
        return cls(
            device="NVIDIA H200 (built-in figures)",
            gpu_mem_bytes=150109880320,
            host_mem_bytes=135128870912,
            matmul_tflops=[
                [512, 319.6],
                [1024, 511.1],
                [2048, 599.7],
                [4096, 643.2],
                [8192, 717.6],
                [16384, 713.0],
            ],
            attention_tflops=290.0,
            copy_gbs=4210.0,
            pcie_gbs=55.2,
            host_copy_gbs=76.4,
            host_adam_params_per_s=4.86e9,
            comm_gbs=300.0,
            step_overhead=1.097,
            host_base_bytes=int(1.45 * GiB),
            peak_tflops=989.0,
            source="built-in H200 figures (run `cai plan --calibrate` on the machine)",
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Hardware:
        return cls(**d)

    @classmethod
    def load(cls, device: str | None = None, *, path: str | os.PathLike | None = None) -> Hardware | None:
        """The stored calibration of ``device`` (default: this machine's accelerator), or None."""
        p = Path(path) if path else calibration_path()
        if not p.exists():
            return None
        stored = json.loads(p.read_text())
        entry = stored.get(device or _device_name())
        return cls.from_json(entry) if entry else None

    def save(self, *, path: str | os.PathLike | None = None) -> Path:
        """Store under the device's name (other devices' entries are kept); returns the file."""
        p = Path(path) if path else calibration_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        stored = json.loads(p.read_text()) if p.exists() else {}
        stored[self.device] = self.to_json()
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(stored, indent=2))
        os.replace(tmp, p)
        return p


def calibration_path() -> Path:
    """``$CAI_CACHE_DIR/plan-calibration.json`` (default ``~/.cache/cai``)."""
    root = os.environ.get("CAI_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cai")
    return Path(root) / "plan-calibration.json"


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def available_host_bytes() -> int:
    """Host memory available to a new process now (MemAvailable), else all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _host_mem_bytes()  # no /proc/meminfo: all of it


def free_device_bytes(device: torch.device) -> int:
    """Bytes this process may still take on the CUDA ``device``: the driver's free memory plus what the caching
    allocator holds unused, within ``torch.cuda.set_per_process_memory_fraction``'s cap."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    unused = reserved - torch.cuda.memory_allocated(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    cap = int(get_fraction(device) * total) if get_fraction else total
    return min(free + unused, cap - reserved + unused)


def _peak_tflops(name: str) -> float | None:
    """Dense bf16 peak of the GPUs whose MFU people quote (H100 and H200 SXM: 989 TFLOP/s; A100: 312)."""
    for key, tflops in (("H100", 989.0), ("H200", 989.0), ("H20", 148.0), ("A100", 312.0)):
        if key in name:
            return tflops
    return None


def _host_mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _timed(fn, device: torch.device, *, warmup: int = 2, repeat: int = 5) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_points(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> list[list[float]]:
    k = 4096 if device.type == "cuda" else 512
    w = torch.randn(k, k, device=device, dtype=dtype)
    out = []
    for tokens in sizes:
        x = torch.randn(tokens, k, device=device, dtype=dtype)
        s = _timed(lambda x=x: x @ w, device)
        out.append([float(tokens), 2 * tokens * k * k / s / 1e12])
    return out


def _attention_tflops(device: torch.device, dtype: torch.dtype) -> float:
    import torch.nn.functional as F

    b, heads, seq, d = (4, 32, 2048, 128) if device.type == "cuda" else (1, 4, 256, 32)
    q, k, v = (
        torch.randn(b, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    s = _timed(step, device)
    # forward QK^T and PV over the causal half: 2 * 2 * s^2/2 * d per head; backward twice that
    return 3 * 2 * b * heads * seq * seq * d / s / 1e12


def _copy_gbs(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device) / 1e9


def _host_bandwidth_gbs(nbytes: int) -> float:
    """Host memory bandwidth: the faster of a copy and ``c = a + b`` (three streams) over ``nbytes`` arrays."""
    cpu = torch.device("cpu")
    copy = _copy_gbs(cpu, nbytes)  # its buffers are gone before the three below exist
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    c = torch.empty_like(a)
    return max(copy, 3 * nbytes / _timed(lambda: torch.add(a, b, out=c), cpu) / 1e9)


def _pcie_gbs(device: torch.device, nbytes: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up = _timed(lambda: dev.copy_(host, non_blocking=True), device)
    down = _timed(lambda: host.copy_(dev, non_blocking=True), device)
    return nbytes / max(up, down) / 1e9


def _host_adam_params_per_s(numel: int) -> float:
    from cai.kernels.optim import adam_update

    p, m, v = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    g = (torch.randn(numel) * 1e-2).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def update():
        step[0] += 1
        adam_update(p, g, m, v, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    adamw_mode=True, out=out)  # fmt: skip

    return numel / _timed(update, torch.device("cpu"), warmup=1, repeat=3)


def _comm_gbs(device: torch.device) -> float | None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    n = dist.get_world_size()
    t = torch.ones(64 * 2**20, device=device, dtype=torch.bfloat16)
    s = _timed(lambda: dist.all_reduce(t), device)
    return 2 * (n - 1) / n * t.numel() * 2 / s / 1e9


def calibrate(*, device: torch.device | str | None = None, anchor: bool = True, log=print) -> Hardware:
    """Measure this machine's rates (see [Note: calibration]); a few tens of seconds on a GPU.

    Args:
        device: the accelerator (default: CUDA when available, else the CPU).
        anchor: also time one small Llama step to measure ``step_overhead`` and the process's resident base
            (needs transformers).
        log: where progress lines go (``None``: nowhere).
    """
    say = log or (lambda *_: None)
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    overhead, base = None, _rss_bytes()
    if anchor:  # first: it loads what a training process loads, so the resident set after it is the base
        say("calibrating: one small Llama forward and backward")
        overhead = _anchor_overhead(dev)
        base = _rss_bytes()
    say("calibrating: matmuls")
    sizes = (512, 1024, 2048, 4096, 8192, 16384) if gpu else (64, 256, 1024)
    matmul = _matmul_points(dev, dtype, sizes)
    say("calibrating: attention")
    attention = _attention_tflops(dev, dtype)
    say("calibrating: memory bandwidth and host<->device copies")
    copy = _copy_gbs(dev, GiB if gpu else 256 * 2**20)
    host_copy = _host_bandwidth_gbs(GiB) if gpu else copy  # on the CPU the device is the host
    pcie = _pcie_gbs(dev, GiB) if gpu else host_copy
    say("calibrating: host Adam")
    adam = _host_adam_params_per_s(2 * 10**8 if gpu else 2 * 10**7)
    say(
        f"calibrating: the host Adam steps {adam / 1e9:.2f}G parameters/s, moving {adam * ADAM_BYTES / 1e9:.0f} GB/s "
        f"({ADAM_BYTES} bytes a parameter): {adam * ADAM_BYTES / 1e9 / host_copy:.0%} of the host's "
        f"{host_copy:.0f} GB/s"
    )
    comm = _comm_gbs(dev)
    hw = Hardware(
        device=_device_name() if gpu else "cpu",
        gpu_mem_bytes=torch.cuda.get_device_properties(dev).total_memory if gpu else _host_mem_bytes(),
        host_mem_bytes=_host_mem_bytes(),
        matmul_tflops=matmul,
        attention_tflops=attention,
        copy_gbs=copy,
        pcie_gbs=pcie,
        host_copy_gbs=host_copy,
        host_adam_params_per_s=adam,
        **({"comm_gbs": comm} if comm else {}),
        peak_tflops=_peak_tflops(_device_name()) if gpu else None,
        source=f"measured {time.strftime('%Y-%m-%d %H:%M')}" + ("" if comm else "; comm_gbs assumed"),
    )
    if overhead is not None:
        hw = replace(hw, step_overhead=overhead(hw))
    return replace(hw, host_base_bytes=base)


def _rss_bytes() -> int:
    """This process's resident set now (Linux), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _anchor_overhead(device: torch.device):
    """Time a small Llama's forward and backward; returns a function of the other rates that gives its measured
    time over the cost model's prediction (always 1.0 without transformers)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return lambda hw: 1.0
    from cai.booster._plan._cost import step_seconds
    from cai.booster._plan._spec import ModelSpec
    from cai.kernels import patch_hf_model

    gpu = device.type == "cuda"
    h, layers, vocab, batch, seq = (2048, 4, 32000, 4, 2048) if gpu else (256, 2, 1024, 2, 128)
    config = LlamaConfig(hidden_size=h, intermediate_size=int(2.75 * h), num_hidden_layers=layers,
                         num_attention_heads=h // 128 if gpu else 4, vocab_size=vocab, tie_word_embeddings=False,
                         max_position_embeddings=seq)  # fmt: skip
    dtype = torch.bfloat16 if gpu else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    patch_hf_model(model)
    ids = torch.randint(1, vocab, (batch, seq), device=device)

    def step():  # forward and backward: the optimizer is priced apart
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    measured = _timed(step, device, warmup=2, repeat=5)
    spec = ModelSpec.from_config(config)
    return lambda hw: measured / step_seconds(spec, hw, tokens=batch * seq, seq=seq, wbytes=2 if gpu else 4,
                                              recompute="none", overhead=1.0)  # fmt: skip
