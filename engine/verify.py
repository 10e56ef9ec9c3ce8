"""``verify``: a config on N CPU processes against one process on the whole global batch.

``python -m engine verify CONFIG --model MOD:FN --batch MOD:FN --loss MOD:FN --nproc N`` (or
``engine.verify(...)``) trains the user's own model for a few steps twice:

* N processes (gloo, CPU), each running ``eng.train_batch`` on its data rank's share of every
  global batch, with the config's mesh, ZeRO stage, accumulation and optimizer as written;
* one process (this one), plain PyTorch: the whole global batch, one ``backward``, clipping,
  the config's optimizer and scheduler: the update the promise says the N processes make.

It then compares every tensor of the model, relative to how far the one-process run moved it,
and ends with ``equal: ...`` or ``not equal: ...`` naming the worst tensor, the tolerance and
why. What cannot be equal by construction is changed the same way on both sides, and said:
dropout is switched off (the N processes draw other masks), BatchNorm normalises with its
running statistics (a micro-batch's own statistics are not the global batch's), half
precision is off (compared in ``dtype``). When they differ and the loss returns a scalar, the
loss is tested for being a mean over samples, the classic per-micro-batch token mean over
padded rows, and the fix is named: return ``(loss_sum, num_tokens)``.

The processes are started with ``subprocess`` (``python -c``), join a process group on a store
this process hosts (no port to race for), and load the model, batch and loss functions by
reference; every collective is bounded by ``timeout_seconds`` and so is the whole run.
"""
from __future__ import annotations

import datetime
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engine.batching.mesh_plan import plan_for_mesh
from engine.batching.microbatch import batch_size, map_tensors, split_batch
from engine.build import initialize
from engine.config.schema import load_config, torch_sections
from engine.config.setup import mesh_layout
from engine.distributed.process_group import init_distributed
from engine.accounting import loss_and_units, mean_items
from engine.window.model_loss import model_loss
from engine.errors import MicrostepError
from engine.config.factories import FactoryError, load_factory, reference_of
from engine.config.optim import build_optimizer, build_scheduler

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# The tolerance is relative to each tensor's update over the steps (L2 norms; see
# ParameterDifference), and chosen by how the model rounds: the N processes run the same rows
# in smaller batches, and a model whose outputs for a row do not depend on the rows beside it
# to the last bits (float64 throughout) leaves ~1e-12 of the update; one that computes parts
# in float32 (Llama's RMSNorm, a mask built in float32) leaves ~1e-7 per row, which Adam
# amplifies where a gradient is near its eps: measured 2e-5 on examples/verify_llama.py.
# A weighting mistake moves the update by 1e-2 or more (the classic token mean: ~5e-1).
EXACT_ROUNDING = 1e-12  # measure_rounding at most this: the model computes in float64 throughout
TOLERANCE_EXACT = 1e-6
TOLERANCE_ROUNDED = {torch.float64: 1e-3, torch.float32: 1e-2}
DROPOUT_LAYERS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                  torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
BATCH_STATISTICS_LAYERS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
RANK_ENTRY = "import sys; from engine.verify import run_rank; sys.exit(run_rank(sys.argv[1], int(sys.argv[2])))"
POLL_SECONDS = 0.2
STARTED_BY_VERIFY = "MICROSTEP_VERIFY_RANK"  # set in the processes verify starts
LOG_TAIL_LINES = 30


class VerifyError(MicrostepError, RuntimeError):
    """verify could not compare: a process failed or timed out, or the functions it was given
    do not fit together."""


@dataclass(frozen=True)
class ParameterDifference:
    """One tensor of the model: ``difference`` = ‖N processes − one process‖₂ after the steps,
    ``update`` = ‖one process after − before‖₂, ``relative`` = difference / update (0 when both
    are 0, inf when only the difference is not)."""
    name: str
    relative: float
    difference: float
    update: float


