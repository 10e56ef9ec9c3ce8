"""``init_trackers`` / ``log`` / ``end_training``: accelerate's own trackers (``log_with`` names such
as ``"tensorboard"``, ``"wandb"``, or ``GeneralTracker`` instances), run on the main process only, as
accelerate runs them. accelerate is imported only when a tracker is named."""

from __future__ import annotations

from typing import Any


def start_trackers(log_with: list, project_name: str, logging_dir: str | None, config: dict | None,
                   init_kwargs: dict) -> list:
    """The trackers ``log_with`` asks for, started, with ``config`` stored as their hyperparameters."""
    trackers = []
    for entry in log_with:
        if hasattr(entry, "log") and hasattr(entry, "store_init_configuration"):  # a GeneralTracker instance
            trackers.append(entry)
            continue
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        name = str(getattr(entry, "value", entry)).lower()
        if name == "all":
            raise ValueError("log_with='all': name the trackers (e.g. ['tensorboard'])")
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(f"log_with: unknown tracker {name!r}; accelerate knows {sorted(LOGGER_TYPE_TO_CLASS)}")
        tracker_class = LOGGER_TYPE_TO_CLASS[name]
        kwargs = dict(init_kwargs.get(name, {}))
        if getattr(tracker_class, "requires_logging_directory", False):
            kwargs.setdefault("logging_dir", logging_dir)
        tracker = tracker_class(project_name, **kwargs)
        if hasattr(tracker, "start"):
            tracker.start()
        trackers.append(tracker)
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers


def log_values(trackers: list, values: dict[str, Any], step: int | None, log_kwargs: dict) -> None:
    for tracker in trackers:
        tracker.log(values, step=step, **log_kwargs.get(getattr(tracker, "name", ""), {}))


def finish(trackers: list) -> None:
    for tracker in trackers:
        tracker.finish()
