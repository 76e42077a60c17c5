"""Every fenced block of every README runs, or is checked against the code, in its own pytest id.

How each kind of block is covered (``_readme_blocks.py`` finds them; an uncovered block fails):

- ``python``: written to ``block.py`` in a fresh temporary directory and run in a fresh interpreter (CPU,
  ``TRITON_INTERPRET=1``, ``OMP_NUM_THREADS=1``); with ``nproc=N`` in the block's directive, under
  ``cai run --standalone --nproc_per_node N`` with gloo. A block that uses names a user brings (a model, a data
  loader) says ``setup=NAME``: the code in ``SETUPS[NAME]`` runs first, and the files it lists are created in the
  directory first (a tiny Llama saved under the name the block loads). ``sub=NAME`` applies the textual
  replacements of ``SUBSTITUTIONS[NAME]``, each of which must occur in the block.
- ``bash``: each command is matched by exactly one rule of ``_shell_rule``. Commands in ``RUN`` run from a
  temporary directory that links ``examples/`` (so what they write stays there), with the extra arguments listed
  beside them (fewer steps, nothing else). The rest cannot run in a unit test (pip installs, nox sessions, GPU
  benchmarks, multi-node launches) and are checked statically: a script exists and its argparse accepts the
  arguments as written, ``cai run``'s parser accepts its options, a nox session exists, a shell script has the
  mode given, a pip package is one of ours with the extras named.
- ``text``: sample output or a file layout; ``check=NAME`` names the function in ``CHECKS`` that compares it with
  what the code produces.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
from _readme_blocks import ROOT, Block, all_blocks, find_readmes, parse_directive, shell_commands

BLOCKS = all_blocks()
TIMEOUT = 600  # seconds per program: generous because CI machines run many tests on few cores


# ---- setups: what a block takes from its context, made explicit -------------------------------------------


def _save_tiny_llama(path: Path) -> None:
    """A 2-layer Llama with a 256-token vocabulary, saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(path)


_TINY_LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
_config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
"""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Code run before the block (same interpreter) and files created in its directory beforehand."""

    code: str = ""
    files: dict[str, Callable[[Path], None]] = field(default_factory=dict)


SETUPS: dict[str, Setup] = {
    # The root quick start: `model`, `criterion` and `dataloader` are the user's. A tiny HF Llama, a loss
    # that reads the model output, and 8 batches of 4 random 32-token sequences.
    "tiny-llama": Setup(
        code=_TINY_LLAMA
        + """
model = LlamaForCausalLM(_config)
criterion = lambda outputs, batch: outputs.loss
_ids = torch.randint(0, 256, (8, 4, 32))
dataloader = [{"input_ids": ids, "labels": ids} for ids in _ids]
"""
    ),
    # cai-booster: `dataset` is the user's (items of input_ids/labels); the block loads "path/to/llama",
    # which is a tiny Llama saved there.
    "booster-dataset": Setup(
        code="""
import torch

_ids = torch.randint(0, 256, (64, 32))
dataset = [{"input_ids": ids, "labels": ids} for ids in _ids]
""",
        files={"path/to/llama": _save_tiny_llama},
    ),
    # cai-booster's token-weighted step: a boosted tiny Llama under ZeRO-2 and an iterator `it` of padded batches.
    "booster-boosted": Setup(
        code=_TINY_LLAMA
        + """
import contextlib

from cai.booster import Booster
from cai.booster.plugin import LowLevelZeroPlugin
from cai.mesh import launch_from_torch

launch_from_torch(seed=0)
booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"), device="cpu")
model = LlamaForCausalLM(_config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, *_ = booster.boost(model, optimizer)
accum = 2
_ids = torch.randint(0, 256, (accum, 2, 32))
it = iter([{"input_ids": ids, "labels": ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)} for ids in _ids])
"""
    ),
    # cai-gemini: the block loads "meta-llama/Llama-3.1-8B" with from_pretrained; a tiny Llama is saved
    # under that directory name, so nothing is downloaded and the model fits a test.
    "gemini-tiny-llama": Setup(files={"meta-llama/Llama-3.1-8B": _save_tiny_llama}),
    # cai-zero: `build_model()` and `loader` (lists of micro-batches) are the user's.
    "zero-model": Setup(
        code=_TINY_LLAMA
        + """
build_model = lambda: LlamaForCausalLM(_config)
_ids = torch.randint(0, 256, (3, 2, 4, 32))  # 3 steps of 2 micro-batches of 4 sequences
loader = [[{"input_ids": ids, "labels": ids} for ids in step] for step in _ids]
"""
    ),
    # cai-ckpt: the training objects are the user's: a tiny HF Llama (so config.json is written), AdamW after
    # one step, an LR scheduler, a GradScaler and a loader that reports its position.
    "ckpt-objects": Setup(
        code=_TINY_LLAMA
        + """
model = LlamaForCausalLM(_config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
_ids = torch.randint(0, 256, (2, 16))
model(input_ids=_ids, labels=_ids).loss.backward()
optimizer.step()
sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
scaler = torch.amp.GradScaler("cpu")


class _Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


loader = _Loader()
"""
    ),
}

