"""Training metrics and progress, one record per optimizer step.

The engine calls :meth:`Monitor.on_window_closed` (an ``engine.window.hooks.EngineHook`` point) on every rank after each closed window. Rank 0
turns it into a record (loss, learning rate, gradient norm, throughput, memory, ...), keeps
it in ``history``, shows progress, and writes JSON lines / CSV / TensorBoard / Weights & Biases
(``monitor.wandb``; a DeepSpeed config's ``tensorboard`` / ``csv_monitor`` / ``wandb`` sections
set these, ``engine.config.deepspeed_monitor``). Other ranks
only keep time: they read no tensor, so they pay no host sync.

Timing. A step is timed from the previous window's close (the first one from
:meth:`attach`, i.e. ``engine.initialize``). With ``log_every = k`` a record is made every
k-th step (and at ``total_steps``); its rates and ``step_time`` cover all steps since the
previous record, its loss and gradient norm are the recorded step's own.

Token budgets. With ``micro_batch_tokens`` a record carries the budget, the window's
micro-steps and its real and padded (computed) tokens over all ranks; ``micro_batch_size``
and ``accumulation_steps`` are null there, since each window forms its own micro-batches.

Learning rate. The report carries the learning rate the window's update used (parameter
group 0, read before the scheduler stepped).

Resuming. A monitor attached to an engine resumed at step K (``load_checkpoint``, or
``checkpoint.resume``) continues its JSON-lines and CSV files, first dropping their records of
steps after K: the resumed run makes them again (a run killed at step M > K would otherwise list
K+1..M twice).

Mixture of experts. For a model with routers (``engine.experts``) a record carries the window's
router load over every micro-batch and data rank: ``expert_load``, top-k assignments per expert
(every layer summed; padding excluded), and ``expert_imbalance``, max / mean load of the most
imbalanced layer (1 = even). TensorBoard gets ``train/expert_imbalance`` and
``expert_load/<expert>``; :func:`plot_expert_load` draws both from a JSON-lines file, and
``python -m engine plot metrics.jsonl`` (``engine.monitor.plot``) draws them next to the loss,
learning rate, gradient norm, tokens/s and MFU of any metrics file.

Use it through the config (``monitor: {enabled: true, jsonl: metrics.jsonl}``), or build one
yourself: ``eng.monitor = Monitor(MonitorConfig(enabled=True)).attach(eng)``.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Any, TextIO

import torch

from engine.config.schema import MonitorConfig
from engine.distributed.process_group import get_rank
from engine.monitor.throughput import device_peak_flops, flops_per_token, model_flops_utilisation
from engine.window.hooks import EngineHook

__all__ = ["Monitor", "FIELDS", "plot_expert_load"]

log = logging.getLogger("engine")

# Every train record has exactly these keys (None when not known), in this order (CSV).
FIELDS = (
    "step", "loss", "lr", "grad_norm", "samples", "tokens", "samples_per_s", "tokens_per_s",
    "tokens_per_s_per_device", "mfu", "step_time",
    "micro_batch_size", "accumulation_steps", "micro_steps", "micro_batch_tokens",
    "real_tokens", "padded_tokens", "peak_memory_mb", "skipped", "skipped_steps", "elapsed",
    "expert_load", "expert_imbalance",
)

TENSORBOARD_HINT = "pip install tensorboard"
WANDB_HINT = "pip install wandb"


class Monitor(EngineHook):
    """Per-step metrics and progress; see the module docstring.

    ``stream``: where progress goes (default: ``sys.stderr``, looked up at each write).
    ``clock``: a ``time.perf_counter``-like function (tests may replace it).
    """

    def __init__(self, config: MonitorConfig | dict | None = None, *, rank: int | None = None,
                 stream: TextIO | None = None, clock=time.perf_counter):
        if config is None:
            config = MonitorConfig(enabled=True)
        elif isinstance(config, dict):
            config = MonitorConfig(**config)
        self.config = config
        self.total_steps: int | None = config.total_steps
        self.history: list[dict[str, Any]] = []  # train records (rank 0)
        self.eval_history: list[dict[str, Any]] = []  # log_eval records (rank 0)
        self.rank = get_rank() if rank is None else rank
        self._stream = stream
        self._clock = clock
        self._start = self._last_record = clock()
        self._pending_samples = 0  # since the last record
        self._pending_items: torch.Tensor | float | None = None
        self._pending_steps = 0
        self._steps_seen = 0  # windows seen since attach (for the ETA)
        self._engine = None  # set by attach
        self._resumed = False
        self._resumed_at = 0  # the step a resume started from: later records are made again
        self._files: dict[str, Any] = {}
        self._csv_writer = None
        self._tensorboard = None
        self._tensorboard_tried = False
        self._wandb = None  # a wandb run (monitor.wandb), started at attach on rank 0
        self._devices = 1  # every process of the run: tokens/s per device divide by it
        self._flops_per_token: float | None = None  # 6 N (engine.monitor.throughput), None under a pipeline
        self._peak_flops: float | None = config.peak_flops
        self._peak_hint_given = False  # "set monitor.peak_flops" is said once
        self._wandb_tried = False
        self._line_open = False  # a \r progress line is on screen
        self._closed = False

    # -- wiring ----------------------------------------------------------------------------
    def attach(self, eng, *, restart_clock: bool = True) -> "Monitor":
        """Start the clock and learn the rank. ``engine.initialize`` calls this, and a loaded
        checkpoint (``on_state_loaded``); ``on_window_closed`` does it on first use otherwise (then the first step is timed from the monitor's
        creation). Attach on every rank: the engine's window statistics become a collective
        when a monitor is set."""
        self.rank = eng.rank
        self._engine = eng
        self._devices = eng.world_size
        if self.is_writer:
            # A pipeline stage holds part of the model: its parameters are not the model's N.
            self._flops_per_token = flops_per_token(eng.module) if eng.strategy.capabilities().holds_every_layer else None
            self._peak_flops = self.config.peak_flops or device_peak_flops(eng.device)
        self._resumed = eng.global_steps > 0
        if self._resumed:
            self._rewind(eng.global_steps)
        if restart_clock:
            self._steps_seen = 0
            self._start = self._last_record = self._clock()
        if self.is_writer:
            self._tensorboard_writer()  # create the log dir now, or warn now that it can't be
            self._wandb_run()
        return self

    def _rewind(self, step: int) -> None:
        """The engine resumed at ``step``: records of later steps belong to the run being repeated."""
        self._resumed_at = step
        self.history = [record for record in self.history if record["step"] <= step]
        self.eval_history = [record for record in self.eval_history if record["step"] <= step]
        for handle in self._files.values():  # reopened, without those records, at the next write
            handle.close()
        self._files.clear()
        self._csv_writer = None

    @property
    def is_writer(self) -> bool:
        """Rank 0 records, shows and writes; other ranks only keep time."""
        return self.rank == 0

    @property
    def wants_grad_norm(self) -> bool:
        """Whether the coming step should compute the gradient norm. Depends only on the
        config and the step count, so it is the same on every rank (the norm may be a
        collective)."""
        done = self._engine.global_steps if self._engine is not None else 0
        return self.needs_grad_norm(done + 1)

    def records(self, step: int) -> bool:
        """Whether optimizer step ``step`` gets a record (the same answer on every rank, so
        the engine gathers the window's statistics over all ranks only for those)."""
        return step % self.config.log_every == 0 or step == self.total_steps

    # -- the engine's hooks ----------------------------------------------------------------
    def needs_grad_norm(self, step: int) -> bool:
        return self.config.grad_norm and self.records(step)

    def on_state_loaded(self, engine) -> None:
        """Count steps (and time) from the resumed position."""
        self.attach(engine)

    def on_close(self, engine) -> None:
        self.close()

    def on_window_closed(self, eng, report) -> None:
        """Called by the engine after every closed window, on every rank."""
        if self._engine is None:
            self.attach(eng, restart_clock=False)
        now = self._clock()
        step = eng.global_steps
        self._steps_seen += 1
        if not self.is_writer:
            return
        self._pending_steps += 1
        self._pending_samples += report.samples
        if report.items is not None:
            self._pending_items = report.items if self._pending_items is None \
                else self._pending_items + report.items
        if not self.records(step):
            return
        record = self._make_record(eng, report, step, now)
        if record["tokens_per_s"] is not None and record["mfu"] is None:
            self._say_how_to_get_mfu(eng)
        self.history.append(record)
        self._write(record)
        self._show(record)

    def _make_record(self, eng, report, step: int, now: float) -> dict[str, Any]:
        interval = max(now - self._last_record, 1e-9)
        steps = max(self._pending_steps, 1)
        items = None if self._pending_items is None else float(self._pending_items)
        applied = bool(report.step.applied)
        grad_norm = report.step.grad_norm
        by_tokens = eng.plan.micro_batch_tokens is not None
        record = {
            "step": step,
            "loss": None if report.loss is None else float(report.loss),  # host sync
            "lr": report.lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "samples": report.samples,
            "tokens": None if report.items is None else int(round(float(report.items))),
            "samples_per_s": self._pending_samples / interval,
            "tokens_per_s": None if items is None else items / interval,
            "tokens_per_s_per_device": None if items is None else items / interval / self._devices,
            "mfu": (None if items is None or self._flops_per_token is None or self._peak_flops is None
                    else model_flops_utilisation(self._flops_per_token, items / interval / self._devices,
                                                 self._peak_flops)),
            "step_time": interval / steps,
            "micro_batch_size": None if by_tokens else eng.plan.train_micro_batch_size_per_gpu,
            "accumulation_steps": None if by_tokens else eng.plan.gradient_accumulation_steps,
            "micro_steps": report.micro_steps,
            "micro_batch_tokens": eng.plan.micro_batch_tokens,
            "real_tokens": report.real_tokens,
            "padded_tokens": report.padded_tokens,
            "peak_memory_mb": None if report.peak_memory_bytes is None else report.peak_memory_bytes / 2**20,
            "skipped": not applied,
            "skipped_steps": eng.skipped_steps,
            "elapsed": now - self._start,
            **_expert_fields(eng),
        }
        self._last_record = now
        self._pending_samples, self._pending_items, self._pending_steps = 0, None, 0
        return record

    def _say_how_to_get_mfu(self, eng) -> None:
        """Once: MFU is missing only for want of the device's peak."""
        if self._peak_hint_given or self._flops_per_token is None or self._peak_flops is not None:
            return
        self._peak_hint_given = True
        log.info("monitor: no MFU: the peak FLOP/s of this device (%s) is not known; set monitor.peak_flops to "
                 "one device's peak (e.g. --set monitor.peak_flops=1e12 for 1 TFLOP/s) to get it", eng.device.type)

    # -- other records -----------------------------------------------------------------------
    def log_eval(self, step: int, loss: float, **values: Any) -> None:
        """Record an evaluation (rank 0): ``eval_history``, the JSONL file (``"kind":
        "eval"``), TensorBoard ``eval/*`` and a progress line. Call it on every rank."""
        if not self.is_writer:
            return
        record = {"step": step, "eval_loss": float(loss), **values}
        self.eval_history.append(record)
        self._write_jsonl({"kind": "eval", **record})
        writer = self._tensorboard_writer()
        if writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(f"eval/{key.removeprefix('eval_')}", value, step)
            writer.flush()
        if self.config.progress:
            self._print_line(f"eval step {step} | loss {float(loss):.4f}")

    # -- output --------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self._write_jsonl({"kind": "train", **record})
        if self.config.csv:
            handle = self._open("csv", self.config.csv)
            if self._csv_writer is None:
                self._csv_writer = csv.DictWriter(handle, fieldnames=FIELDS)
                if handle.tell() == 0:
                    self._csv_writer.writeheader()
            self._csv_writer.writerow({k: "" if v is None else " ".join(map(str, v)) if isinstance(v, list) else v
                                       for k, v in record.items()})
            handle.flush()
        writer = self._tensorboard_writer()
        if writer is not None:
            for key in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "tokens_per_s_per_device",
                        "mfu", "step_time", "peak_memory_mb", "expert_imbalance"):
                if record[key] is not None:
                    writer.add_scalar(f"train/{key}", record[key], record["step"])
            for expert, load in enumerate(record["expert_load"] or ()):
                writer.add_scalar(f"expert_load/{expert}", load, record["step"])
            writer.flush()
        run = self._wandb_run()
        if run is not None:
            run.log({f"train/{key}": value for key, value in record.items()
                     if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)},
                    step=record["step"], commit=True)  # the step is whole: send it now

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self.config.jsonl:
            handle = self._open("jsonl", self.config.jsonl)
            handle.write(json.dumps(record, default=_jsonable) + "\n")
            handle.flush()

    def _open(self, kind: str, path: str):
        handle = self._files.get(kind)
        if handle is None:
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            # A resumed run (attached after load_checkpoint) continues its files.
            if self._resumed:
                _drop_records_after(path, kind, self._resumed_at)
            handle = self._files[kind] = open(path, "a" if self._resumed else "w",
                                              newline="" if kind == "csv" else None, encoding="utf-8")
        return handle

    def _tensorboard_writer(self):
        if not self.config.tensorboard or self._tensorboard_tried:
            return self._tensorboard
        self._tensorboard_tried = True
        try:
            import tensorboard  # noqa: F401  (torch's writer needs the package)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn(
                f"monitor.tensorboard is set ({self.config.tensorboard!r}) but the tensorboard "
                f"package is not installed: no TensorBoard logs are written ({TENSORBOARD_HINT} "
                "to get them). The other outputs are unaffected.", UserWarning, stacklevel=4)
            return None
        self._tensorboard = SummaryWriter(log_dir=self.config.tensorboard)
        return self._tensorboard

    def _wandb_run(self):
        """The wandb run ``monitor.wandb`` asks for (``wandb.init`` with its keywords; its
        ``WANDB_MODE`` / ``mode: offline`` work as usual), started once."""
        if not self.config.wandb or self._wandb_tried:
            return self._wandb
        self._wandb_tried = True
        try:
            import wandb
        except ImportError:
            warnings.warn(f"monitor.wandb is set ({self.config.wandb!r}) but the wandb package is not installed: "
                          f"nothing is sent to Weights & Biases ({WANDB_HINT} to get it). The other outputs are "
                          "unaffected.", UserWarning, stacklevel=4)
            return None
        self._wandb = wandb.init(**self.config.wandb)
        return self._wandb

    # -- progress ---------------------------------------------------------------------------
    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _show(self, record: dict[str, Any]) -> None:
        if not self.config.progress:
            return
        text = self.format_progress(record)
        if _isatty(self.stream):
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
            self._line_open = True
            if self.total_steps is not None and record["step"] >= self.total_steps:
                self._end_line()
        else:
            self._print_line(text)

    def _print_line(self, text: str) -> None:
        self._end_line()
        self.stream.write(text + "\n")
        self.stream.flush()

    def _end_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False

    def format_progress(self, record: dict[str, Any]) -> str:
        """One progress line: step[/total], loss, lr, throughput, step time, ETA."""
        step, total = record["step"], self.total_steps
        parts = []
        if total:
            done = min(step / total, 1.0)
            filled = int(done * 20)
            parts.append(f"[{'#' * filled}{'.' * (20 - filled)}] step {step}/{total}")
        else:
            parts.append(f"step {step}")
        if record["loss"] is not None:
            parts.append(f"loss {record['loss']:.4f}")
        parts.append(f"lr {record['lr']:.2e}" if record["lr"] is not None else "lr -")
        if record["grad_norm"] is not None:
            parts.append(f"gnorm {record['grad_norm']:.3g}")
        parts.append(f"{_si(record['samples_per_s'])} samples/s")
        if record["tokens_per_s"] is not None:
            parts.append(f"{_si(record['tokens_per_s'])} tok/s")
            if self._devices > 1:
                parts.append(f"{_si(record['tokens_per_s_per_device'])} tok/s/device")
        if record["mfu"] is not None:
            parts.append(f"MFU {record['mfu']:.1%}")
        if record["padded_tokens"]:
            parts.append(f"{record['micro_steps']} micro-steps, "
                         f"{1 - record['real_tokens'] / record['padded_tokens']:.0%} padding")
        parts.append(_step_time(record["step_time"]))
        if total and step < total:
            per_step = record["elapsed"] / max(self._steps_seen, 1)
            parts.append(f"ETA {_duration(per_step * (total - step))}")
        if record["skipped"]:
            parts.append("SKIPPED (overflow or no items)")
        return " | ".join(parts)

    # -- end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """End the progress line and close the files (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        if self._line_open:
            self._end_line()
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- helpers ------------------------------------------------------------------------------
def _expert_fields(eng) -> dict[str, Any]:
    """The window's router load (``engine.experts``), or None for a model without routers."""
    load = eng.experts.last_load
    if load is None:
        return {"expert_load": None, "expert_imbalance": None}
    return {"expert_load": [float(n) for n in load.per_expert()], "expert_imbalance": load.imbalance()}


