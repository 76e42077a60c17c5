"""The ``cai`` command: ``cai run`` (start training) and ``cai check`` (inspect this machine)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

from cai.mesh._cli_check import add_check_parser
from cai.mesh._cli_run import add_run_parser

__all__ = ["build_parser", "main"]

_BUILTIN = ("run", "check")


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's usage lists every option (30 lines for ``cai run``); a mistake gets one line instead."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(*, plugins: bool = True) -> argparse.ArgumentParser:
    """The ``cai`` parser; ``plugins=False`` leaves out the subcommands of other packages (see ``main``)."""
    parser = argparse.ArgumentParser(prog="cai", description="Launch and inspect cai training jobs.")
    sub = parser.add_subparsers(dest="command", metavar="{run,check}", parser_class=_SubcommandParser)
    sub.required = True
    add_run_parser(sub)
    add_check_parser(sub)
    if plugins:
        _add_plugin_parsers(sub)
    return parser


def _add_plugin_parsers(sub: argparse._SubParsersAction) -> None:
    """Subcommands other packages register under the entry-point group ``cai.cli`` (``name = "module:func"``,
    ``func(sub)`` adds the parser), so this package never imports them. One that fails to load is reported and
    skipped: a broken optional package must not take ``cai run`` down with it."""
    names = []
    for ep in sorted(md.entry_points(group="cai.cli"), key=lambda e: e.name):
        if ep.name in sub.choices:
            continue  # the same distribution seen twice on the path
        try:
            ep.load()(sub)
        except Exception as exc:  # any error importing an optional package
            print(f"cai: subcommand {ep.name!r} ({ep.value}) failed to load: {exc}", file=sys.stderr)
            continue
        names.append(ep.name)
    if names:
        sub.metavar = "{" + ",".join(["run", "check", *names]) + "}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cai`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # `cai run` and `cai check` are this package's own: loading the plugins would import their packages (cai-infer
    # imports transformers, seconds on a small machine) into a launcher that runs torchrun in this process, on every
    # node of a hostfile job. Any other command line (a plugin's command, --help, a mistake) lists them all.
    builtin = bool(argv) and argv[0] in _BUILTIN
    args = build_parser(plugins=not builtin).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