@dataclass
class VerifyResult:
    equal: bool
    differences: list[ParameterDifference]  # worst first
    tolerance: float
    verdict: str  # the last line printed: "equal: ..." or "not equal: ..."
    notes: list[str] = field(default_factory=list)  # what was changed on both sides, and why
    losses: list[float] = field(default_factory=list)  # the one process's loss at each step
    parallel_losses: list[float] = field(default_factory=list)  # the N processes' (rank 0's train_batch)


@dataclass(frozen=True)
class _Job:
    """What every started process needs, pickled into the run's folder."""
    config: object  # a path, a dict or an engine.Config: loaded as given, with overrides
    overrides: list
    model: str
    batch: str
    loss: str
    steps: int
    dtype: str
    timeout_seconds: float
    state_path: str
    progress_path: str


# -- the model as both sides train it ----------------------------------------------------------
def _stay_in_eval(module, mode: bool = True):
    """``train`` of a BatchNorm layer pinned to its running statistics: a no-op."""
    return module


def prepare_model(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, list[str]]:
    """``model`` in ``dtype`` with dropout off and BatchNorm on running statistics (both sides do
    the same); returns the notes saying what was changed and why."""
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"--model must return a torch.nn.Module; it returned {type(model).__name__}")
    model = model.to(dtype)
    dropped, pinned = [], []
    for name, module in model.named_modules():
        if isinstance(module, DROPOUT_LAYERS) and module.p > 0:
            module.p = 0.0
            dropped.append(name)
        elif isinstance(module, BATCH_STATISTICS_LAYERS):
            module.eval()
            module.train = _stay_in_eval.__get__(module)
            pinned.append(name)
        for attribute, value in list(vars(module).items()):
            # attention dropout held as a number (Hugging Face: self.attention_dropout, used in F.dropout)
            if "dropout" in attribute.lower() and isinstance(value, float) and value > 0:
                setattr(module, attribute, 0.0)
                dropped.append(f"{name}.{attribute}" if name else attribute)
    notes = []
    if dropped:
        notes.append(f"dropout switched off in both runs ({_some(dropped)}): the N processes draw different "
                     "random masks than one process does, so no engine can make the steps equal with it on; "
                     "everything else is compared as configured")
    if pinned:
        notes.append(f"BatchNorm normalises with its running statistics in both runs ({_some(pinned)}): in "
                     "training mode each micro-batch is normalised by its own mean and variance, not the "
                     "global batch's, so the step differs from a full-batch step by construction (not a "
                     "weighting error); its weights and everything else are compared as configured")
    return model, notes


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _in_dtype(batch, dtype: torch.dtype):
    return map_tensors(batch, lambda path, t: t.to(dtype) if t.is_floating_point() else t)


def _loss_value(output, rows: int) -> tuple[torch.Tensor, bool]:
    """(the loss to differentiate, was it a (sum, count) pair)."""
    loss, units, item_weighted = loss_and_units(output, rows)
    if item_weighted:
        return loss / torch.as_tensor(units, dtype=loss.dtype), True
    return loss, False


# -- the N processes ----------------------------------------------------------------------------
def run_rank(job_path: str, rank: int) -> int:
    """One of the N processes (started by :func:`verify` with its environment set). A failure
    exits at once, without the process group's goodbye barrier, so that :func:`verify` sees
    this rank fail first and reports its error rather than its peers' waiting for it."""
    try:
        return _train_on_rank(job_path, rank)
    except BaseException as error:
        failed_at = time.time()
        if isinstance(error, MicrostepError):  # explained: its message is the cause, no traceback
            _explanation(Path(job_path).parent, rank).write_text(str(error))
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        _failure_mark(Path(job_path).parent, rank).write_text(repr(failed_at))
        os._exit(1)


def _explanation(folder: Path, rank: int) -> Path:
    """The message of a Microstep error ``rank`` stopped with (the engine's own explanation)."""
    return folder / f"rank{rank}.error"


def _failure_mark(folder: Path, rank: int) -> Path:
    """When ``rank`` failed: its peers usually fail right after it (their connection to it is
    gone), sometimes before the parent looks; the earliest mark names the rank that says why."""
    return folder / f"rank{rank}.failed"


