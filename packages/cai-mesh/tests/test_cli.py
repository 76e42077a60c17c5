"""The `cai` command: `cai run` starting real local processes (and hostfile nodes through an ssh stand-in), `cai check`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from cai.mesh import _cli_run, free_port
from cai.mesh._cli import main
from cai.mesh._cli_check import _report_kernels
from cai.mesh._cli_run import read_hostfile, select_hosts

# A training script reduced to its launch: every rank all-reduces rank + 1 and writes what it saw.
WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from cai.mesh import launch_from_torch

    torch.set_num_threads(1)
    launch_from_torch(seed=1, verbose=False)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text(f"{dist.get_world_size()} {t.item()} {sys.argv[2]}")
    dist.destroy_process_group()
    """
)

# Stands in for ssh (a shell script, so it costs no interpreter start): runs the remote command on this machine,
# or fails the way ssh does for hosts named bad*.
FAKE_SSH = textwrap.dedent(
    """\
    #!/bin/bash
    while [ "$1" = "-o" ] || [ "$1" = "-p" ]; do shift 2; done
    host="$1"
    if [[ "$host" == bad* ]]; then
        echo "ssh: Could not resolve hostname $host: Name or service not known" >&2
        exit 255
    fi
    exec bash -c "$2"
    """
)


def _cai() -> list[str]:
    script = Path(sys.executable).with_name("cai")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cai.mesh._cli"]


