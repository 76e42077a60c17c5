"""A logger that knows its rank: ``get_dist_logger().info(msg, ranks=[0])`` logs on rank 0 only."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist

__all__ = ["DistributedLogger", "disable_existing_loggers", "get_dist_logger"]

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}
_FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s] %(filename)s:%(lineno)d %(funcName)s: %(message)s"


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    if level.upper() not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    return _LEVELS[level.upper()]


class _RankFilter(logging.Filter):
    """Gives records from plain child loggers (``logging.getLogger("cai.zero")``) the rank the format needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = _rank()
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (so redirection and capture work)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


class DistributedLogger:
    """A ``logging.Logger`` wrapper whose calls take ``ranks``: the global ranks that should emit the record.

    ``ranks=None`` logs on every rank. Records carry the rank and the caller's file, line and function. Use
    ``get_dist_logger(name)`` rather than the constructor: there is one instance per name.
    """

    _instances: dict[str, DistributedLogger] = {}

    def __init__(self, name: str) -> None:
        self.name = name
        self.logger = logging.getLogger(name)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self._console = _StderrHandler()
        self._console.setFormatter(logging.Formatter(_FORMAT))
        self._console.addFilter(_RankFilter())
        self.logger.addHandler(self._console)

    @classmethod
    def get_instance(cls, name: str) -> DistributedLogger:
        if name not in cls._instances:
            cls._instances[name] = cls(name)
        return cls._instances[name]

    def set_level(self, level: str | int) -> None:
        """Set the threshold: "DEBUG", "INFO", "WARNING" or "ERROR" (or a logging constant)."""
        self.logger.setLevel(_level(level))

    def log_to_file(
        self, path: str | os.PathLike, mode: str = "a", level: str | int = "INFO", suffix: str | None = None
    ) -> Path:
        """Also write this rank's records to ``path`` (a folder gets ``rank_<r>[_<suffix>].log``); returns the file."""
        path = Path(path)
        if path.suffix != ".log":
            path.mkdir(parents=True, exist_ok=True)
            path = path / (f"rank_{_rank()}" + (f"_{suffix}" if suffix else "") + ".log")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, mode=mode)
        handler.setLevel(_level(level))
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        self.logger.addHandler(handler)
        return path

    def _log(self, level: int, message: object, ranks: Iterable[int] | None) -> None:
        rank = _rank()
        if ranks is not None and rank not in set(ranks):
            return
        # stacklevel 3: the record names the caller of info()/warning(), not this helper.
        self.logger.log(level, message, extra={"rank": rank}, stacklevel=3)

    def debug(self, message: object, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.DEBUG, message, ranks)

    def info(self, message: object, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: object, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.WARNING, message, ranks)

    def error(self, message: object, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.ERROR, message, ranks)


def get_dist_logger(name: str = "cai") -> DistributedLogger:
    """The rank-aware logger called ``name`` (one per name per process).

    Example::

        logger = get_dist_logger()
        logger.info("starting", ranks=[0])      # only rank 0 prints
        logger.warning("slow step")             # every rank prints, tagged with its rank
    """
    return DistributedLogger.get_instance(name)


def disable_existing_loggers(include: Iterable[str] | None = None, exclude: Iterable[str] = ("cai",)) -> None:
    """Set loggers to WARNING: those in ``include`` (default: every existing one) except those in ``exclude``."""
    names = list(include) if include is not None else list(logging.root.manager.loggerDict)
    excluded = set(exclude)
    for name in names:
        if name not in excluded and not any(name.startswith(e + ".") for e in excluded):
            logging.getLogger(name).setLevel(logging.WARNING)
