"""``cai run --nnodes N`` (static form): wait until every node has started, saying which ones are missing.

[Note: node rendezvous before torchrun]
torchrun's static rendezvous waits silently (ten minutes by default) for the other nodes at MASTER_ADDR:PORT. So
``cai run`` first meets the other nodes' ``cai run`` on the same port: node 0 hosts a small TCPStore there, every
node posts its node rank, and every node that is still waiting prints every ``_REPORT_S`` seconds which node
ranks are missing, giving up after ``--rdzv_timeout``. When all have joined, the nodes hand the port over to torchrun: node 0 announces the
close, waits until every other node has acknowledged it, and closes the store; the other nodes start torchrun
only once their connection has dropped, so no torchrun connects to the store that is going away (torchrun's
clients retry until node 0's torchrun listens). Every node of a static multi-node job is therefore started with
``cai run``; a node started with plain torchrun would connect to this store instead and never be counted.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from datetime import timedelta

__all__ = ["NodeWaitTimeout", "wait_for_nodes"]

_FIRST_REPORT_S = 2.0  # nodes started together join within this; only a real wait is reported
_REPORT_S = 15.0
_POLL_S = 0.2
_HANDOVER_S = 60.0


class NodeWaitTimeout(RuntimeError):
    """Not every node joined within --rdzv_timeout."""


def _key(what: str, node_rank: int) -> str:
    return f"cai_run/{what}/{node_rank}"


def _connect(addr: str, port: int, deadline: float, node_rank: int, out) -> object:
    """Connect to node 0's store, reporting the wait; probing with a plain socket keeps c10d's retry logs quiet."""
    import torch.distributed as dist

    start = time.monotonic()
    next_report = start + _FIRST_REPORT_S
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                break
        except OSError:
            pass
        now = time.monotonic()
        if now >= deadline:
            raise NodeWaitTimeout(
                f"node_rank {node_rank} could not reach node 0 at {addr}:{port} within {now - start:.0f} s "
                "(--rdzv_timeout): start `cai run ... --node_rank 0` there with the same --master_addr and "
                "--master_port, and check that this node can reach that address and port"
            )
        if now >= next_report:
            print(f"cai run: node_rank {node_rank} waiting for node 0 at {addr}:{port} ({now - start:.0f} s)",
                  file=out, flush=True)  # fmt: skip
            next_report = now + _REPORT_S
        time.sleep(_POLL_S)
    left = max(deadline - time.monotonic(), 1.0)
    return dist.TCPStore(addr, port, None, False, timedelta(seconds=left))


def wait_for_nodes(
    addr: str, port: int, nnodes: int, node_rank: int, timeout_s: float, out=sys.stderr
) -> None:
    """Block until the ``cai run`` of every node rank in ``range(nnodes)`` has joined at ``addr:port``, then free
    the port for torchrun (see [Note: node rendezvous before torchrun]). Raises ``NodeWaitTimeout``."""
    import torch.distributed as dist

    start = time.monotonic()
    deadline = start + timeout_s
    if node_rank == 0:
        store = dist.TCPStore(
            addr, port, None, True, timedelta(seconds=max(timeout_s, 1.0)), wait_for_workers=False
        )
    else:
        store = _connect(addr, port, deadline, node_rank, out)
    store.set(_key("joined", node_rank), socket.gethostname())
    next_report = start + _FIRST_REPORT_S
    while True:
        missing = [r for r in range(nnodes) if not store.check([_key("joined", r)])]
        if not missing:
            break
        now = time.monotonic()
        if now >= deadline:
            raise NodeWaitTimeout(
                f"{nnodes - len(missing)} of {nnodes} nodes joined at {addr}:{port} within {timeout_s:g} s "
                f"(--rdzv_timeout); missing node_rank {', '.join(map(str, missing))}. Start `cai run` with the "
                "same --nnodes, --master_addr and --master_port and those --node_rank values on the other nodes"
            )
        if now >= next_report:
            print(
                f"cai run: waiting for {len(missing)} of {nnodes} nodes (node_rank "
                f"{', '.join(map(str, missing))}) at {addr}:{port}; {now - start:.0f} s of --rdzv_timeout "
                f"{timeout_s:g} s",
                file=out,
                flush=True,
            )
            next_report = now + _REPORT_S
        time.sleep(_POLL_S)
    _hand_over(store, nnodes, node_rank, addr, port)
    del store  # on node 0 this closes the server and frees the port for torchrun


def _hand_over(store, nnodes: int, node_rank: int, addr: str, port: int) -> None:
    handover_deadline = time.monotonic() + _HANDOVER_S
    if node_rank == 0:
        store.set("cai_run/closing", "1")
        others = [_key("left", r) for r in range(1, nnodes)]
        while not all(store.check([k]) for k in others) and time.monotonic() < handover_deadline:
            time.sleep(_POLL_S)
        return
    # A plain socket sees node 0's server close as end-of-file; a store request would fail with a logged traceback.
    with socket.create_connection((addr, port), timeout=_HANDOVER_S) as watch:
        while not store.check(["cai_run/closing"]):
            time.sleep(_POLL_S)
        store.set(_key("left", node_rank), "1")
        with contextlib.suppress(
            OSError
        ):  # a timeout or a reset: the server is gone or unreachable either way
            watch.recv(1)