# Replacements applied to a block before it runs; each `old` must be in the block, so a README that changes
# the text fails here instead of silently running something else.
SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    # cai-mesh: the example asks for tp=4 x pp=2 (8 ranks or more); the test runs it on 2 gloo ranks.
    "mesh-2-ranks": [("ParallelDims(dp=-1, tp=4, pp=2)", "ParallelDims(dp=-1, tp=2, pp=1)")],
}


# ---- running programs ---------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a launcher's variables from the test run must not leak into the programs
    return env


def _run(argv: list[str], *, cwd: Path, what: str) -> str:
    proc = subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what}: `{' '.join(argv)}` exited with {proc.returncode}:\n{out[-6000:]}"
    return out


def _cai(*args: str) -> list[str]:
    # The `cai` console script of this interpreter's environment, called through its module.
    return [sys.executable, "-m", "cai.mesh._cli", *args]


def _python_block(block: Block, tmp_path: Path) -> None:
    d = block.directive
    code = block.text
    for old, new in SUBSTITUTIONS[d["sub"]] if "sub" in d else []:
        assert old in code, f"{block.id}: substitution {d['sub']!r} expects {old!r} in the block"
        code = code.replace(old, new)
    setup = SETUPS[d["setup"]] if "setup" in d else Setup()
    for rel, make in setup.files.items():
        make(tmp_path / rel)
    program = tmp_path / "block.py"
    program.write_text(f"{setup.code}\n# ---- {block.id} ----\n{code}")
    nproc = int(d.get("nproc", "1"))
    if nproc > 1:
        argv = _cai("run", "--standalone", "--nproc_per_node", str(nproc), str(program))
    else:
        argv = [sys.executable, str(program)]
    _run(argv, cwd=tmp_path, what=block.id)


# ---- shell commands --------------------------------------------------------------------------------------

# Commands that run (from a directory where examples/ is linked), with the only arguments added to each.
# Every other command of the READMEs is checked statically, today: README.md's pip and nox lines;
# examples/README.md's `--plugin zero2` variant, its 8-GPU `cai run` and the two finetune lines that name the
# reader's model directory and data; examples/benchmarks/README.md's run_booster_rows.sh (GPU); all of
# integration-tests/gpu/README.md; cai-kernels' pip lines and GPU benchmarks; cai-mesh's `cai run` lines
# (through `--dry_run` where no hostfile is involved).
RUN: dict[str, str] = {
    "cai check": "",
    # 400 steps take minutes; 8 steps with the checkpoint at 4 still save, rebuild, resume and evaluate.
    "python examples/train_llama.py": "--steps 8 --save-at 4 --log-every 2 --eval-samples 16",
    "python examples/finetune_hf.py --model tiny": "--steps 4 --log-every 2 --eval-samples 8",
    "python examples/benchmarks/benchmark.py -c tiny -b 2 -l 64 -s 3 -i 1 --compare --peers eager,fsdp2": "",
}


