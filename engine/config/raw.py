"""A config as read from its source: plain data plus where each key path was written."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

KeyPath = tuple  # of str: ("zero_optimization", "stage")


@dataclass
class RawConfig:
    """Keys as written in a source, plus where each key path was written."""

    data: Any
    source: str
    locations: dict[KeyPath, str] = field(default_factory=dict)  # path -> "file:line"
    written_as: dict[str, str] = field(default_factory=dict)  # canonical top-level key -> the alias written

    def as_written(self, text: str) -> str:
        return name_as_written(text, self.written_as)

    @classmethod
    def with_lines(cls, data, source: str, lines: dict[KeyPath, int]) -> RawConfig:
        return cls(data, source, {path: f"{source}:{line}" for path, line in lines.items()})

    def where(self, path: KeyPath) -> str:
        """Location of the longest written prefix of `path` (the source name if unknown)."""
        for end in range(len(path), 0, -1):
            if tuple(path[:end]) in self.locations:
                return self.locations[tuple(path[:end])]
        return self.source

    def forget(self, prefix: KeyPath) -> None:
        """Drop the locations under `prefix` (its value was replaced)."""
        for path in [p for p in self.locations if p[:len(prefix)] == prefix]:
            del self.locations[path]

    def move(self, old: KeyPath, new: KeyPath) -> None:
        """Re-file the locations under `old` to `new` after a key was renamed or moved."""
        for path in [p for p in self.locations if p[:len(old)] == old]:
            self.locations[new + path[len(old):]] = self.locations.pop(path)


def name_as_written(text: str, written_as: dict[str, str]) -> str:
    """``text`` with each canonical top-level key of ``written_as`` named as the source wrote it (Colossal-AI's,
    Cerebras', Hugging Face's spelling)."""
    for canonical, alias in written_as.items():
        text = re.sub(rf"(?<![\w.]){re.escape(canonical)}(?!\w)", alias, text)
    return text