def _train_on_rank(job_path: str, rank: int) -> int:
    with open(job_path, "rb") as file:
        job: _Job = pickle.load(file)
    dtype = DTYPES[job.dtype]
    init_distributed(job.timeout_seconds, "gloo", agreement_timeout_seconds=job.timeout_seconds)
    model, _ = prepare_model(load_factory(job.model)(), dtype)
    make_batch, loss_fn = load_factory(job.batch), load_factory(job.loss)
    eng = initialize(model, job.config, overrides=job.overrides)
    for step in range(job.steps):
        share = split_batch(_in_dtype(make_batch(step), dtype), eng.plan.per_device_batch_sizes)[eng.plan.rank]
        loss = eng.train_batch(share, loss_fn)
        if rank == 0:
            with open(job.progress_path, "a") as progress:
                progress.write(f"{step} {loss!r}\n")
    state = eng.full_state_dict()
    if rank == 0:
        torch.save(state, job.state_path + ".part")
        os.replace(job.state_path + ".part", job.state_path)
    eng.close()
    return 0


def _rank_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")
    environ = {name: value for name, value in os.environ.items()
               if name not in launcher_vars and not name.startswith("SLURM_")}
    environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                   TORCHELASTIC_USE_AGENT_STORE="True",  # join the store this process hosts
                   **{STARTED_BY_VERIFY: str(rank)},
                   CUDA_VISIBLE_DEVICES="")  # CPU processes, whatever the machine has
    environ.setdefault("OMP_NUM_THREADS", "1")
    cwd = os.getcwd()  # the references name modules the way this process imports them
    environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, [environ.get("PYTHONPATH")])])
    return environ


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _run_processes(job: _Job, job_path: Path, nproc: int, folder: Path, echo) -> list[float]:
    """Start the N processes, print rank 0's progress, return its losses (or raise VerifyError)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=job.timeout_seconds))
    processes, logs = [], []
    try:
        for rank in range(nproc):
            logs.append(folder / f"rank{rank}.log")
            with open(logs[-1], "w") as log:
                processes.append(subprocess.Popen(
                    [sys.executable, "-c", RANK_ENTRY, str(job_path), str(rank)], env=_rank_environment(rank, nproc, store.port),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        deadline, shown, losses = time.monotonic() + job.timeout_seconds, 0, []
        while True:
            progress = Path(job.progress_path)
            lines = progress.read_text().splitlines() if progress.exists() else []
            for line in lines[shown:]:
                step, loss = line.split()
                losses.append(float(loss))
                echo(f"{nproc} processes: step {int(step) + 1}/{job.steps} loss {float(loss):.6g}")
            shown = len(lines)
            codes = [process.poll() for process in processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                time.sleep(1.0)  # let the others fail too: the earliest failure says why
                codes = [process.poll() for process in processes]
                failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
                marks = {rank: _failure_mark(folder, rank) for rank in failed}
                rank = min(failed, key=lambda r: float(marks[r].read_text()) if marks[r].exists() else math.inf)
                explained = _explanation(folder, rank)
                if explained.exists():  # the engine said why: that, not a traceback
                    raise VerifyError(f"rank {rank} of the {nproc} processes stopped: {explained.read_text()}")
                raise VerifyError(f"rank {rank} of the {nproc} processes failed (exit code {codes[rank]}); the "
                                  f"end of its output:\n{_tail(logs[rank])}")
            if all(code == 0 for code in codes):
                return losses
            if time.monotonic() > deadline:
                waiting = [rank for rank, code in enumerate(codes) if code is None]
                raise VerifyError(
                    f"the {nproc} processes did not finish within {job.timeout_seconds:g} s (timeout): ranks "
                    f"{waiting} still running after {len(losses)} of {job.steps} steps; the end of rank "
                    f"{waiting[0]}'s output:\n{_tail(logs[waiting[0]])}")
            time.sleep(POLL_SECONDS)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()


# -- the one process ----------------------------------------------------------------------------
def _reference(config, make_model, make_batch, loss_fn, steps: int, dtype, echo):
    """Plain PyTorch on the whole global batch: (state before, state after, losses, notes, pair?, the loss
    type of the model's own .loss when that is what ``loss_fn`` returned and the engine reads it)."""
    model, notes = prepare_model(make_model(), dtype)
    again = make_model().to(dtype).state_dict()
    before = {name: value.detach().clone() for name, value in model.state_dict().items()}
    for name, value in before.items():
        if name in again and not torch.equal(value, again[name]):
            raise FactoryError(
                f"--model returned different values for {name} at two calls: verify builds the model in every "
                "process and needs the same one each time; seed it inside the function (torch.manual_seed(0) "
                "before building it)")
    optimizer = build_optimizer(config.optimizer, model.parameters())
    scheduler = build_scheduler(config.scheduler, optimizer) if config.scheduler is not None else None
    read = _ReadingModel(model)  # its own .loss read as the engine reads it: a (sum, count) pair
    losses, pair, own_loss_type = [], False, None
    for step in range(steps):
        batch = _in_dtype(make_batch(step), dtype)
        optimizer.zero_grad()
        output = loss_fn(read, batch)
        own_loss_type = read.loss_type if mean_items(output) is not None else None
        loss, pair = _loss_value(output, batch_size(batch))
        loss.backward()
        if config.gradient_clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        echo(f"one process: step {step + 1}/{steps} loss {losses[-1]:.6g}")
    after = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return before, after, losses, notes, pair, own_loss_type


def _micro_sizes(plan, rows: int) -> list[int]:
    """The global batch in micro-batches of the plan's size (its exact split in strict plans)."""
    micro = plan.train_micro_batch_size_per_gpu
    micro = micro if isinstance(micro, int) and micro < rows else max(1, rows // 2)
    return [min(micro, rows - start) for start in range(0, rows, micro)]


def _output_rows(output, rows: int) -> list[torch.Tensor]:
    """The tensors of a model output (a tensor, tuple or Hugging Face output) with one row per sample."""
    leaves = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return [leaf.detach() for leaf in leaves
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() and leaf.shape[0] == rows]


def measure_rounding(plan, make_model, make_batch, loss_fn, dtype) -> float | None:
    """How far the model's arithmetic is from ``dtype`` throughout, as a relative difference: the
    larger of (a) its outputs for the same rows in the whole global batch and in micro-batches
    and (b) its gradient for the loss and for 3 × the loss, divided by 3. Both are ~1e-16 for
    float64 throughout and ~1e-8 when a layer computes in float32 (a cast inside rounds a
    gradient's bits differently at another scale). None when the outputs cannot be matched row
    by row."""
    model, _ = prepare_model(make_model(), dtype)
    batch = _in_dtype(make_batch(0), dtype)
    rows = batch_size(batch)
    sizes = _micro_sizes(plan, rows)
    outputs = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        with torch.no_grad():
            for piece in split_batch(batch, sizes):
                loss_fn(model, piece)
        pieces = outputs[:]
        outputs.clear()
        loss = _loss_value(loss_fn(model, batch), rows)[0]
    finally:
        handle.remove()
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    once = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True)
    thrice = torch.autograd.grad(loss * 3, parameters, allow_unused=True)
    worst = max((((b / 3 - a).norm() / a.norm()).item() for a, b in zip(once, thrice)
                 if a is not None and a.norm() > 0), default=0.0)
    if len(outputs) != 1 or len(pieces) != len(sizes):
        return None
    expected = _output_rows(outputs[0], rows)
    pieces = [_output_rows(output, n) for output, n in zip(pieces, sizes)]
    if not expected or any(len(piece) != len(expected) for piece in pieces):
        return None
    for index, tensor in enumerate(expected):
        joined = torch.cat([piece[index] for piece in pieces])
        if joined.shape != tensor.shape:
            return None
        scale = tensor.abs().max().item() or 1.0
        worst = max(worst, (joined - tensor).abs().max().item() / scale)
    return worst


def choose_tolerance(rounding: float | None, dtype) -> tuple[float, str]:
    """(tolerance, why) for a model that rounds ``rounding`` (measure_rounding)."""
    mistake = "a weighting mistake moves it by 1e-2 or more"
    if rounding is not None and rounding <= EXACT_ROUNDING:
        return TOLERANCE_EXACT, (f"the model computes in {str(dtype).removeprefix('torch.')} throughout (outputs "
                                 f"and gradients agree to {rounding:.1e} however the rows are batched or the loss "
                                 f"scaled), so only the order of sums differs; {mistake}")
    tolerance = TOLERANCE_ROUNDED[dtype]
    if rounding is None:
        return tolerance, ("the model's outputs could not be matched row by row to measure its rounding, so the "
                           f"tolerance allows float32 rounding amplified by the optimizer; {mistake}")
    return tolerance, (f"the model rounds to {rounding:.1e} (its outputs or gradients change that much when the "
                       "rows are batched differently or the loss is scaled: it computes parts in float32, as "
                       "Llama's RMSNorm does), which Adam-like optimizers amplify where a gradient is near their "
                       f"eps; {mistake}")


def mean_over_samples_check(plan, make_model, make_batch, loss_fn, dtype, tolerance: float) -> str | None:
    """None when the gradient of ``loss_fn`` on the global batch equals the sample-weighted mean of
    its gradients on the plan's micro-batches (what the engine applies to a loss that returns a
    mean), within ``tolerance``; else the hint saying it is not a mean over samples."""
    model, _ = prepare_model(make_model(), dtype)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    batch = _in_dtype(make_batch(0), dtype)
    rows = batch_size(batch)
    sizes = _micro_sizes(plan, rows)
    read = _ReadingModel(model)  # the model's own .loss weighted by its items, as the engine reads it

    def summed_gradient(piece, samples) -> tuple[torch.Tensor, float]:
        """(the gradient of the piece's sum, its count): a (sum, count) pair's own, a mean's × its rows."""
        loss, units, item_weighted = loss_and_units(loss_fn(read, piece), samples)
        count = float(units) if item_weighted else float(samples)
        grads = torch.autograd.grad(loss if item_weighted else loss * samples, parameters, allow_unused=True)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, parameters)])
        return flat, count

    total, count = summed_gradient(batch, rows)
    whole = total / count
    pieces = [summed_gradient(piece, n) for piece, n in zip(split_batch(batch, sizes), sizes)]
    weighted = sum(g for g, _ in pieces) / sum(n for _, n in pieces)
    relative = ((whole - weighted).norm() / whole.norm()).item()
    if relative <= tolerance:
        return None
    return (f"loss_fn is not a mean over its micro-batch's samples: on step 0's global batch its gradient differs "
            f"by {relative:.2e} (relative) from the sample-weighted mean of its gradients on micro-batches of "
            f"{sizes[0]} rows. Typically it is a mean over tokens while rows hold different numbers of real "
            "tokens (padding labelled -100), so micro-batches with fewer tokens count too much. Return "
            "(loss_sum, num_tokens) instead, e.g. F.cross_entropy(..., ignore_index=-100, reduction='sum') and "
            "(labels != -100).sum(): the engine then divides by the global batch's token count")


