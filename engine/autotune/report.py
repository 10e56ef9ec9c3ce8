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


def _with_checkpointing(rows: list[Candidate]) -> bool:
    """Whether checkpointing was a lever (``activation_checkpointing: auto``): a series each."""
    return any(row.checkpointing is not None for row in rows)


def format_table(rows: list[Candidate]) -> str:
    lever = _with_checkpointing(rows)
    header = (("tokens",) if _by_tokens(rows) else ("micro",)) + (("checkpointing",) if lever else ()) + (
        ("micro-steps",) if _by_tokens(rows) else ("accum",)) + ("samples/s", "vs smallest", "peak memory", "fits", "")
    lines = [header]
    for row in rows:
        lines.append((
            str(_value(row)), *(("on" if row.checkpointing else "off",) if lever else ()), str(row.accumulation_steps),
            "-" if row.samples_per_second is None else f"{row.samples_per_second:,.1f}",
            "-" if row.relative_speed is None else f"{row.relative_speed:.2f}x",
            format_bytes(row.peak_memory_bytes), "yes" if row.fits else "out of memory",
            "<- recommended" if row.recommended else "",
        ))
    numbers = len(header) - 2  # the last two columns are words
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i < numbers else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)


def save_json(rows: list[Candidate], path: Path, **context) -> Path:
    payload = {**context, "candidates": [dataclasses.asdict(row) for row in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def save_plot(rows: list[Candidate], path: Path) -> Path | None:
    """Throughput and peak memory against the micro-batch size or token budget, one series
    each with checkpointing off and on when it was a lever (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'microstep[plot]')")
        return None
    figure, speed_axis = plt.subplots(figsize=(6.5, 4))
    memory_axis = speed_axis.twinx()
    lever = _with_checkpointing(rows)
    for checkpointing, marker in ((None, "o"), (False, "o"), (True, "^")):
        fitting = [row for row in rows if row.fits and row.checkpointing is checkpointing]
        if not fitting:
            continue
        sizes = [_value(row) for row in fitting]
        suffix = f", checkpointing {'on' if checkpointing else 'off'}" if lever else ""
        style = "--" if checkpointing else "-"
        speed_axis.plot(sizes, [row.samples_per_second for row in fitting], marker + style, color="tab:blue",
                        label="samples/s" + suffix)
        memory_axis.plot(sizes, [row.peak_memory_bytes / 2**20 for row in fitting], marker + ":", color="tab:orange",
                         fillstyle="none" if checkpointing else "full", label="peak memory" + suffix)
    speed_axis.set_xscale("log", base=2)
    speed_axis.set_xlabel("micro_batch_tokens" if _by_tokens(rows) else "micro-batch size")
    speed_axis.set_ylabel("samples/s", color="tab:blue")
    memory_axis.set_ylabel("peak memory (MiB)", color="tab:orange")
    for row in rows:
        if row.recommended:
            speed_axis.axvline(_value(row), color="tab:green", linestyle=":", label="recommended")
        if not row.fits:
            speed_axis.axvline(_value(row), color="tab:red", linestyle=":",
                               label="out of memory" + (f" (checkpointing {'on' if row.checkpointing else 'off'})"
                                                        if lever else ""))
    speed_handles, speed_labels = speed_axis.get_legend_handles_labels()
    memory_handles, memory_labels = memory_axis.get_legend_handles_labels()
    speed_axis.legend(speed_handles + memory_handles, speed_labels + memory_labels, loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
