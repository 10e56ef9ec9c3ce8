"""A Microstep error under ``python -m launch``: said once, by the launcher, as the last thing
on the screen, instead of one traceback per rank followed by torchrun's failure report.

The launcher names a directory in ``ERROR_REPORT_DIR``. Importing ``engine`` in a worker it
started installs a ``sys.excepthook`` that, for an uncaught ``MicrostepError`` (a mistake
Microstep found and explained: config, batch plan, checkpoint, ranks disagreeing), writes the
error's class and message into ``<dir>/rank<RANK>`` and prints nothing; the process still
exits with status 1. An uncaught ``KeyboardInterrupt`` (a Ctrl-C the launcher passed on, with no
``checkpoint.dir`` to save at the next boundary) prints nothing either: the launcher says in one
line that the workers stopped without saving. Any other exception is a bug and keeps its
traceback. Outside the launcher nothing is installed.
"""

from __future__ import annotations

import json
import os
import sys
import time

from engine.errors import MicrostepError

ERROR_REPORT_DIR = "MICROSTEP_ERROR_REPORT_DIR"


def report_path(directory: str, rank: str) -> str:
    return os.path.join(directory, f"rank{rank}")


def write_report(directory: str, error: MicrostepError) -> None:
    """This rank's report (written whole, then renamed: the launcher never reads half of one)."""
    rank = os.environ.get("RANK", "0")
    path = report_path(directory, rank)
    with open(path + ".partial", "w") as f:
        json.dump({"rank": int(rank), "error": type(error).__name__, "message": str(error), "time": time.time()}, f)
    os.replace(path + ".partial", path)


def install_from_environment() -> None:
    """Report uncaught Microstep errors to the launcher that asked for them (once per process)."""
    directory = os.environ.get(ERROR_REPORT_DIR)
    if not directory or getattr(sys.excepthook, "reports_to", None) == directory:
        return
    previous = sys.excepthook

    def report(kind, value, traceback):
        if isinstance(value, KeyboardInterrupt):
            return  # the launcher got the Ctrl-C and says what it did
        if isinstance(value, MicrostepError):
            try:
                write_report(directory, value)
                return
            except OSError:  # the launcher's directory is gone: say it here, as Python would
                pass
        previous(kind, value, traceback)

    report.reports_to = directory
    sys.excepthook = report
