"""torchrun (``torch.distributed.run``'s entry point, as the ``torchrun`` command calls it),
without its failure report for workers that explained their own failure.

Workers started by ``python -m launch`` report an uncaught Microstep error into the directory
``MICROSTEP_ERROR_REPORT_DIR`` names (``engine.distributed.error_report``); the launcher prints it once,
last. torchrun would follow it with its agent's log lines and a ``ChildFailedError`` traceback
holding a failure table ("Root Cause ... error_file: <N/A> ... To enable traceback see ...").
Here: while some worker's report exists, the agent's warnings and errors are not logged; a
failure every failed worker explained exits 1 without a word; any other failure (a bug, a
crash, a signal) prints torchrun's failure table, without the agent's own stack.

A signal to torchrun itself (a Ctrl-C, a scheduler's SIGTERM, forwarded by ``python -m launch``):
the agent passes it to its workers and waits for them, as torchrun does, but neither logs that
nor ends with its ``SignalException`` traceback; it exits 128 + the signal's number, and the
launcher says in one last line what the workers did (saved and stopped, or stopped without saving).
"""

from __future__ import annotations

import logging
import os
import sys

import re

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

ERROR_REPORT_DIR = "MICROSTEP_ERROR_REPORT_DIR"  # engine.distributed.error_report's
# The agent's loggers that describe a worker's failure (and the SIGTERM sent to its peers).
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.agent.server.local_elastic_agent")
SIGTERM_EXIT = -15  # the peers torchrun stopped after the first failure


def reported_ranks(directory: str | None) -> set[int]:
    """The ranks whose workers wrote an error report."""
    if not directory or not os.path.isdir(directory):
        return set()
    return {int(name[len("rank"):]) for name in os.listdir(directory)
            if name.startswith("rank") and name[len("rank"):].isdigit()}


# The agent's lines about a signal it got and passes on ("Received 2 death signal, shutting down
# workers", "Sending process N closing signal SIGINT"): the launcher says what happened instead.
SIGNAL_LINES = re.compile(r"death signal|closing signal")


class _NotAboutSignals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not SIGNAL_LINES.search(record.getMessage())


class _WhileUnreported(logging.Filter):
    """Lets a record through until a worker has reported its error."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def filter(self, record: logging.LogRecord) -> bool:
        return not reported_ranks(self.directory)


def main(argv: list[str]) -> int:
    directory = os.environ.get(ERROR_REPORT_DIR)
    for name in AGENT_LOGGERS:
        logging.getLogger(name).addFilter(_NotAboutSignals())
        if directory:
            logging.getLogger(name).addFilter(_WhileUnreported(directory))
    try:
        torchrun_main(argv)
    except SignalException as signalled:  # its workers were given the signal and waited for
        return 128 + int(signalled.sigval)
    except ChildFailedError as failed:
        explained = reported_ranks(directory)
        unexplained = [rank for rank, failure in failed.failures.items()
                       if rank not in explained and failure.exitcode != SIGTERM_EXIT]
        if not explained or unexplained:
            print(failed, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
