"""``from colossalai.logging import get_dist_logger, disable_existing_loggers``.

``get_dist_logger(name)`` returns a logger whose ``info`` / ``warning`` / ``error`` /
``debug`` take Colossal-AI's ``ranks=[...]``: the message is logged on those ranks only
(every rank without it). It writes through Python's ``logging`` (the ``colossalai``
logger, or ``name``), to stderr unless the script configures handlers itself."""
from __future__ import annotations

import logging as _logging

from engine.distributed.process_group import get_rank

__all__ = ["get_dist_logger", "disable_existing_loggers", "DistributedLogger"]

_LEVELS = {"DEBUG": _logging.DEBUG, "INFO": _logging.INFO, "WARNING": _logging.WARNING, "ERROR": _logging.ERROR}


class DistributedLogger:
    """A logger that logs on the ranks it is told to."""

    def __init__(self, name: str):
        self.logger = _logging.getLogger(name)
        if not self.logger.handlers:
            handler = _logging.StreamHandler()
            handler.setFormatter(_logging.Formatter(f"{name} - %(levelname)s: %(message)s"))
            self.logger.addHandler(handler)
            self.logger.setLevel(_logging.INFO)
            self.logger.propagate = False

    def _log(self, level: int, message: str, ranks) -> None:
        if ranks is None or get_rank() in ranks:
            self.logger.log(level, message)

    def info(self, message: str, ranks=None) -> None:
        self._log(_logging.INFO, message, ranks)

    def warning(self, message: str, ranks=None) -> None:
        self._log(_logging.WARNING, message, ranks)

    def error(self, message: str, ranks=None) -> None:
        self._log(_logging.ERROR, message, ranks)

    def debug(self, message: str, ranks=None) -> None:
        self._log(_logging.DEBUG, message, ranks)

    def set_level(self, level: str) -> None:
        self.logger.setLevel(_LEVELS[level.upper()])

    def log_to_file(self, path: str, mode: str = "a", level: str = "INFO", suffix: str | None = None) -> None:
        """Also write to ``path`` (a file, or a directory holding ``rank_<r>.log``)."""
        import os

        if os.path.isdir(path):
            path = os.path.join(path, f"rank_{get_rank()}{'_' + suffix if suffix else ''}.log")
        handler = _logging.FileHandler(path, mode)
        handler.setLevel(_LEVELS[level.upper()])
        handler.setFormatter(_logging.Formatter("%(asctime)s %(name)s - %(levelname)s: %(message)s"))
        self.logger.addHandler(handler)


_LOGGERS: dict[str, DistributedLogger] = {}


def get_dist_logger(name: str = "colossalai") -> DistributedLogger:
    """The one logger named ``name`` (created on first use)."""
    if name not in _LOGGERS:
        _LOGGERS[name] = DistributedLogger(name)
    return _LOGGERS[name]


def disable_existing_loggers(include: list[str] | None = None, exclude: list[str] | None = None) -> None:
    """Quiet the loggers other libraries created (Colossal-AI's habit before training):
    each one named in ``include`` (default: all), except ``exclude`` and the ``colossalai`` /
    ``engine`` loggers, is set to WARNING."""
    keep = {"colossalai", "engine", *(exclude or [])}
    for name in list(_logging.root.manager.loggerDict):
        if name in keep or (include is not None and name not in include):
            continue
        _logging.getLogger(name).setLevel(_logging.WARNING)