_RUN_OUTPUT: dict[str, str] = {}


def _run_example(command: str, tmp_path: Path) -> str:
    """Run a RUN command from ``tmp_path`` (with examples/ linked there), once per test process: the
    sample-output check reuses the main job's output."""
    if command not in _RUN_OUTPUT:
        argv = command.split()
        work = tmp_path / f"run-{len(_RUN_OUTPUT)}"  # one directory per command, as a block may hold several
        work.mkdir()
        (work / "examples").symlink_to(ROOT / "examples")
        if argv[0] == "cai":
            argv = _cai(*argv[1:])
        elif argv[0] in ("python", "python3"):
            argv = [sys.executable, *argv[1:]]
        _RUN_OUTPUT[command] = _run([*argv, *RUN[command].split()], cwd=work, what=command)
    return _RUN_OUTPUT[command]


class _Parsed(Exception):
    pass


def _check_script_args(script: str, args: list[str]) -> None:
    """Run ``script`` as __main__ up to its argparse call, parse ``args`` there, and stop."""
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    real = argparse.ArgumentParser.parse_args

    def parse(self, _args=None, namespace=None):
        try:
            raise _Parsed(real(self, args, namespace))
        except SystemExit as e:
            raise AssertionError(
                f"{script} rejects the arguments {args} (its argparse exited {e.code})"
            ) from e

    sys.path[:0] = [str(path.parent), str(ROOT / "examples")]
    try:
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse),
            mock.patch.object(sys, "argv", [str(path), *args]),
        ):
            runpy.run_path(str(path), run_name="__main__")
    except _Parsed:
        return
    finally:
        del sys.path[:2]
    raise AssertionError(f"{script} finished without parsing its arguments")


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) == "nox.session":
                    names.add(node.name)
    return names


def _case_labels(script: Path) -> set[str]:
    """The labels of the `case "$mode"` statement of a shell script (its modes)."""
    labels = set()
    for m in re.finditer(r"^\s*([\w|-]+)\)", script.read_text(), re.M):
        labels.update(m.group(1).split("|"))
    return labels


def _check_shell_script(script: str, args: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    if args:
        assert args[0] in _case_labels(path), (
            f"{script}: mode {args[0]!r} not in {sorted(_case_labels(path))}"
        )
    if script == "integration-tests/gpu/run.sh" and args[:1] == ["bench"]:
        for name in args[1:]:
            bench = ROOT / "examples" / "benchmarks" / f"bench_{name}.py"
            assert name == "booster" or bench.is_file(), f"run.sh bench {name}: {bench} does not exist"


# Tools a README tells the reader to pip-install that are not cai packages.
TOOLS = {"nox"}


def _extras(pyproject: Path) -> set[str]:
    """The keys of [project.optional-dependencies] (a small reader: tomllib needs Python 3.11)."""
    section = re.search(
        r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", pyproject.read_text(), re.M | re.S
    )
    return set(re.findall(r"^([\w.-]+)\s*=", section.group(1), re.M)) if section else set()


def _check_pip(args: list[str]) -> None:
    from packaging.requirements import Requirement

    assert args[:1] == ["install"], f"pip {args}: only `pip install` is expected"
    for arg in args[1:]:
        if arg.startswith("-"):
            continue
        if arg.endswith(".whl"):
            # The wheels come from `nox -s build`, which writes them into dist/ at the root.
            assert arg.startswith("dist/") and 'DIST = ROOT / "dist"' in (ROOT / "noxfile.py").read_text(), (
                arg
            )
            continue
        req = Requirement(arg)
        if req.name in TOOLS:
            continue
        pyproject = ROOT / "packages" / req.name / "pyproject.toml"
        assert pyproject.is_file(), f"pip install {arg}: {req.name} is not one of packages/*"
        extras = _extras(pyproject)
        missing = req.extras - set(extras)
        assert not missing, (
            f"pip install {arg}: {req.name} has no extra {sorted(missing)} (has {sorted(extras)})"
        )


def _check_nox(args: list[str]) -> None:
    assert args[0] == "-s", f"nox {args}: expected `nox -s SESSION`"
    session, posargs = args[1], args[3:] if args[2:3] == ["--"] else []
    assert session in _nox_sessions(), (
        f"nox session {session!r} not in noxfile.py ({sorted(_nox_sessions())})"
    )
    if session == "gpu":  # the gpu session passes its arguments to run.sh
        _check_shell_script("integration-tests/gpu/run.sh", posargs)
    elif session == "demo":
        _check_script_args("examples/train_llama.py", posargs)


def _check_cai(args: list[str]) -> None:
    from cai.mesh._cli import build_parser

    try:
        ns = build_parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"`cai {' '.join(args)}`: the cai parser rejects it (exit {e.code})") from e
    if args[0] == "run" and not (ns.hostfile or ns.host):
        # A local launch: `--dry_run` goes through cai run's own checks and prints the torchrun command.
        # (With --hostfile or -H the hosts are the reader's, so only the options are checked.)
        from cai.mesh._cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(["run", "--dry_run", *args[1:]])
        assert code == 0, f"`cai {' '.join(args)}` fails cai run's checks (exit {code}): {out.getvalue()}"
    script = getattr(ns, "script", None)
    if script and script.startswith("examples/"):
        _check_script_args(script, ns.script_args)
    # Any other script (train.py) is the user's program: only cai's own options are checked.