def plot_expert_load(jsonl_path, out_path) -> str | None:
    """Per-expert load (stacked shares) and the imbalance against the step, from a monitor's JSON-lines
    file; returns the image's path (None without matplotlib or without expert records)."""
    with open(jsonl_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if r.get("kind") == "train" and r.get("expert_load")]
    if not records:
        log.warning("%s holds no expert_load record (a model without routers?): no plot", jsonl_path)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'microstep[plot]')")
        return None
    steps = [r["step"] for r in records]
    loads = torch.tensor([r["expert_load"] for r in records], dtype=torch.float64)
    shares = (loads / loads.sum(1, keepdim=True)).T.tolist()
    figure, (share_axis, imbalance_axis) = plt.subplots(2, 1, figsize=(6.5, 5), sharex=True)
    share_axis.stackplot(steps, shares, labels=[f"expert {i}" for i in range(len(shares))])
    share_axis.set_ylabel("share of top-k assignments")
    share_axis.legend(fontsize="small", ncol=4, loc="upper right")
    imbalance_axis.plot(steps, [r["expert_imbalance"] for r in records], "o-")
    imbalance_axis.set_ylabel("imbalance (max / mean)")
    imbalance_axis.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return str(out_path)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _si(value: float) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.1f}"


def _step_time(seconds: float) -> str:
    return f"{seconds:.2f} s/step" if seconds >= 1 else f"{seconds * 1e3:.0f} ms/step"


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


