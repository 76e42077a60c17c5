"""``cai run``: torchrun on this node, or on every node of a hostfile over ssh."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from cai.mesh._cli_wait import wait_for_nodes

__all__ = ["add_run_parser", "read_hostfile", "run_command", "select_hosts", "torchrun_args"]

# Environment variables forwarded to remote nodes: the ones that change how Python, CUDA, NCCL and torch behave.
# Forwarding the whole environment (as some launchers do) leaks SSH_*, DISPLAY and shell state into remote jobs.
_FORWARD_PREFIXES = (
    "CUDA_",
    "NCCL_",
    "TORCH",
    "OMP_",
    "CAI_",
    "HF_",
    "TRANSFORMERS_",
    "TRITON_",
    "PYTHON",
    "GLOO_",
)
_FORWARD_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "MKL_NUM_THREADS")

_STOP_GRACE_S = 10.0  # after a node failed, how long the others get to stop on SIGTERM before SIGKILL

# How long a static multi-node launch waits for all nodes; torchrun's own static default, now with progress lines.
DEFAULT_RDZV_TIMEOUT_S = 600.0


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1..65535)")
    return value


def _nnodes(text: str) -> str:
    parts = text.split(":")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(parts) > 2 or not sizes or min(sizes) < 1 or sizes != sorted(sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX with 1 <= MIN <= MAX")
    return text


def _endpoint(text: str) -> str:
    # torchrun's own parser, so that what passes here is what torchrun accepts (HOST, HOST:PORT, [IPv6]:PORT).
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        parse_rendezvous_endpoint(text, default_port=29400)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value:g}")
    return value


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="start a training script on this node or on every node of a hostfile (torchrun underneath)",
        description="Start `script` with torchrun. Without --hostfile/--host it runs on this node; with them it "
        "starts torchrun on every selected node over ssh (node_rank = position in the list).",
    )
    p.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        type=_int_at_least(1, "the number of processes"),
        default=None,
        help="processes per node (default: number of GPUs, else 1)",
    )
    p.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        help="number of nodes, or MIN:MAX for elastic jobs (default: 1, or the number of hosts)",
    )
    p.add_argument(
        "--node_rank",
        "--node-rank",
        type=_int_at_least(0, "a node rank"),
        default=0,
        help="rank of this node (single-node form only)",
    )
    p.add_argument(
        "--master_addr",
        "--master-addr",
        default=None,
        help="rank 0's address (default 127.0.0.1, or the first host)",
    )
    p.add_argument("--master_port", "--master-port", type=_port, default=29500)
    p.add_argument(
        "--rdzv_backend", "--rdzv-backend", default=None, help="torchrun rendezvous backend, e.g. c10d"
    )
    p.add_argument(
        "--rdzv_endpoint", "--rdzv-endpoint", type=_endpoint, default=None, help="host:port of the rendezvous"
    )
    p.add_argument("--rdzv_id", "--rdzv-id", default=None, help="job id shared by all nodes")
    p.add_argument("--rdzv_conf", "--rdzv-conf", default=None, help="extra rendezvous config key=value,...")
    p.add_argument(
        "--rdzv_timeout",
        "--rdzv-timeout",
        type=_seconds,
        default=None,
        help=f"seconds a multi-node launch (--nnodes N) waits for every node to start, printing the missing "
        f"ones, before it gives up (default {DEFAULT_RDZV_TIMEOUT_S:g}); with --rdzv_endpoint it is torchrun's "
        "join_timeout",
    )
    p.add_argument(
        "--max_restarts", "--max-restarts", type=_int_at_least(0, "the number of restarts"), default=None
    )
    p.add_argument("--standalone", action="store_true", help="single-node rendezvous on a free port")
    p.add_argument("-H", "--host", default=None, help="comma-separated hosts (instead of --hostfile)")
    p.add_argument("--hostfile", default=None, help="file with one hostname per line ('#' comments)")
    p.add_argument("--include", default=None, help="comma-separated hosts of the hostfile to use")
    p.add_argument("--exclude", default=None, help="comma-separated hosts of the hostfile to skip")
    p.add_argument(
        "--num_nodes", "--num-nodes", type=int, default=-1, help="use only the first N selected hosts"
    )
    p.add_argument("--ssh_port", "--ssh-port", type=_port, default=None)
    p.add_argument(
        "--extra_launch_args", default=None, help="more torchrun arguments: 'a=1,b' becomes '--a=1 --b'"
    )
    p.add_argument("-m", dest="module", action="store_true", help="run `script` as a module (python -m)")
    p.add_argument(
        "--dry_run", "--dry-run", action="store_true", help="print the commands instead of running them"
    )
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run_command)


def read_hostfile(path: str) -> list[str]:
    """Hostnames of a hostfile: one per line, blank lines and '#' comments skipped, duplicates rejected.

    A line may carry extra fields after the name (``node1 slots=8``); they are ignored.
    """
    hosts: list[str] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            name = fields[0]
            if name in hosts:
                raise ValueError(f"hostfile {path}:{lineno}: host {name!r} is listed twice")
            hosts.append(name)
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


def select_hosts(
    hosts: list[str], include: str | None, exclude: str | None, num_nodes: int = -1
) -> list[str]:
    """Apply --include / --exclude (mutually exclusive) and --num_nodes to the hostfile's hosts, keeping order."""
    if include and exclude:
        raise ValueError("--include and --exclude cannot be used together")
    chosen = list(hosts)
    for names, keep in ((include, True), (exclude, False)):
        if not names:
            continue
        wanted = [h.strip() for h in names.split(",") if h.strip()]
        unknown = [h for h in wanted if h not in hosts]
        if unknown:
            raise ValueError(f"hosts {unknown} are not in the hostfile (it lists {hosts})")
        chosen = [h for h in chosen if (h in wanted) == keep]
    if num_nodes > 0:
        chosen = chosen[:num_nodes]
    if not chosen:
        raise ValueError(
            f"no hosts left to run on (hostfile {hosts}, include={include!r}, exclude={exclude!r})"
        )
    return chosen