def _shell_command(argv: list[str], tmp_path: Path) -> None:
    command = " ".join(argv)
    if command in RUN:
        _run_example(command, tmp_path)
        return
    prog, args = argv[0], argv[1:]
    if prog in ("python", "python3") and args[:2] == ["-m", "pip"]:
        _check_pip(args[2:])
    elif prog == "pip":
        _check_pip(args)
    elif prog in ("python", "python3") and args and args[0].endswith(".py"):
        _check_script_args(args[0], args[1:])
    elif prog == "cai":
        _check_cai(args)
    elif prog == "nox":
        _check_nox(args)
    elif prog == "bash" and args and args[0].endswith(".sh"):
        _check_shell_script(args[0], args[1:])
    elif prog.endswith(".sh"):
        assert os.access(ROOT / prog, os.X_OK), f"{prog} is run directly but is not executable"
        _check_shell_script(prog, args)
    else:
        raise AssertionError(f"no rule runs or checks `{command}`: add one to test_readmes.py")


def _shell_block(block: Block, tmp_path: Path) -> None:
    commands = shell_commands(block.text)
    assert commands, f"{block.id}: a shell block without commands"
    for argv in commands:
        try:
            _shell_command(argv, tmp_path)
        except AssertionError as e:
            raise AssertionError(f"{block.id}: {e}") from e


# ---- text blocks: sample output and layouts, compared with the real thing ------------------------------


def _sample_line_pattern(line: str) -> re.Pattern:
    """A sample line as a regex: numbers stand for any number, runs of spaces for any, a bar for any bar."""
    out = []
    for tok in re.split(r"(\[[#.]+\]|\d[\d,]*(?:\.\d+)?| +)", line.strip()):
        if not tok:
            continue
        if re.fullmatch(r"\[[#.]+\]", tok):
            out.append(r"\[[#.]+\]")
        elif tok[0].isdigit():
            out.append(r"\d[\d,]*(?:\.\d+)?")
        elif tok.startswith(" "):
            out.append(" +")
        else:
            out.append(re.escape(tok))
    return re.compile("".join(out))


def _check_train_llama_output(block: Block, tmp_path: Path) -> None:
    out = _run_example("python examples/train_llama.py", tmp_path)
    lines = [line for line in block.text.splitlines() if line.strip() and line.strip() != "..."]
    for line in lines:
        assert _sample_line_pattern(line).search(out), f"sample line {line!r} matches no output line:\n{out}"


