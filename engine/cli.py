"""``python -m engine``: command-line tools around configs and batch plans.

Each subcommand is one ``run_<name>(args) -> int`` function registered in
``build_parser``; user mistakes print a message (no traceback) and exit with code 2.

Each ``run_<name>`` imports what its subcommand needs when it runs, not this module: ``--help``
then imports no torch, and ``validate`` / ``plan`` neither torch.distributed.tensor nor the
engine (seconds of imports for a config check). Only this entry module does so; the imported
modules themselves import at their top as everywhere else.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import TYPE_CHECKING

from engine.errors import ConfigError, MicrostepError
from engine.config.factories import FactoryError, load_factory

if TYPE_CHECKING:
    from engine.config.schema import Config

USAGE_ERROR = 2
NOT_EQUAL = 1  # verify: the N processes and the one process trained different models


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    """Add a repeatable ``--set key.path=value`` option, collected in ``args.overrides``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config key, e.g. --set zero_optimization.stage=2 "
                             "(repeatable; values are read as YAML scalars)")


def run_plan(args: argparse.Namespace) -> int:
    # the planner and the config only (see the module's docstring)
    from engine.batching.mesh_plan import describe_data_ranks, plan_for_mesh
    from engine.config.schema import load_config
    from engine.config.setup import mesh_layout

    config = load_config(args.config, args.overrides)
    mesh = mesh_layout(config, args.world_size)
    plan = plan_for_mesh(config, mesh, args.rank)
    if mesh.needs_groups:  # a model-parallel dimension, or hybrid sharding
        print(f"mesh: {describe_data_ranks(mesh)}")
    print(plan.describe())
    return 0


def run_validate(args: argparse.Namespace) -> int:
    # the config and its model-free checks only (see the module's docstring)
    from engine.config.checks import check_without_model
    from engine.config.schema import load_config

    config = load_config(args.config, args.overrides)
    problems = check_without_model(config)
    if problems:
        raise ConfigError(problems)
    print(f"OK: {summarize(config)}")
    return 0


def _model_output_loss(model, batch):
    """Default loss for explore: the model's own loss (``output.loss``, e.g. Hugging Face
    models given labels) or its output when that is a scalar."""
    import torch

    hint = "pass --loss module:function computing loss_fn(model, micro_batch)"
    try:
        if isinstance(batch, dict):
            output = model(**batch)
        elif isinstance(batch, (tuple, list)):
            output = model(*batch)
        else:
            output = model(batch)
    except TypeError as error:  # e.g. a plain model given (inputs, labels): it takes the inputs only
        raise FactoryError(f"without --loss the model is called with the whole batch as its arguments (labels "
                           f"included) to return its own loss, and that call failed: {error}; {hint}") from None
    loss = getattr(output, "loss", output)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise FactoryError(f"the model does not return a scalar loss (or an output with .loss): {hint}")
    return loss


def run_explore(args: argparse.Namespace) -> int:
    # the whole engine: explore trains a real model (see the module's docstring)
    from pathlib import Path

    import torch

    import engine
    from engine.autotune.report import format_table, save_json, save_plot
    from engine.monitor.startup import quiet_startup
    from engine.config.schema import load_config

    overrides = args.overrides + ["train_micro_batch_size_per_gpu=explore", "gradient_accumulation_steps=null"]
    config = load_config(args.config, overrides)
    model = load_factory(args.model)()
    make_batch = load_factory(args.batch)
    loss_fn = load_factory(args.loss) if args.loss else _model_output_loss
    optimizer = None if config.optimizer else (lambda params: torch.optim.SGD(params, lr=0.0))  # never stepped
    with quiet_startup():  # a measurement, not a run: its table says what it measured
        eng = engine.initialize(model, config, optimizer=optimizer)
    eng.micro_batch_tuner.warmup, eng.micro_batch_tuner.repeats = args.warmup, args.repeats
    batch = make_batch(eng.plan.per_device_batch_size)
    rows = eng.micro_batch_tuner.explore(eng, batch, loss_fn)
    if eng.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        measured = "token budgets" if eng.plan.micro_batch_tokens else "micro-batch sizes"
        print(f"{measured} for global batch {eng.plan.train_batch_size} on {eng.world_size} rank(s) "
              f"({eng.plan.per_device_batch_size} per device):")
        print(format_table(rows))
        saved = [save_json(rows, out / "explore.json", config=config.source, world_size=eng.world_size,
                           train_batch_size=eng.plan.train_batch_size), save_plot(rows, out / "explore.png")]
        print("saved " + ", ".join(str(path) for path in saved if path is not None))
    eng.close()
    return 0


def run_verify(args: argparse.Namespace) -> int:
    # the whole engine, on N processes and one (see the module's docstring)
    from engine import verify

    result = verify(args.config, args.model, args.batch, args.loss, nproc=args.nproc, steps=args.steps,
                    dtype=args.dtype, overrides=args.overrides, timeout_seconds=args.timeout, show=args.show)
    return 0 if result.equal else NOT_EQUAL


def summarize(config: Config) -> str:
    """One line naming the settings that matter most."""
    from engine.config.setup import model_parallel_dimensions  # as run_validate's imports

    def batch_value(value):
        return "-" if value is None else str(value)

    precision = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    parts = [config.source,
             f"train_batch_size {batch_value(config.train_batch_size)}",
             f"micro {batch_value(config.train_micro_batch_size_per_gpu)}",
             f"accumulation {batch_value(config.gradient_accumulation_steps)}",
             *([f"micro_batch_tokens {config.micro_batch_tokens}"] if config.micro_batch_tokens else []),
             f"split {config.batch_split}",
             f"optimizer {config.optimizer.type if config.optimizer else '-'}",
             f"scheduler {config.scheduler.type if config.scheduler else '-'}",
             f"zero stage {config.zero_optimization.stage}",
             *model_parallel_dimensions(config),
             f"backend {config.backend}", precision]
    return ", ".join(parts)