def _extra_args(spec: str | None) -> list[str]:
    if not spec:
        return []
    return [f"--{item.strip()}" for item in spec.split(",") if item.strip()]


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 1


def torchrun_args(args: argparse.Namespace, *, nnodes: str, node_rank: int, master_addr: str) -> list[str]:
    """The torchrun command line (after ``python -m torch.distributed.run``) for one node."""
    nproc = args.nproc_per_node if args.nproc_per_node is not None else _default_nproc()
    out = [f"--nproc_per_node={nproc}", f"--nnodes={nnodes}"]
    if args.standalone:
        out.append("--standalone")
    elif args.rdzv_endpoint:
        out.append(f"--rdzv_endpoint={args.rdzv_endpoint}")
        out.append(f"--rdzv_backend={args.rdzv_backend or 'c10d'}")
    else:
        out += [
            f"--node_rank={node_rank}",
            f"--master_addr={master_addr}",
            f"--master_port={args.master_port}",
        ]
        if args.rdzv_backend:
            out.append(f"--rdzv_backend={args.rdzv_backend}")
    if args.rdzv_id:
        out.append(f"--rdzv_id={args.rdzv_id}")
    conf = [args.rdzv_conf] if args.rdzv_conf else []
    if args.rdzv_endpoint and args.rdzv_timeout is not None and "join_timeout=" not in (args.rdzv_conf or ""):
        conf.append(f"join_timeout={args.rdzv_timeout:g}")  # torchrun's c10d rendezvous has its own wait
    if conf:
        out.append(f"--rdzv_conf={','.join(conf)}")
    if args.max_restarts is not None:
        out.append(f"--max_restarts={args.max_restarts}")
    out += _extra_args(args.extra_launch_args)
    if args.module:
        out.append("-m")
    return [*out, args.script, *args.script_args]