def _check_parallel_dims_error(block: Block, tmp_path: Path) -> None:
    from cai.mesh import ParallelDims

    text = block.text.strip()
    sizes = {k: int(v) for k, v in re.findall(r"\b(dp|pp|tp|sp|ep) \((\d+)\)", text)}
    world = int(re.search(r"world_size (\d+)", text).group(1))
    with pytest.raises(ValueError) as err:
        ParallelDims(**sizes, world_size=world)
    assert str(err.value) == text


def _check_ckpt_format(block: Block, tmp_path: Path) -> None:
    """Each file of the tree exists in a real save_state directory at step 100, and nothing else does."""
    program = tmp_path / "save.py"
    program.write_text(
        SETUPS["ckpt-objects"].code
        + "import cai.ckpt as ck\n"
        + "ck.save_state('ckpt', step=100, model=model, optimizer=optimizer, lr_scheduler=sched,"
        + " grad_scaler=scaler, dataloader=loader, extra={'epoch': 1})\n"
    )
    _run([sys.executable, str(program)], cwd=tmp_path, what=block.id)
    ckpt = tmp_path / "ckpt"
    written = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    patterns, stack = [], []  # (indent, directory) of the enclosing entries
    for line in block.text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        name = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if name.endswith("/"):
            stack.append((indent, name))
            continue
        rel = "".join(d for _, d in stack) + name
        patterns.append(re.escape(rel).replace("0000N", r"\d{5}").replace("0000i", r"\d{5}"))
    for pat in patterns:
        assert any(re.fullmatch(pat, w) for w in written), (
            f"{pat} is in the README but not in {sorted(written)}"
        )
    extra = [w for w in written if not any(re.fullmatch(p, w) for p in patterns)]
    assert not extra, f"the checkpoint has files the README's layout does not show: {extra}"


def _check_collective_timeout(block: Block, tmp_path: Path) -> None:
    """Every line of the sample appears in the error of a real 2-rank job whose rank 1 skips one all-reduce."""
    program = tmp_path / "out_of_step.py"
    program.write_text(
        "import time\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "from cai.mesh import advance_step, launch_from_torch\n"
        "launch_from_torch(timeout=5)\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
        "advance_step()\n"
        "if dist.get_rank() == 0:\n"
        "    dist.all_reduce(t)  # rank 1 skips this step's all-reduce\n"
        "advance_step()\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(2)  # rank 0's wait starts first, so it times out first rather than seeing rank 1 close\n"
        "try:\n"
        "    dist.barrier()\n"
        "except Exception:\n"
        "    time.sleep(20 * dist.get_rank())  # rank 0 prints its error before the launcher stops the job\n"
        "    raise\n"
    )
    argv = [*_cai("run", "--standalone", "--nproc_per_node", "2"), str(program)]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{block.id}: the out-of-step job did not fail:\n{out[-6000:]}"
    for line in block.text.splitlines():
        if line.strip():
            assert _sample_line_pattern(line).search(out), (
                f"sample line {line!r} matches no output line:\n{out}"
            )


CHECKS: dict[str, Callable[[Block, Path], None]] = {
    "collective-timeout": _check_collective_timeout,
    "train-llama-output": _check_train_llama_output,
    "parallel-dims-error": _check_parallel_dims_error,
    "ckpt-format": _check_ckpt_format,
}


# ---- the tests ----------------------------------------------------------------------------------------------


def test_readmes_are_found() -> None:
    """The glob finds the root, package, examples and GPU READMEs (a broken glob would test nothing)."""
    found = {p.relative_to(ROOT).as_posix() for p in find_readmes()}
    packages = {
        f"{p.relative_to(ROOT).as_posix()}/README.md" for p in (ROOT / "packages").iterdir() if p.is_dir()
    }
    assert {"README.md", "examples/README.md", "integration-tests/gpu/README.md"} <= found
    assert packages <= found, sorted(packages - found)


