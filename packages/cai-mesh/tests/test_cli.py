"""The `cai` command: `cai run` starting real local processes (and hostfile nodes through an ssh stand-in), `cai check`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """Run a real launch on a free master port; ``{port}`` in ``cmd`` is filled in. The port is only free when
    probed: another process (a parallel test worker) may take it before torchrun binds it, so a launch that fails
    with EADDRINUSE is retried once on a new port."""
    for attempt in range(2):
        port = str(_free_port())
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
        str(_free_port()),
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
    assert "--node_rank=1 --master_addr=n1 --master_port=29500" in lines[1] and "--nnodes=2" in lines[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nproc_per_node", "0", "t.py"], "--nproc_per_node must be >= 1, got 0"),
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
    ],
    ids=["nproc", "not-py", "include-alone", "include-exclude", "unknown-host", "none-left", "no-hostfile"],
)
def test_cai_run_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


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
