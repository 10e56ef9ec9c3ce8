"""Plots of a monitor's metrics file (``python -m engine plot metrics.jsonl``).

:func:`read_metrics` reads either file the monitor writes, JSON lines (``monitor.jsonl``: train
and eval records) or CSV (``monitor.csv``: train records), into train and eval records keyed as
``engine.monitor.FIELDS``. :func:`plot_metrics` draws, against the (whole) optimizer step: the
loss (and the eval loss where logged), the learning rate, the gradient norm, tokens/s (samples/s
where the run counted no tokens), MFU, and for a mixture of experts the experts' shares of the
top-k assignments and the imbalance. One image with every panel, or one image per panel.
A panel whose values the run did not record (MFU without a known peak, say) says so in place.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from engine.errors import MicrostepError

__all__ = ["PlotError", "read_metrics", "plot_metrics", "draw_figure", "PANELS"]

INSTALL_HINT = "pip install 'microstep[plot]'"
# Panel name -> title (the per-panel images are named <out stem>_<name><suffix>).
PANELS = {
    "loss": "loss", "lr": "learning rate", "grad_norm": "gradient norm", "throughput": "tokens/s",
    "mfu": "MFU", "expert_load": "experts' share of top-k assignments", "expert_imbalance": "expert imbalance",
}
LEGEND_ENTRIES = 16  # more experts than this: no legend (the stack is in expert order)


class PlotError(MicrostepError, ValueError):
    """The metrics file cannot be plotted: missing, unreadable, not a monitor's, or without a train record."""


# -- reading ----------------------------------------------------------------------------------
def read_metrics(path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train records, eval records)`` of a monitor's JSON-lines or CSV file."""
    path = str(path)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file (the monitor writes it where monitor.jsonl or monitor.csv "
                        "says)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlotError(f"{path}: cannot be read: {error}") from None
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first:
        raise PlotError(f"{path}: is empty: the monitor writes one record per logged optimizer step (monitor."
                        "log_every), and this run has logged none yet")
    if first.lstrip().startswith("{"):
        train, evals = _read_jsonl(path, text)
    elif "step" in next(csv.reader([first]), []):
        train, evals = _read_csv(text), []
    else:
        raise PlotError(f"{path}: not a monitor metrics file (JSON lines from monitor.jsonl, or CSV from "
                        "monitor.csv with a step column)")
    if not train:
        raise PlotError(f"{path}: holds no train record (the monitor writes one per logged optimizer step)")
    return train, evals


def _read_jsonl(path: str, text: str):
    train, evals = [], []
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines) and not line.endswith("\n"):
                continue  # a killed process's last line, cut short
            raise PlotError(f"{path}:{number}: not a JSON record") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise PlotError(f"{path}:{number}: not a monitor record (no integer step)")
        (evals if record.get("kind") == "eval" else train).append(record)
    return train, evals


def _read_csv(text: str) -> list[dict[str, Any]]:
    records = []
    for row in csv.DictReader(text.splitlines()):
        if None in row or any(value is None for value in row.values()):
            continue  # a row cut short
        step = _number(row.get("step"))
        if step is None:
            continue
        record = {key: _number(value) for key, value in row.items()}
        record["step"] = int(step)
        load = row.get("expert_load") or ""
        record["expert_load"] = [float(n) for n in load.split()] if load.strip() else None
        records.append(record)
    return records


def _number(text):
    if text is None or text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text)
    except ValueError:
        return text


# -- drawing ----------------------------------------------------------------------------------
def plot_metrics(metrics_path, out_path, *, per_panel: bool = False) -> list[str]:
    """Draw the panels of ``metrics_path`` into ``out_path`` (one image), or with ``per_panel``
    into ``<stem>_<panel><suffix>`` next to it, one image per panel. Returns the written paths."""
    train, evals = read_metrics(metrics_path)
    plt = _pyplot()
    out = Path(out_path)
    if not per_panel:
        return [_save(draw_figure(train, evals, title=os.path.basename(str(metrics_path))), out, plt)]
    written = []
    for name in _panels(train):
        figure, axis = plt.subplots(figsize=(6.5, 3.2), layout="constrained")
        _draw(name, axis, train, evals)
        written.append(_save(figure, out.with_name(f"{out.stem}_{name}{out.suffix or '.png'}"), plt))
    return written