def test_directives_name_known_setups() -> None:
    known = {"setup": SETUPS, "sub": SUBSTITUTIONS, "check": CHECKS}
    for block in BLOCKS:
        for key, value in block.directive.items():
            wanted = "text" if key == "check" else "python"
            assert block.lang == wanted, (
                f"{block.id}: {key}= applies to {wanted} blocks, not {block.lang!r} ones"
            )
            if key == "nproc":
                assert value.isdigit() and int(value) >= 1, f"{block.id}: nproc={value}"
                continue
            assert key in known, (
                f"{block.id}: unknown directive key {key!r} (known: nproc, {', '.join(known)})"
            )
            assert value in known[key], f"{block.id}: {key}={value} is not defined in test_readmes.py"


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, tmp_path: Path) -> None:
    if block.lang == "python":
        _python_block(block, tmp_path)
    elif block.lang in ("bash", "sh", "shell", "console"):
        _shell_block(block, tmp_path)
    elif block.lang == "text" and "check" in block.directive:
        CHECKS[block.directive["check"]](block, tmp_path)
    else:
        pytest.fail(
            f"{block.id}: a ```{block.lang or '(untagged)'} block that nothing runs or checks: tag it python or "
            "bash, or tag it text with a `<!-- readme-test: check=NAME -->` line above and a checker in CHECKS"
        )


# ---- the machinery itself: it must be able to fail ------------------------------------------------------


def test_blocks_directives_and_commands_are_parsed(tmp_path: Path) -> None:
    from _readme_blocks import parse_blocks

    (tmp_path / "README.md").write_text(
        "# t\n\n<!-- readme-test: setup=a nproc=2 -->\n```python\nx = 1\n```\n\n"
        "```\nplain\n```\n\n  ```bash\n  echo a && echo b; echo 'c d'  # e\n  ls \\\n    -l\n  ```\n"
    )
    blocks = parse_blocks(tmp_path / "README.md", root=tmp_path)
    assert [(b.line, b.lang, b.directive) for b in blocks] == [
        (4, "python", {"setup": "a", "nproc": "2"}),
        (8, "", {}),
        (12, "bash", {}),
    ]
    assert blocks[0].text == "x = 1\n" and blocks[0].id == "README.md:4"
    assert shell_commands(blocks[2].text) == [["echo", "a"], ["echo", "b"], ["echo", "c d"], ["ls", "-l"]]
    assert shell_commands("$ cai check\nPython 3.11\n$ ls -l  # files\nREADME.md\n") == [
        ["cai", "check"],
        ["ls", "-l"],
    ]
    (tmp_path / "README.md").write_text("```python\nnever closed\n")
    with pytest.raises(ValueError, match="never closed"):
        parse_blocks(tmp_path / "README.md", root=tmp_path)
    with pytest.raises(ValueError, match="not key=value"):
        parse_directive("setup=a nproc")


def test_uncovered_blocks_and_drifted_commands_fail(tmp_path: Path) -> None:
    untagged = Block(readme="README.md", line=1, lang="", text="something\n")
    with pytest.raises(pytest.fail.Exception, match="nothing runs or checks"):
        test_readme_block(untagged, tmp_path)
    drifted = [
        "python examples/train_llama.py --plugin zero3",  # not a choice of --plugin
        "python examples/no_such_script.py",
        "cai run --nproc_per_node eight train.py",
        "cai run --nproc_per_node 8 train.sh",  # not a .py file: cai run's own check
        "nox -s no_such_session",
        "pip install cai-kernels[no_such_extra]",
        "pip install cai-nothing",
        "bash integration-tests/gpu/run.sh bench no_such_bench",
        "examples/benchmarks/run_booster_rows.sh 70b",
        "make all",
    ]
    for command in drifted:
        block = Block(readme="README.md", line=1, lang="bash", text=command + "\n")
        with pytest.raises(AssertionError):
            _shell_block(block, tmp_path)


def test_sample_lines_match_only_the_same_shape() -> None:
    pattern = _sample_line_pattern("step 200/400 [####....] loss 0.2797 | 1,885 tok/s")
    assert pattern.search("step  12/24 [##......] loss 1.5 | 12,345,678 tok/s")
    assert not pattern.search("step 12/24 [##......] loss 1.5 | 12 tokens/s")
