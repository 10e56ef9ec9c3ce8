"""``python -m bench.gpu`` at toy size on CPU, so that the GPU command cannot rot: every part
runs (the CUDA-only ones say they were skipped) and the JSON and markdown table are written."""

import json

import pytest

from bench import gpu


@pytest.mark.timeout(300)
def test_the_gpu_command_runs_at_toy_size_and_writes_its_report(tmp_path):
    report = gpu.main(["--toy", "--no-compile", "--steps", "1", "--out", str(tmp_path)])
    assert report["cuda_tests"]["status"].startswith("skipped") and report["out_of_memory"]["status"].startswith("skipped")
    (row,) = report["throughput"]  # one process: ZeRO-0 against the hand-written loop
    assert row["tokens_per_s_per_device"] > 0 and row["peak_bytes"] > 0 and row["engine_over_hand"] > 0
    assert json.loads((tmp_path / "gpu_cpu.json").read_text())["throughput"] == report["throughput"]
    table = (tmp_path / "gpu_cpu.md").read_text()
    assert "| stage | defer_reduction | tokens/s per device |" in table and "| 0 | False |" in table