class _ReadingModel:
    """``model`` as ``loss_fn`` sees it through the engine: its own ``.loss`` marked with the items it
    averages (``engine.window.model_loss``), its other attributes its own."""

    def __init__(self, model: torch.nn.Module):
        self._model, self._reading = model, model_loss(model)
        self.loss_type = self._reading.loss_type

    def __call__(self, *args, **kwargs):
        kwargs = self._reading.call_arguments(kwargs)
        output = self._model(*args, **kwargs)
        self._reading.observe(kwargs, output)
        return output

    def __getattr__(self, name):
        return getattr(self._model, name)


# -- comparing ----------------------------------------------------------------------------------
def compare_states(before: dict, reference: dict, parallel: dict) -> list[ParameterDifference]:
    """Every floating tensor, worst first (see ParameterDifference)."""
    if reference.keys() != parallel.keys():
        raise VerifyError(f"the N processes' model has other tensors than the one process's: only there "
                          f"{sorted(parallel.keys() - reference.keys())[:5]}, missing {sorted(reference.keys() - parallel.keys())[:5]}")
    rows = []
    for name, expected in reference.items():
        if not expected.is_floating_point():
            if not torch.equal(expected, parallel[name]):
                rows.append(ParameterDifference(name, math.inf, math.inf, 0.0))
            continue
        difference = (parallel[name].double() - expected.double()).norm().item()
        update = (expected.double() - before[name].double()).norm().item()
        relative = difference / update if update else (0.0 if difference == 0 else math.inf)
        rows.append(ParameterDifference(name, relative, difference, update))
    return sorted(rows, key=lambda row: row.relative, reverse=True)