def _count(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


CONSOLE_SCRIPT = "microstep"  # pyproject's [project.scripts] name for main
MODULE_COMMAND = "python -m engine"


def build_parser(prog: str = MODULE_COMMAND) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Microstep command-line tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", help="show how a config splits the global batch")
    plan.add_argument("config", help="config file (.yaml, .yml, .json or .py)")
    plan.add_argument("--world-size", type=int, required=True,
                      help="number of processes: pipeline stages × data-parallel ranks × context ranks × tensor ranks (the planner counts the data-parallel ones)")
    plan.add_argument("--rank", type=int, default=0, help="(global) rank whose plan to build (default 0)")
    add_override_argument(plan)
    plan.set_defaults(run=run_plan)

    validate = commands.add_parser(
        "validate", help="check a config without planning: keys, optimizer and scheduler, "
                         "precision and backend (everything that needs no model)")
    validate.add_argument("config", help="config file (.yaml, .yml, .json or .py)")
    add_override_argument(validate)
    validate.set_defaults(run=run_validate)

    explore = commands.add_parser(
        "explore", help="measure candidate micro-batch sizes on a real model and batch",
        description="Time forward+backward of a whole window for each candidate micro-batch size "
                    "(warm-up, then timed; nothing is updated) and recommend the fastest that fits.")
    explore.add_argument("config", help="config file (.yaml, .yml, .json or .py) with train_batch_size")
    explore.add_argument("--model", required=True, metavar="MODULE:FN", help="builds the model: fn() -> nn.Module")
    explore.add_argument("--batch", required=True, metavar="MODULE:FN",
                         help="builds one per-device batch: fn(size) -> batch of `size` samples")
    explore.add_argument("--loss", metavar="MODULE:FN",
                         help="loss_fn(model, micro_batch) (default: the model's output.loss or scalar output)")
    explore.add_argument("--out", default="runs/explore", help="where explore.json and explore.png go")
    explore.add_argument("--warmup", type=_count(0), default=1, help="untimed windows per candidate")
    explore.add_argument("--repeats", type=_count(1), default=3, help="timed windows per candidate (median)")
    add_override_argument(explore)
    explore.set_defaults(run=run_explore)

    verify_command = commands.add_parser(
        "verify", help="train a config on N CPU processes and on one process with the whole global batch, "
                       "and compare the models",
        description="Run the config on --nproc CPU processes (gloo; its mesh, ZeRO stage and accumulation as "
                    "written) and one process on the whole global batch (plain PyTorch) for --steps steps, "
                    "then print the tensors that differ most. The last line starts with 'equal:' (exit 0) or "
                    "'not equal:' (exit 1), naming the worst tensor, the tolerance and why.")
    verify_command.add_argument("config", help="config file (.yaml, .yml, .json or .py) with train_batch_size and optimizer")
    verify_command.add_argument("--model", required=True, metavar="MODULE:FN",
                                help="fn() -> nn.Module: the same initial model at every call (seed it inside)")
    verify_command.add_argument("--batch", required=True, metavar="MODULE:FN",
                                help="fn(step) -> the whole global batch of that step (train_batch_size rows)")
    verify_command.add_argument("--loss", required=True, metavar="MODULE:FN",
                                help="the script's loss_fn(model, micro_batch): a mean, or (loss_sum, count)")
    verify_command.add_argument("--nproc", type=_count(1), default=2, help="processes for the config (default 2)")
    verify_command.add_argument("--steps", type=_count(1), default=2, help="optimizer steps (default 2)")
    verify_command.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                                help="model and batch dtype on both sides (default float64: tightest tolerance)")
    verify_command.add_argument("--timeout", type=float, default=600.0,
                                help="seconds for the N processes' whole run and for any one collective (default 600)")
    verify_command.add_argument("--show", type=_count(1), default=5, help="tensors to list, worst first (default 5)")
    add_override_argument(verify_command)
    verify_command.set_defaults(run=run_verify)

    plot = commands.add_parser(
        "plot", help="plot a monitor's metrics file: loss, learning rate, gradient norm, tokens/s, MFU "
                     "(and the experts' load and imbalance for a mixture of experts)")
    plot.add_argument("metrics", help="the monitor's JSON-lines or CSV file (monitor.jsonl, monitor.csv)")
    plot.add_argument("--out", help="the image to write (default: the metrics file's name ending in .png)")
    plot.add_argument("--per-panel", action="store_true",
                      help="one image per panel, <out stem>_<panel>.png (loss, lr, grad_norm, throughput, mfu, "
                           "expert_load, expert_imbalance)")
    plot.set_defaults(run=run_plot)
    return parser


def run_plot(args) -> int:
    # the monitor's plotting (matplotlib) only (see the module's docstring)
    from pathlib import Path

    from engine.monitor.plot import plot_metrics

    out = args.out or str(Path(args.metrics).with_suffix(".png"))
    for path in plot_metrics(args.metrics, out, per_panel=args.per_panel):
        print(path)
    return 0


def main(argv=None, prog: str = CONSOLE_SCRIPT) -> int:
    """The command line; ``prog`` is how usage lines name it (the ``microstep`` console script,
    or ``python -m engine`` from ``engine/__main__.py``)."""
    args = build_parser(prog).parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            status = args.run(args)
        except MicrostepError as error:
            print(f"error: {error}" if "\n" not in str(error) else f"error:\n{error}",
                  file=sys.stderr)
            status = USAGE_ERROR
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return status
