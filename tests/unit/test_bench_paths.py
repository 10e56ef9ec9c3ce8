"""Benches write their results where git does not track them unless asked to record
(``--record``): trying a command from docs/benchmarks.md rewrites no recorded figure."""

import argparse
import ast
import json
import subprocess
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parents[2]


def ignored_by_git(path: Path) -> bool:
    """Whether git ignores ``path`` (it need not exist)."""
    result = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, timeout=30)
    assert result.returncode in (0, 1), "git check-ignore failed"
    return result.returncode == 0


def test_a_run_without_record_writes_an_untracked_file():
    assert ignored_by_git(common.results_directory(record=False) / "packing_w1.json")


def test_a_recorded_run_writes_the_tracked_file():
    recorded = common.results_directory(record=True) / "packing_w1.json"
    assert recorded == ROOT / "bench" / "results" / "packing_w1.json"
    assert not ignored_by_git(recorded)


def test_record_is_off_unless_asked():
    parser = argparse.ArgumentParser()
    common.add_record_argument(parser)
    assert parser.parse_args([]).record is False
    assert parser.parse_args(["--record"]).record is True


def test_save_writes_into_the_directory_record_chooses(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "LATEST", tmp_path / "results" / "latest")
    latest = common.save("probe", {"value": 1})
    recorded = common.save("probe", {"value": 2}, record=True)
    assert latest == tmp_path / "results" / "latest" / "probe.json"
    assert recorded == tmp_path / "results" / "probe.json"
    assert json.loads(latest.read_text())["value"] == 1 and json.loads(recorded.read_text())["value"] == 2


def test_every_bench_that_saves_says_whether_to_record():
    """Each ``save(...)`` call passes ``record=``, so no bench writes a tracked file by default
    nor lacks a way to record."""
    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "save" \
                    and not any(keyword.arg == "record" for keyword in call.keywords):
                missing.append(f"{path.name}:{call.lineno}")
    assert not missing, f"save() without record= (add add_record_argument to the parser): {missing}"