def _table(rows: list[ParameterDifference], shown: int) -> list[str]:
    width = max(len(row.name) for row in rows[:shown])
    lines = [f"{'tensor':<{width}}  {'relative':>9}  {'|difference|':>12}  {'|update|':>10}"]
    lines += [f"{row.name:<{width}}  {row.relative:9.2e}  {row.difference:12.3e}  {row.update:10.3e}"
              for row in rows[:shown]]
    return lines


# -- the entry point ----------------------------------------------------------------------------
def _verify_overrides(config) -> tuple[list[str], list[str]]:
    """What verify changes in the config for its comparison, and the notes saying so."""
    overrides, notes = [], []
    half = [name for name, on in (("fp16.enabled", config.fp16.enabled), ("bf16.enabled", config.bf16.enabled)) if on]
    if torch_sections(config).features.autocast is not None:
        half.append("torch_autocast.enabled")
    if half:
        overrides += [f"{name}=false" for name in half]
        notes.append(f"{', '.join(half)} switched off: verify compares the parallel mechanics in its --dtype, "
                     "where rounding cannot hide a weighting error (half precision is tested by Microstep's suite)")
    if config.checkpoint.dir is not None:
        overrides.append("checkpoint.dir=null")
        notes.append("checkpoint.dir off: verify neither resumes from nor writes checkpoints")
    if config.monitor.enabled:
        overrides.append("monitor.enabled=false")
        notes.append("monitor off: verify writes no metrics files")
    return overrides, notes


