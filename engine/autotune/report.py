"""Presenting an ``explore`` measurement: a table, a JSON file and a PNG plot."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from engine.autotune.tuner import Candidate
from engine.memory import format_bytes

log = logging.getLogger("engine")


def _by_tokens(rows: list[Candidate]) -> bool:
    return any(row.micro_batch_tokens is not None for row in rows)


def _value(row: Candidate) -> int:
    """What was measured: the token budget, or else the micro-batch size."""
    return row.micro_batch_size if row.micro_batch_tokens is None else row.micro_batch_tokens


def format_table(rows: list[Candidate]) -> str:
    header = (("tokens", "micro-steps") if _by_tokens(rows) else ("micro", "accum")) + (
        "samples/s", "vs smallest", "peak memory", "fits", "")
    lines = [header]
    for row in rows:
        lines.append((
            str(_value(row)), str(row.accumulation_steps),
            "-" if row.samples_per_second is None else f"{row.samples_per_second:,.1f}",
            "-" if row.relative_speed is None else f"{row.relative_speed:.2f}x",
            format_bytes(row.peak_memory_bytes), "yes" if row.fits else "out of memory",
            "<- recommended" if row.recommended else "",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i < 5 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)


def save_json(rows: list[Candidate], path: Path, **context) -> Path:
    payload = {**context, "candidates": [dataclasses.asdict(row) for row in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def save_plot(rows: list[Candidate], path: Path) -> Path | None:
    """Throughput and peak memory against the micro-batch size or token budget (None
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'microstep[plot]')")
        return None
    fitting = [row for row in rows if row.fits]
    figure, speed_axis = plt.subplots(figsize=(6.5, 4))
    sizes = [_value(row) for row in fitting]
    speed_axis.plot(sizes, [row.samples_per_second for row in fitting], "o-", color="tab:blue", label="samples/s")
    speed_axis.set_xscale("log", base=2)
    speed_axis.set_xlabel("micro_batch_tokens" if _by_tokens(rows) else "micro-batch size")
    speed_axis.set_ylabel("samples/s", color="tab:blue")
    memory_axis = speed_axis.twinx()
    memory_axis.plot(sizes, [row.peak_memory_bytes / 2**20 for row in fitting], "s--", color="tab:orange")
    memory_axis.set_ylabel("peak memory (MiB)", color="tab:orange")
    for row in rows:
        if row.recommended:
            speed_axis.axvline(_value(row), color="tab:green", linestyle=":", label="recommended")
        if not row.fits:
            speed_axis.axvline(_value(row), color="tab:red", linestyle=":", label="out of memory")
    speed_axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
