"""``python -m engine``: command-line tools around configs and batch plans.

Each subcommand is one ``run_<name>(args) -> int`` function registered in
``build_parser``; user mistakes print a message (no traceback) and exit with code 2.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from engine.batch_plan import BatchConfigError, plan_from_config
from engine.config import Config, ConfigError, load_config

USAGE_ERROR = 2


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    """Add a repeatable ``--set key.path=value`` option, collected in ``args.overrides``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config key, e.g. --set zero_optimization.stage=2 "
                             "(repeatable; values are read as YAML scalars)")


def run_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    plan = plan_from_config(config, args.world_size, args.rank)
    print(plan.describe())
    return 0


def run_validate(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    print(f"OK: {summarize(config)}")
    return 0


def summarize(config: Config) -> str:
    """One line naming the settings that matter most."""
    def batch_value(value):
        return "-" if value is None else str(value)

    precision = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    parts = [config.source,
             f"train_batch_size {batch_value(config.train_batch_size)}",
             f"micro {batch_value(config.train_micro_batch_size_per_gpu)}",
             f"accumulation {batch_value(config.gradient_accumulation_steps)}",
             f"split {config.batch_split}",
             f"optimizer {config.optimizer.type if config.optimizer else '-'}",
             f"scheduler {config.scheduler.type if config.scheduler else '-'}",
             f"zero stage {config.zero_optimization.stage}",
             f"backend {config.backend}", precision]
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine",
                                     description="Microstep command-line tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", help="show how a config splits the global batch")
    plan.add_argument("config", help="config file (.yaml, .yml, .json or .py)")
    plan.add_argument("--world-size", type=int, required=True, help="number of data-parallel ranks")
    plan.add_argument("--rank", type=int, default=0, help="rank whose plan to build (default 0)")
    add_override_argument(plan)
    plan.set_defaults(run=run_plan)

    validate = commands.add_parser("validate", help="check a config without planning")
    validate.add_argument("config", help="config file (.yaml, .yml, .json or .py)")
    add_override_argument(validate)
    validate.set_defaults(run=run_validate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            status = args.run(args)
        except (ConfigError, BatchConfigError) as error:
            print(f"error: {error}" if "\n" not in str(error) else f"error:\n{error}",
                  file=sys.stderr)
            status = USAGE_ERROR
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return status
