"""The fenced code blocks of every README in the repository, for ``test_readmes.py``.

A README is any ``README*.md`` under the repository root (outside hidden, build and virtual-environment
folders), so a new package's README is picked up without touching the test. A block may carry a directive in an
HTML comment on the line right above its opening fence, which GitHub does not render:

    <!-- readme-test: setup=tiny-llama nproc=2 sub=llama-8b-to-tiny -->

``setup`` names code the test runs before the block, ``nproc`` runs the block under ``cai run`` with that many
gloo processes, ``sub`` names a list of textual substitutions, ``check`` names the checker of a ``text`` block
(sample output, a file layout). The names are defined in ``test_readmes.py``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIP_DIRS = {"build", "dist", "node_modules", "site-packages", "__pycache__"}
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*readme-test:(.*?)-->\s*$")


@dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block: where it is, its language tag ("" when untagged), its text and its directive."""

    readme: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    directive: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.readme}:{self.line}"


def find_readmes(root: Path = ROOT) -> list[Path]:
    """Every README*.md below ``root``, sorted, skipping hidden folders (.git, .nox, .venv) and build output."""
    found = []
    for path in root.rglob("README*.md"):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in _SKIP_DIRS for p in parts):
            continue
        found.append(path)
    return sorted(found)


def parse_directive(text: str) -> dict[str, str]:
    """``key=value key=value`` into a dict; a word without ``=`` is an error (a typo must not pass silently)."""
    out = {}
    for word in text.split():
        key, eq, value = word.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"readme-test directive word {word!r} is not key=value")
        out[key] = value
    return out


def parse_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced blocks of one Markdown file, in order. An unclosed fence raises (it hides the rest)."""
    lines = path.read_text().splitlines()
    rel = path.relative_to(root).as_posix()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start = i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence)) and not lines[i].strip().strip(fence[0])
        ):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{rel}:{start + 1}: the fence {fence!r} is never closed")
        directive = {}
        if start > 0 and (d := _DIRECTIVE.match(lines[start - 1])):
            directive = parse_directive(d.group(1))
        blocks.append(
            Block(
                readme=rel,
                line=start + 1,
                lang=lang.lower(),
                text="\n".join(body) + "\n",
                directive=directive,
            )
        )
        i += 1
    return blocks


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for path in find_readmes(root) for b in parse_blocks(path, root)]


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block as argv lists: continuation lines joined, ``#`` comments dropped,
    ``a && b`` and ``a; b`` split into two commands. In a transcript (some lines start with a ``$ `` prompt) only the
    prompted lines are commands; the others are their output."""
    lines = [raw.strip() for raw in re.sub(r"\\\n", " ", text).splitlines()]
    if any(line.startswith("$ ") for line in lines):
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)  # `a&&b` and `a; b` split too
        lexer.whitespace_split = True
        words = list(lexer)
        current: list[str] = []
        for w in words:
            if w in ("&&", ";"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(w)
        if current:
            commands.append(current)
    return commands
