"""``python -m bench.gpu`` at toy size on CPU, so that the GPU command cannot rot: every part
runs (the CUDA-only ones say they were skipped) and the JSON and markdown table are written."""

import json

import pytest

from bench import gpu


@pytest.mark.timeout(300)
def test_the_gpu_command_runs_at_toy_size_and_writes_its_report(tmp_path):
    report = gpu.main(["--toy", "--no-compile", "--steps", "1", "--out", str(tmp_path)])
    assert report["cuda_tests"]["status"].startswith("skipped") and report["out_of_memory"]["status"].startswith("skipped")
    # one process: ZeRO-0 with checkpointing against the hand-written loop, without checkpointing, fp16
    checkpointed, plain, fp16 = report["throughput"]
    assert checkpointed["checkpointing"] and not plain["checkpointing"], report["throughput"]
    assert fp16["precision"] == "fp16" and fp16["tokens_per_s_per_device"] > 0, report["throughput"]
    assert checkpointed["tokens_per_s_per_device"] > 0 and checkpointed["engine_over_hand"] > 0
    assert 0 < checkpointed["peak_bytes"] < plain["peak_bytes"]  # checkpointing holds fewer activations
    choice = report["checkpointing_choice"]  # explore measured both series and chose one that fits
    assert choice["status"] == "passed", choice
    assert {c["checkpointing"] for c in choice["candidates"]} == {False, True}
    assert any(c["recommended"] and c["fits"] and c["micro_batch_size"] == choice["micro_size"]
               and c["checkpointing"] == choice["checkpointing"] for c in choice["candidates"])
    assert json.loads((tmp_path / "gpu_cpu.json").read_text())["throughput"] == report["throughput"]
    table = (tmp_path / "gpu_cpu.md").read_text()
    assert "| stage | defer_reduction | checkpointing | precision | tokens/s per device |" in table and "| 0 | False | True | bf16 |" in table