def run_command(args: argparse.Namespace) -> int:
    if not args.module and not args.script.endswith(".py"):
        print(f"cai run: {args.script!r} is not a .py file; use -m to run a module", file=sys.stderr)
        return 2
    if args.hostfile is None and args.host is None:
        if args.include or args.exclude:
            print("cai run: --include/--exclude need --hostfile or --host", file=sys.stderr)
            return 2
        nnodes = args.nnodes or "1"
        if nnodes.isdigit() and args.node_rank >= int(nnodes):
            print(f"cai run: --node_rank {args.node_rank} must be < --nnodes {nnodes}", file=sys.stderr)
            return 2
        master_addr = args.master_addr or "127.0.0.1"
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        cmd += torchrun_args(args, nnodes=nnodes, node_rank=args.node_rank, master_addr=master_addr)
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        if nnodes.isdigit() and int(nnodes) > 1 and not (args.standalone or args.rdzv_endpoint):
            try:
                timeout = args.rdzv_timeout if args.rdzv_timeout is not None else DEFAULT_RDZV_TIMEOUT_S
                wait_for_nodes(master_addr, args.master_port, int(nnodes), args.node_rank, timeout)
            except Exception as e:  # NodeWaitTimeout, or node 0's store failing under this node
                print(f"cai run: {e}", file=sys.stderr, flush=True)
                return 1
        return _torchrun_here(cmd[3:])
    try:
        if args.hostfile is not None:
            hosts = read_hostfile(args.hostfile)
        else:
            hosts = [h.strip() for h in args.host.split(",") if h.strip()]
            if not hosts:
                raise ValueError(f"-H/--host {args.host!r} lists no hosts; give comma-separated host names")
        hosts = select_hosts(hosts, args.include, args.exclude, args.num_nodes)
    except (OSError, ValueError) as e:
        print(f"cai run: {e}", file=sys.stderr)
        return 2
    return _run_on_hosts(args, hosts)