def verify(config, model, batch, loss, *, nproc: int = 2, steps: int = 2, dtype: str = "float64",
           overrides=None, timeout_seconds: float = 600.0, show: int = 5, echo=print) -> VerifyResult:
    """Train ``config`` on ``nproc`` CPU processes and on one process with the whole global batch
    for ``steps`` steps, and compare the models.

    ``config``: a path, dict or ``engine.Config``; ``overrides``: dotted ``key=value`` strings.
    ``model``: ``fn() -> nn.Module``, the same initial model at every call. ``batch``:
    ``fn(step) -> the whole global batch of that step``. ``loss``: the script's
    ``loss_fn(model, micro_batch)`` (a mean, or ``(sum, count)``). Each is a top-level function
    or a ``'module:function'`` / ``'path/file.py:function'`` string: the processes load them.
    ``dtype``: ``float64`` (default) or ``float32``. ``echo``: where the lines go (None: nowhere).
    Returns a :class:`VerifyResult`; raises :class:`VerifyError` when a run fails or times out.
    """
    echo = echo or (lambda line: None)
    if STARTED_BY_VERIFY in os.environ:
        raise VerifyError("engine.verify was called again inside one of the processes it started: they load the "
                          "script that defines the functions, so put the call under if __name__ == '__main__':")
    if dtype not in DTYPES:
        raise VerifyError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if nproc < 1 or steps < 1:
        raise VerifyError(f"nproc and steps must be at least 1; got nproc {nproc}, steps {steps}")
    references = [reference_of(function, role) for function, role in ((model, "model"), (batch, "batch"), (loss, "loss"))]
    # this process calls what it was given (loading a script's file again would run the script)
    make_model, make_batch, loss_fn = (function if callable(function) else load_factory(function)
                                       for function in (model, batch, loss))
    user_overrides = list(overrides or [])
    loaded = load_config(config, user_overrides)
    extra, notes = _verify_overrides(loaded)
    timeouts = ["distributed.backend=gloo", f"distributed.timeout_seconds={timeout_seconds}",
                f"distributed.agreement_timeout_seconds={timeout_seconds}"]
    all_overrides = user_overrides + extra + timeouts
    loaded = load_config(config, all_overrides)
    if loaded.backend == "deepspeed" and dtype == "float64":
        raise VerifyError("backend deepspeed cannot train float64 parameters (it keeps fp32 master copies): run "
                          "verify with --dtype float32 (engine.verify(..., dtype='float32'))")
    if loaded.optimizer is None:
        raise VerifyError("the config has no optimizer section: verify builds the same optimizer in every process "
                          "from it; add `optimizer: {type: AdamW, params: {lr: ...}}`")
    mesh = mesh_layout(loaded, nproc)
    plan = plan_for_mesh(loaded, mesh, 0)
    if plan.is_data_defined:
        raise VerifyError("the config gives only gradient_accumulation_steps: verify needs train_batch_size, the "
                          "global batch the one process trains on at once")
    rows = batch_size(make_batch(0))
    if rows != plan.train_batch_size:
        raise VerifyError(f"--batch returned {rows} rows for step 0, but the config's global batch is "
                          f"train_batch_size {plan.train_batch_size}: return the whole global batch of a step")
    torch_dtype = DTYPES[dtype]
    echo(f"verify: {getattr(loaded, 'source', config)} on {nproc} processes ({mesh.describe()}; gloo, CPU) "
         f"against one process on the whole global batch of {plan.train_batch_size}, {steps} steps, {dtype}; "
         f"collectives time out after {timeout_seconds:g} s")
    before, after, losses, model_notes, pair, own_loss_type = _reference(
        loaded, make_model, make_batch, loss_fn, steps, torch_dtype, echo)
    notes = model_notes + notes
    tolerance, reason = choose_tolerance(measure_rounding(plan, make_model, make_batch, loss_fn, torch_dtype),
                                         torch_dtype)
    for note in notes:
        echo(f"note: {note}")
    with tempfile.TemporaryDirectory(prefix="microstep-verify-") as folder:
        folder = Path(folder)
        job = _Job(config, all_overrides, *references, steps, dtype, timeout_seconds,
                   str(folder / "state.pt"), str(folder / "progress.txt"))
        job_path = folder / "job.pkl"
        job_path.write_bytes(pickle.dumps(job))
        echo(f"starting {nproc} processes")
        parallel_losses = _run_processes(job, job_path, nproc, folder, echo)
        parallel = torch.load(job.state_path, weights_only=True)
    rows = compare_states(before, after, parallel)
    for line in _table(rows, show):
        echo(line)
    worst = rows[0]
    why = f"tolerance {tolerance:g} of each tensor's update over {steps} steps: {reason}"
    if worst.relative <= tolerance:
        verdict = (f"equal: every tensor within {tolerance:g} of its update after {steps} steps on {nproc} "
                   f"processes (worst {worst.name}: {worst.relative:.2e}); {why}")
    else:
        cause = None if pair else mean_over_samples_check(plan, make_model, make_batch, loss_fn, torch_dtype,
                                                                tolerance)
        if cause:
            echo(f"cause: {cause}")
        fix = "; fix: loss_fn should return (loss_sum, num_tokens), not a per-micro-batch mean (see cause)" if cause else ""
        if pair and own_loss_type is not None:
            fix = (f"; the model's own .loss is read as (sum, count) by its labels (loss type {own_loss_type}): "
                   "its weighting is not the cause")
        verdict = (f"not equal: {worst.name} differs by {worst.relative:.2e} of its update "
                   f"(|difference| {worst.difference:.3e}, |update| {worst.update:.3e}); {why}{fix}")
    echo(verdict)
    return VerifyResult(equal=worst.relative <= tolerance, differences=rows, tolerance=tolerance, verdict=verdict,
                        notes=notes, losses=losses, parallel_losses=parallel_losses)