def _launch(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """Run a real launch on a free master port; ``{port}`` in ``cmd`` is filled in. The port is only free when
    probed: another process (a parallel test worker) may take it before torchrun binds it, so a launch that fails
    with EADDRINUSE is retried once on a new port."""
    for attempt in range(2):
        port = str(free_port())
        proc = subprocess.run(
            [port if a == "{port}" else a for a in cmd],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
        if "EADDRINUSE" not in proc.stdout + proc.stderr or attempt:
            return proc
    raise AssertionError("unreachable")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    (tmp_path / "out").mkdir()
    return path


def _fake_ssh(folder: Path) -> None:
    path = folder / "ssh.sh"
    path.write_text(FAKE_SSH)
    path.chmod(0o755)


def _results(out: Path) -> list[str]:
    return sorted(p.read_text() for p in out.glob("rank*.txt"))


def test_cai_run_starts_2_local_processes(worker: Path) -> None:
    out = worker.parent / "out"
    cmd = [
        *_cai(),
        "run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "{port}",
        str(worker),
        str(out),
        "--flag",
    ]
    proc = _launch(cmd, env=_env(), cwd=worker.parent, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _results(out) == ["2 3.0 --flag", "2 3.0 --flag"]


def test_cai_run_hostfile_starts_one_torchrun_per_node(worker: Path) -> None:
    out = worker.parent / "out"
    _fake_ssh(worker.parent)
    (worker.parent / "hosts").write_text("# two nodes\nnodeA slots=1\n\nnodeB\nnodeC\n")
    cmd = [
        *_cai(), "run", "--hostfile", "hosts", "--exclude", "nodeC", "--nproc_per_node", "1",
        "--master_addr", "127.0.0.1", "--master_port", "{port}", str(worker), str(out), "x",
    ]  # fmt: skip
    env = _env(CAI_SSH=str(worker.parent / "ssh.sh"))
    proc = _launch(cmd, env=env, cwd=worker.parent, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _results(out) == ["2 3.0 x", "2 3.0 x"]
    assert "nodeA (node_rank 0): ok" in proc.stdout and "nodeB (node_rank 1): ok" in proc.stdout
    assert "nodeC" not in proc.stdout


def test_cai_run_reports_host_command_and_remote_error(worker: Path) -> None:
    _fake_ssh(worker.parent)
    cmd = [
        *_cai(),
        "run",
        "-H",
        "nodeA,badhost",
        "--nproc_per_node",
        "1",
        "--master_port",
        str(free_port()),
        str(worker),
        "o",
        "x",
    ]
    env = _env(CAI_SSH=str(worker.parent / "ssh.sh"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=worker.parent)
    assert proc.returncode == 255, proc.stdout + proc.stderr
    err = proc.stderr
    assert "cai run: node badhost (node_rank 1) failed with exit code 255" in err
    assert "ssh could not connect or authenticate" in err
    assert "command: " in err and "badhost" in err and "--node_rank=1" in err and "--nnodes=2" in err
    assert "ssh: Could not resolve hostname badhost" in err.split("remote error")[1]


def test_cai_run_hostfile_returns_the_failing_ranks_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (the nodes are still real processes, started through the ssh stand-in), so that the grace
    # before SIGKILL can be cut: nodeA's agent, whose rank succeeded, waits in torchrun's exit barrier and ignores
    # SIGTERM, so it is always killed after the grace, which would be 10 s of waiting here.
    (tmp_path / "fail.py").write_text(FAILING_WORKER)
    _fake_ssh(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CAI_SSH", str(tmp_path / "ssh.sh"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(_cli_run, "_STOP_GRACE_S", 1.0)
    for attempt in range(2):  # as _launch: a port taken before torchrun binds it is retried once
        code = main(["run", "-H", "nodeA,nodeB", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                     "--master_port", str(free_port()), "fail.py"])  # fmt: skip
        out, err = capsys.readouterr()
        if "EADDRINUSE" not in out + err or attempt:
            break
    assert code == 3, out + err
    assert "[nodeB] cai run: rank 1 (local_rank 0) exited with code 3" in err
    assert "cai run: node nodeB (node_rank 1) failed with exit code 3" in err


def test_cai_run_dry_run_commands(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "--dry_run", "--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1",
                 "--master_addr", "10.0.0.1", "--master_port", "1234", "--extra_launch_args", "max_restarts=3,no_python",
                 "train.py", "--lr", "1"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip()
    assert line.endswith(
        "-m torch.distributed.run --nproc_per_node=4 --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 "
        "--master_port=1234 --max_restarts=3 --no_python train.py --lr 1"
    )
    assert main(["run", "--dry_run", "--nproc_per_node", "2", "--nnodes", "1:2", "--rdzv_endpoint", "h:29400",
                 "--rdzv_id", "job7", "-m", "pkg.train"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip()
    assert line.endswith(
        "--nproc_per_node=2 --nnodes=1:2 --rdzv_endpoint=h:29400 --rdzv_backend=c10d --rdzv_id=job7 -m pkg.train"
    )
    (tmp_path / "hosts").write_text("n1\nn2\n")
    assert (
        main(["run", "--dry_run", "--hostfile", str(tmp_path / "hosts"), "--nproc_per_node", "8", "t.py"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("ssh -o BatchMode=yes n1 ") and " n2 " in lines[1]
    assert (
        "-m cai.mesh._cli run --nproc_per_node=8 --nnodes=2 --node_rank=1 --master_addr=n1 --master_port=29500 t.py"
        in lines[1]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nproc_per_node", "1", "train"], "'train' is not a .py file; use -m to run a module"),
        (["run", "--include", "a", "t.py"], "--include/--exclude need --hostfile or --host"),
        (
            ["run", "-H", "a,b", "--include", "a", "--exclude", "b", "t.py"],
            "--include and --exclude cannot be used together",
        ),
        (
            ["run", "-H", "a,b", "--include", "c", "t.py"],
            "hosts ['c'] are not in the hostfile (it lists ['a', 'b'])",
        ),
        (["run", "-H", "a", "--exclude", "a", "t.py"], "no hosts left to run on"),
        (["run", "--hostfile", "/nonexistent/hosts", "t.py"], "No such file or directory"),
        (["run", "-H", "", "t.py"], "-H/--host '' lists no hosts"),
        (["run", "-H", " , ", "t.py"], "-H/--host ' , ' lists no hosts"),
        (["run", "--nnodes", "2", "--node_rank", "2", "t.py"], "--node_rank 2 must be < --nnodes 2"),
    ],
    ids=[
        "not-py",
        "include-alone",
        "include-exclude",
        "unknown-host",
        "none-left",
        "no-hostfile",
        "empty-host",
        "blank-hosts",
        "node-rank",
    ],
)
def test_cai_run_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--master_port", "99999"],
            "argument --master_port/--master-port: 99999 is not a port number (1..65535)",
        ),
        (["--master_port", "0"], "0 is not a port number (1..65535)"),
        (["--master_port", "http"], "'http' is not a port number (1..65535)"),
        (["--ssh_port", "70000"], "argument --ssh_port/--ssh-port: 70000 is not a port number"),
        (["--nproc_per_node", "0"], "the number of processes must be >= 1, got 0"),
        (["--nproc_per_node", "two"], "'two' is not an integer"),
        (["--node_rank", "-1"], "a node rank must be >= 0, got -1"),
        (["--nnodes", "3:2"], "'3:2' is not N or MIN:MAX with 1 <= MIN <= MAX"),
        (["--nnodes", "0"], "'0' is not N or MIN:MAX"),
        (
            ["--rdzv_endpoint", "h:99999"],
            "The port number of the rendezvous endpoint 'h:99999' must be an integer",
        ),
        (["--rdzv_endpoint", "h h:1"], "The hostname of the rendezvous endpoint 'h h:1' must be"),
        (["--rdzv_timeout", "0"], "argument --rdzv_timeout/--rdzv-timeout: must be positive, got 0"),
        (["--max_restarts", "-2"], "--max-restarts: the number of restarts must be >= 0, got -2"),
    ],
    ids=[
        "port-range",
        "port-zero",
        "port-text",
        "ssh-port",
        "nproc",
        "nproc-text",
        "node-rank",
        "nnodes-order",
        "nnodes-zero",
        "endpoint-port",
        "endpoint-bracket",
        "rdzv-timeout",
        "max-restarts",
    ],
)
def test_cai_run_malformed_arguments_get_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        main(["run", *argv, "t.py"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cai run: error: ") and message in lines[0], lines
    assert lines[0].endswith("(see `cai run --help`)")


def test_cai_run_accepts_well_formed_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--rdzv_endpoint", "[::1]:29400"], ["--rdzv_endpoint", "h"], ["--nnodes", "1:4"]):
        assert main(["run", "--dry_run", "--nproc_per_node", "1", *extra, "t.py"]) == 0
    assert "--nnodes=1:4" in capsys.readouterr().out
    # With a rendezvous endpoint, --rdzv_timeout becomes torchrun's join_timeout, next to the user's own conf.
    argv = ["run", "--dry_run", "--nproc_per_node", "1", "--rdzv_endpoint", "h:1", "--rdzv_timeout", "30"]
    assert main([*argv, "--rdzv_conf", "read_timeout=9", "t.py"]) == 0
    assert "--rdzv_conf=read_timeout=9,join_timeout=30 t.py" in capsys.readouterr().out
    assert main([*argv, "--rdzv_conf", "join_timeout=5", "t.py"]) == 0
    assert "--rdzv_conf=join_timeout=5 t.py" in capsys.readouterr().out


def test_cai_run_bad_port_from_the_shell() -> None:
    proc = subprocess.run([*_cai(), "run", "--master_port", "99999", "t.py"], env=_env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "cai run: error: argument --master_port/--master-port: 99999 is not a port number (1..65535) "
        "(see `cai run --help`)"
    ]


FAILING_WORKER = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from cai.mesh import launch_from_torch

    launch_from_torch(verbose=False)
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(3 if rank == 1 else 0)
    """
)


def test_cai_run_returns_the_failing_ranks_exit_code(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(FAILING_WORKER)
    cmd = [*_cai(), "run", "--nproc_per_node", "2", "--master_port", "{port}", "fail.py"]
    proc = _launch(cmd, env=_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cai run: rank 1 (local_rank 1) exited with code 3" in proc.stderr


def test_cai_run_nnodes_reports_missing_nodes_and_gives_up(tmp_path: Path) -> None:
    port = free_port()
    cmd = [*_cai(), "run", "--nproc_per_node", "1", "--nnodes", "2", "--master_port", str(port),
           "--rdzv_timeout", "4", "t.py"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - start < 60
    err = proc.stderr
    assert f"cai run: waiting for 1 of 2 nodes (node_rank 1) at 127.0.0.1:{port}" in err, err
    assert (
        f"cai run: 1 of 2 nodes joined at 127.0.0.1:{port} within 4 s (--rdzv_timeout); missing node_rank 1"
        in err
    )


def test_cai_run_nnodes_starts_when_the_last_node_joins(worker: Path) -> None:
    out = worker.parent / "out"
    port = str(free_port())

    def node(rank: int) -> subprocess.Popen:
        cmd = [*_cai(), "run", "--nproc_per_node", "1", "--nnodes", "2", "--node_rank", str(rank),
               "--master_port", port, "--rdzv_timeout", "90", str(worker), str(out), "n"]  # fmt: skip
        return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=worker.parent)  # fmt: skip

    first = node(0)
    second = None
    try:
        seen = []
        for line in first.stderr:  # node 0 says what it waits for before the second node starts
            seen.append(line)
            if "waiting for 1 of 2 nodes (node_rank 1)" in line:
                break
        assert seen and "waiting for 1 of 2 nodes" in seen[-1], seen
        second = node(1)
        out0, err0 = first.communicate(timeout=110)
        out1, err1 = second.communicate(timeout=60)
        assert first.returncode == 0 and second.returncode == 0, out0 + err0 + out1 + err1
        assert _results(out) == ["2 3.0 n", "2 3.0 n"]
        assert "recvValue failed" not in err1  # node 1 saw node 0's store close without a failed request
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()


def test_hostfile_parsing(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("a slots=8  # first\n\n# comment\nb\nc\n")
    assert read_hostfile(str(f)) == ["a", "b", "c"]
    assert select_hosts(["a", "b", "c"], "c,a", None) == ["a", "c"]
    assert select_hosts(["a", "b", "c"], None, "b", num_nodes=1) == ["a"]
    f.write_text("a\nb\na\n")
    with pytest.raises(ValueError, match=r"hosts:3: host 'a' is listed twice"):
        read_hostfile(str(f))
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="lists no hosts"):
        read_hostfile(str(f))


def test_cai_check() -> None:
    proc = subprocess.run([*_cai(), "check"], env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for label in (
        "torch ",
        "torch built for CUDA",
        "NCCL",
        "gloo",
        "triton",
        "nvcc",
        "gcc",
        "ninja",
        "cai packages",
    ):
        assert f"  {label}" in out, label
    assert torch.__version__ in out and "cai-mesh" in out
    assert "Kernels\n" in out
    world = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert f"All-reduce ({world} local ranks" in out and "result                 ok, " in out


def _kernel_output(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module: object
) -> str:
    monkeypatch.setitem(sys.modules, "cai.kernels", module)
    # `import cai.kernels as k` binds the `cai` namespace's attribute when a real cai.kernels was imported earlier
    monkeypatch.delattr(sys.modules["cai"], "kernels", raising=False)
    _report_kernels()
    return capsys.readouterr().out


def test_cai_check_kernel_report(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # None in sys.modules makes the import fail, as if the package were not installed.
    assert "cai-kernels not installed" in _kernel_output(monkeypatch, capsys, None)
    fake = types.ModuleType("cai.kernels")
    fake.kernel_report = lambda: [("rms_norm", "triton", ""), ("rotary", "torch", "triton not installed")]
    out = _kernel_output(monkeypatch, capsys, fake)
    assert (
        "rms_norm" in out and "triton" in out and "rotary                 torch: triton not installed" in out
    )

    def broken() -> list:
        raise RuntimeError("probe exploded")

    fake.kernel_report = broken
    assert "kernel_report() failed: RuntimeError: probe exploded" in _kernel_output(monkeypatch, capsys, fake)


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main([])
    assert err.value.code == 2 and "run,check" in capsys.readouterr().err


def test_cai_run_and_check_load_no_plugins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import cai.mesh._cli as cli

    loaded = []

    class _EntryPoint:
        name, value = "serve", "pkg:add_serve_parser"

        def load(self):
            loaded.append(self.name)
            return lambda sub: sub.add_parser("serve")

    monkeypatch.setattr(cli.md, "entry_points", lambda group: [_EntryPoint()] if group == "cai.cli" else [])
    # the launcher's own commands start without importing other packages
    assert main(["run", "--dry_run", "--nproc_per_node", "1", "t.py"]) == 0
    assert "-m torch.distributed.run --nproc_per_node=1" in capsys.readouterr().out
    assert loaded == []
    # any other command line lists the plugins' commands beside them
    with pytest.raises(SystemExit) as err:
        main([])
    assert err.value.code == 2 and "run,check,serve" in capsys.readouterr().err
    assert loaded == ["serve"]


NCCL_WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from cai.mesh import ParallelDims, get_current_device, launch_from_torch

    launch_from_torch(seed=1, verbose=False)
    mesh = ParallelDims(dp=-1).build_mesh()
    t = torch.full((1,), float(dist.get_rank() + 1), device=get_current_device())
    dist.all_reduce(t, group=mesh.group(("dp", "sp")))
    Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text(f"{dist.get_backend()} {mesh.device_type} {t.item()}")
    dist.destroy_process_group()
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cai_run_on_local_gpus_with_nccl(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(NCCL_WORKER)
    n = torch.cuda.device_count()
    cmd = [
        *_cai(),
        "run",
        "--nproc_per_node",
        str(n),
        "--master_port",
        "{port}",
        "w.py",
        str(tmp_path),
    ]
    proc = _launch(cmd, env=_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _results(tmp_path) == [f"nccl cuda {n * (n + 1) / 2}"] * n
