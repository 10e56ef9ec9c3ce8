"""DeepSpeed's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``) driving Microstep's
``monitor`` on the torch backend (on ``backend: deepspeed`` DeepSpeed runs its own monitors):

| DeepSpeed | ``monitor`` |
|---|---|
| ``tensorboard: {enabled, output_path, job_name}`` | ``tensorboard: <output_path>/<job_name>`` (DeepSpeed's log dir) |
| ``csv_monitor: {enabled, output_path, job_name}`` | ``csv: <output_path>/<job_name>/metrics.csv`` (one file, a column per metric; DeepSpeed writes a file per metric) |
| ``wandb: {enabled, project, group, team}`` | ``wandb: {project, group, entity}`` (``wandb.init``'s names; DeepSpeed's default project ``deepspeed``) |

Any enabled section turns the monitor on. A section switched off changes nothing; a key
DeepSpeed does not have, or a ``monitor`` key set to something else, is a problem.
"""

from __future__ import annotations

import os

# DeepSpeed's keys and defaults (deepspeed.monitor.config).
SECTIONS = {
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "project": "deepspeed", "group": None, "team": None},
}
CSV_NAME = "metrics.csv"


def _monitor_value(name: str, section: dict):
    if name == "tensorboard":
        return "tensorboard", os.path.join(section["output_path"], section["job_name"])
    if name == "csv_monitor":
        return "csv", os.path.join(section["output_path"], section["job_name"], CSV_NAME)
    chosen = {"project": section["project"], "group": section["group"], "entity": section["team"]}
    return "wandb", {key: value for key, value in chosen.items() if value is not None}


def monitor_from_deepspeed(extras: dict, monitor) -> tuple[dict, set[str], list[str]]:
    """(updates for ``monitor``, the sections read, problems) from a config's DeepSpeed
    ``extras`` and its ``monitor`` section (a ``MonitorConfig``)."""
    updates, read, problems = {}, set(), []
    for name, defaults in SECTIONS.items():
        if name not in extras:
            continue
        read.add(name)
        written = extras[name]
        if not isinstance(written, dict):
            problems.append(f"{name}: expected a section {{enabled: true, ...}}, got {written!r}")
            continue
        unknown = sorted(set(written) - set(defaults))
        if unknown:
            problems.append(f"{name}: {', '.join(unknown)}: not a key of DeepSpeed's {name} section (its keys: "
                            f"{', '.join(defaults)})")
            continue
        section = {**defaults, **written}
        if not section["enabled"]:
            continue
        key, value = _monitor_value(name, section)
        if "enabled" in monitor.model_fields_set and not monitor.enabled:
            problems.append(f"{name}: enabled, but monitor.enabled is false; keep one")
            continue
        if key in monitor.model_fields_set and getattr(monitor, key) != value:
            problems.append(f"{name}: writes to {value!r}, but monitor.{key} is {getattr(monitor, key)!r}; keep one")
            continue
        updates[key] = value
        updates["enabled"] = True
    return updates, read, problems