def _drop_records_after(path: str, kind: str, step: int) -> None:
    """Rewrite the metrics file ``path`` without its records of steps after ``step`` (and
    without a line a killed process left unfinished)."""
    if not os.path.isfile(path):
        return
    with open(path, newline="" if kind == "csv" else None, encoding="utf-8") as f:
        text = f.read()
    if kind == "jsonl":
        lines = text.splitlines(keepends=True)
        kept = [line for line in lines if (number := _jsonl_step(line)) is not None and number <= step]
        total, content = len(lines), "".join(kept)
    else:
        rows = list(csv.reader(io.StringIO(text)))
        if not rows or "step" not in rows[0]:
            return  # not a metrics file of ours: left as it is
        column = rows[0].index("step")
        kept = [row for row in rows[1:]
                if len(row) == len(rows[0]) and (number := _int(row[column])) is not None and number <= step]
        total, out = len(rows) - 1, io.StringIO()
        csv.writer(out).writerows([rows[0], *kept])
        content = out.getvalue()
    if len(kept) == total:
        return
    partial = f"{path}.tmp-{os.getpid()}"
    with open(partial, "w", newline="" if kind == "csv" else None, encoding="utf-8") as f:
        f.write(content)
    os.replace(partial, path)
    log.info("monitor: removed %d record(s) after step %d from %s: the resumed run makes them again",
             total - len(kept), step, path)


def _jsonl_step(line: str) -> int | None:
    if not line.endswith("\n"):
        return None  # cut short
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