def draw_figure(train, evals, title: str | None = None):
    """The one-image figure of records (``read_metrics``'s pair), unsaved: two panels a row."""
    plt = _pyplot()
    panels = _panels(train)
    rows = (len(panels) + 1) // 2
    figure, axes = plt.subplots(rows, 2, figsize=(11, 2.9 * rows), layout="constrained", squeeze=False)
    for name, axis in zip(panels, axes.flat):
        _draw(name, axis, train, evals)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    return figure


def _panels(train) -> list[str]:
    """Every panel; the experts' two only for a file with expert load."""
    with_experts = any(record.get("expert_load") for record in train)
    return [name for name in PANELS if with_experts or not name.startswith("expert")]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(f"matplotlib is not installed: no plot ({INSTALL_HINT})") from None
    return plt


def _save(figure, path: Path, plt) -> str:
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise PlotError(f"{path}: cannot be written: {error}") from None
    finally:
        plt.close(figure)
    return str(path)


def _series(records, key, scale=1.0):
    pairs = [(r["step"], r[key] * scale) for r in records
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _draw(name: str, axis, train, evals) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    title, ylabel = PANELS[name], None
    marker = "o-" if len(train) <= 40 else "-"
    first, last = min(r["step"] for r in train), max(r["step"] for r in train)
    if name == "loss":
        steps, values = _series(train, "loss")
        axis.plot(steps, values, marker, markersize=3, label="train")
        eval_steps, eval_values = _series(evals, "eval_loss")
        if eval_steps:
            axis.plot(eval_steps, eval_values, "s--", markersize=4, label="eval")
            _legend_outside(axis)
    elif name in ("lr", "grad_norm"):
        steps, values = _series(train, name)
        axis.plot(steps, values, marker, markersize=3)
        if name == "lr":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    elif name == "throughput":
        steps, values = _series(train, "tokens_per_s")
        if not steps:
            title = "samples/s (the run counted no tokens)"
            steps, values = _series(train, "samples_per_s")
        axis.plot(steps, values, marker, markersize=3)
    elif name == "mfu":
        steps, values = _series(train, "mfu", 100.0)
        axis.plot(steps, values, marker, markersize=3)
        axis.yaxis.set_major_formatter(PercentFormatter())
        if not steps:
            axis.set_xlim(first, max(last, first + 1))  # the other panels' steps
            _not_recorded(axis, "no MFU recorded: it needs token counts and the device's peak\n"
                                "(set monitor.peak_flops on a CPU or an unlisted GPU)")
    elif name == "expert_load":
        records = [r for r in train if r.get("expert_load")]
        steps = [r["step"] for r in records]
        experts = max(len(r["expert_load"]) for r in records)
        shares = []
        for expert in range(experts):
            shares.append([r["expert_load"][expert] / (sum(r["expert_load"]) or 1)
                           if expert < len(r["expert_load"]) else 0.0 for r in records])
        axis.stackplot(steps, shares, labels=[f"expert {i}" for i in range(experts)])
        axis.set_ylim(0, 1)
        axis.yaxis.set_major_formatter(PercentFormatter(1.0))
        if experts <= LEGEND_ENTRIES:
            _legend_outside(axis, ncol=1 if experts <= 8 else 2)
        else:
            title += f" ({experts} experts, 0 at the bottom)"
    elif name == "expert_imbalance":
        steps, values = _series(train, "expert_imbalance")
        axis.plot(steps, values, marker, markersize=3)
        ylabel = "max / mean (1 = even)"
    axis.set_title(title, fontsize="medium")
    if ylabel:
        axis.set_ylabel(ylabel)
    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    if not axis.texts and not axis.collections and not any(len(line.get_xdata()) for line in axis.get_lines()):
        axis.set_xlim(first, max(last, first + 1))
        _not_recorded(axis, "not recorded in this file")


def _legend_outside(axis, ncol: int = 1) -> None:
    """The legend right of the axes (the constrained layout makes room), never over the data."""
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small", ncol=ncol)


def _not_recorded(axis, text: str) -> None:
    axis.text(0.5, 0.5, text, transform=axis.transAxes, ha="center", va="center", fontsize="small",
              color="0.35", wrap=True)
    axis.set_yticks([])