def _torchrun_here(argv: list[str]) -> int:
    """Run torchrun in this process (it becomes the node's agent; saves starting another interpreter).

    Returns the exit code of the first rank that failed (128 + N for a rank killed by signal N), like a shell.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    sys.stdout.flush()
    try:
        torchrun(argv)
    except ChildFailedError as e:  # torchrun already logged every failing rank; name the first one
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(f"cai run: rank {rank} (local_rank {failure.local_rank}) {how}", file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code or 1
    return 0


@dataclass
class _Node:
    host: str
    node_rank: int
    argv: list[str]
    proc: subprocess.Popen | None = None
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    threads: list[threading.Thread] = field(default_factory=list)


def _node_args(args: argparse.Namespace, *, nnodes: str, node_rank: int, master_addr: str) -> list[str]:
    """The single-node ``cai run`` command line (after ``cai run``) that one node of a hostfile job runs."""
    out = [] if args.nproc_per_node is None else [f"--nproc_per_node={args.nproc_per_node}"]
    out.append(f"--nnodes={nnodes}")
    if args.standalone:
        out.append("--standalone")
    elif not args.rdzv_endpoint:
        out += [
            f"--node_rank={node_rank}",
            f"--master_addr={master_addr}",
            f"--master_port={args.master_port}",
        ]
    for name in ("rdzv_endpoint", "rdzv_backend", "rdzv_id", "rdzv_conf", "rdzv_timeout", "max_restarts"):
        value = getattr(args, name)
        if value is not None:
            out.append(f"--{name}={value:g}" if isinstance(value, float) else f"--{name}={value}")
    if args.extra_launch_args:
        out.append(f"--extra_launch_args={args.extra_launch_args}")
    if args.module:
        out.append("-m")
    return [*out, args.script, *args.script_args]


def _remote_command(args: argparse.Namespace, hosts: list[str], node_rank: int) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if (k.startswith(_FORWARD_PREFIXES) or k in _FORWARD_NAMES) and "\n" not in v
    }
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    master = args.master_addr or hosts[0]
    node = _node_args(args, nnodes=args.nnodes or str(len(hosts)), node_rank=node_rank, master_addr=master)
    # The same interpreter path on every node: clusters share one software tree (or one container image). Each node
    # runs the single-node `cai run`, so it waits for the others with progress lines and exits with the code of its
    # first failing rank, which ssh hands back here.
    run = shlex.join([sys.executable, "-m", "cai.mesh._cli", "run", *node])
    prefix = f"export {exports} && " if exports else ""
    return f"cd {shlex.quote(os.getcwd())} && {prefix}exec {run}"


def _ssh_argv(args: argparse.Namespace, host: str, remote: str) -> list[str]:
    # CAI_SSH replaces the ssh program (a wrapper, a container exec); BatchMode makes a missing key fail at once
    # with ssh's own message instead of waiting for a password prompt nobody can answer.
    ssh = shlex.split(os.environ.get("CAI_SSH", "ssh"))
    port = ["-p", str(args.ssh_port)] if args.ssh_port else []
    return [*ssh, "-o", "BatchMode=yes", *port, host, remote]


def _pump(stream, host: str, out, tail: deque[str] | None) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{host}] {line}")
        out.flush()
        if tail is not None:
            tail.append(line.rstrip("\n"))
    stream.close()


def _run_on_hosts(args: argparse.Namespace, hosts: list[str]) -> int:
    nodes = [
        _Node(host=h, node_rank=i, argv=_ssh_argv(args, h, _remote_command(args, hosts, i)))
        for i, h in enumerate(hosts)
    ]
    if args.dry_run:
        for node in nodes:
            print(shlex.join(node.argv))
        return 0
    print(f"====== Training on {len(nodes)} nodes: {', '.join(hosts)} ======", flush=True)
    for node in nodes:
        node.proc = subprocess.Popen(
            node.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
        )
        node.threads = [
            threading.Thread(target=_pump, args=(node.proc.stdout, node.host, sys.stdout, None), daemon=True),
            threading.Thread(
                target=_pump, args=(node.proc.stderr, node.host, sys.stderr, node.stderr_tail), daemon=True
            ),
        ]
        for t in node.threads:
            t.start()
    failed: list[_Node] = []
    pending = list(nodes)
    stopping_since: float | None = None
    while pending:
        for node in list(pending):
            assert node.proc is not None
            try:
                node.proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            pending.remove(node)
            for t in node.threads:
                t.join(timeout=5)
            if node.proc.returncode != 0:
                failed.append(node)
        if failed and pending:
            # The other nodes would wait for the failed one at the next rendezvous or collective: stop them. A
            # torchrun agent blocked in its exit barrier (its own ranks succeeded) handles SIGTERM only when that
            # wait ends, minutes later, so it gets SIGKILL after a grace period.
            stopping_since = stopping_since or time.monotonic()
            late = time.monotonic() - stopping_since > _STOP_GRACE_S
            for node in pending:
                node.proc.kill() if late else node.proc.terminate()  # type: ignore[union-attr]
    for node in nodes:
        code = node.proc.returncode  # type: ignore[union-attr]
        print(
            f"cai run: {node.host} (node_rank {node.node_rank}): {'ok' if code == 0 else f'exit code {code}'}",
            flush=True,
        )
    if not failed:
        return 0
    first = failed[0]
    code = first.proc.returncode  # type: ignore[union-attr]
    lines = [f"cai run: node {first.host} (node_rank {first.node_rank}) failed with exit code {code}"]
    if code == 255:
        lines.append(
            f"  ssh could not connect or authenticate: check that `ssh {first.host}` works without a password"
        )
    lines.append(f"  command: {shlex.join(first.argv)}")
    lines.append("  remote error (last lines of stderr):")
    lines += [f"    {line}" for line in first.stderr_tail] or ["    (no output)"]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code or 1
