"""What the monitor reports beyond loss and time, and what drives it: tokens/s per device and
MFU (engine.monitor.throughput: 6·N per token over the device's peak, known GPUs or monitor.peak_flops),
and a DeepSpeed config's tensorboard / csv_monitor / wandb sections (engine.config.deepspeed_monitor;
wandb in its offline mode)."""

import copy
import csv
import os

import pytest
import torch

import engine
from engine.monitor import throughput
from engine.config.schema import load_config
from tests.support.reference import TinyLM, token_batches, token_loss_sum

BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_mfu_is_six_n_tokens_per_second_per_device_over_the_peak():
    model = TinyLM()
    eng = engine.initialize(copy.deepcopy(model), {**BASE, "monitor": {"enabled": True, "progress": False,
                                                                          "peak_flops": 1e9}})
    for batch in token_batches(2, 8):
        eng.train_batch(batch, token_loss_sum)
    n = sum(p.numel() for p in model.parameters())
    for record in eng.monitor.history:
        assert record["tokens_per_s_per_device"] == record["tokens_per_s"]  # one device
        assert record["mfu"] == pytest.approx(6 * n * record["tokens_per_s"] / 1e9, rel=1e-12)
    eng.close()


def test_without_a_known_peak_there_is_no_mfu():
    eng = engine.initialize(TinyLM(), {**BASE, "monitor": {"enabled": True, "progress": False}})
    eng.train_batch(token_batches(1, 8)[0], token_loss_sum)
    assert eng.monitor.history[0]["mfu"] is None  # a CPU: no listed peak
    eng.close()


def test_without_a_known_peak_the_monitor_says_once_how_to_set_it(caplog):
    eng = engine.initialize(TinyLM(), {**BASE, "monitor": {"enabled": True, "progress": False}})
    with caplog.at_level("INFO", logger="engine"):
        for batch in token_batches(3, 8):
            eng.train_batch(batch, token_loss_sum)
    hints = [r.getMessage() for r in caplog.records if "monitor.peak_flops" in r.getMessage()]
    assert len(hints) == 1 and "no MFU" in hints[0] and "(cpu)" in hints[0], hints
    eng.close()


def test_a_known_peak_needs_no_hint(caplog):
    eng = engine.initialize(TinyLM(), {**BASE, "monitor": {"enabled": True, "progress": False, "peak_flops": 1e9}})
    with caplog.at_level("INFO", logger="engine"):
        eng.train_batch(token_batches(1, 8)[0], token_loss_sum)
    assert not [r for r in caplog.records if "peak_flops" in r.getMessage()]
    eng.close()


def test_mfu_of_a_mixture_of_experts_counts_top_k_of_its_experts():
    from tests.support.moe_models import OwnMoE, StackedMoE, lm_batches, stacked_sum_loss

    # Two layers of 4 experts (8x8 weight + 8 bias each), top-2: half of the 576 expert parameters are active.
    for model in (OwnMoE(), StackedMoE()):
        assert throughput.parameter_count(model) == 1184
        assert throughput.active_parameter_count(model) == 1184 - 576 // 2
    model = StackedMoE()
    eng = engine.initialize(copy.deepcopy(model), {**BASE, "monitor": {"enabled": True, "progress": False,
                                                                          "peak_flops": 1e9}})
    eng.train_batch(lm_batches(1, 8)[0], stacked_sum_loss)
    record = eng.monitor.history[0]
    assert record["mfu"] == pytest.approx(6 * (1184 - 288) * record["tokens_per_s"] / 1e9, rel=1e-12)
    eng.close()


def test_the_example_mixtral_counts_its_active_parameters():
    pytest.importorskip("transformers")
    from examples.moe import mixtral
    from tests.support.moe_models import deepseek_v3, hf_moe

    assert throughput.parameter_count(mixtral()) == 84_640
    assert throughput.active_parameter_count(mixtral()) == 84_640 - 73_728 * 3 // 4  # top-2 of 8: 29,344
    # Qwen2-MoE's shared expert and DeepSeek-V3's shared experts and dense first layer count whole.
    assert throughput.active_parameter_count(hf_moe("qwen2_moe")) == 8624 - 2 * (4 * (24 * 16 + 16 * 12)) // 2
    assert throughput.active_parameter_count(deepseek_v3()) == 11592 - 2 * (8 * (16 * 16 + 16 * 8)) * 3 // 4


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA GeForce RTX 4090", None)])
def test_the_peaks_of_known_gpus(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert throughput.device_peak_flops(torch.device("cuda", 0)) == peak


def test_deepspeed_monitor_sections_set_the_monitor(tmp_path):
    config = load_config({"train_batch_size": 8,
                          "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run1"},
                          "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run1"},
                          "wandb": {"enabled": True, "project": "p", "team": "t"}})
    monitor = config.monitor
    assert monitor.enabled
    assert monitor.tensorboard == str(tmp_path / "tb" / "run1")  # DeepSpeed's log dir
    assert monitor.csv == str(tmp_path / "csv" / "run1" / "metrics.csv")
    assert monitor.wandb == {"project": "p", "entity": "t"}
    off = load_config({"train_batch_size": 8, "tensorboard": {"enabled": False}}).monitor
    assert not off.enabled and off.tensorboard is None
    # on backend: deepspeed DeepSpeed runs its own monitors
    assert load_config({"train_batch_size": 8, "backend": "deepspeed",
                        "tensorboard": {"enabled": True}}).monitor.tensorboard is None


@pytest.mark.parametrize("extra, problem", [
    ({"tensorboard": {"enabled": True, "path": "x"}}, "tensorboard: path: not a key of DeepSpeed's tensorboard section"),
    ({"csv_monitor": {"enabled": True}, "monitor": {"csv": "mine.csv"}},
     "csv_monitor: writes to 'DeepSpeedJobName/metrics.csv', but monitor.csv is 'mine.csv'; keep one"),
    ({"wandb": {"enabled": True}, "monitor": {"enabled": False}}, "wandb: enabled, but monitor.enabled is false"),
])
def test_what_the_sections_cannot_mean_is_refused(extra, problem):
    with pytest.raises(engine.ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        load_config({"train_batch_size": 8, **extra})


def test_no_section_is_called_not_used_any_more(recwarn):
    load_config({"train_batch_size": 8, "tensorboard": {"enabled": False}, "wandb": {"enabled": False}})
    assert not [w for w in recwarn if "not used" in str(w.message)]


def test_a_deepspeed_config_trains_with_csv_and_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # optional: pinned in requirements/ci.txt
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    eng = engine.initialize(TinyLM(), {**BASE, "monitor": {"progress": False},
                                       "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
                                       "wandb": {"enabled": True, "project": "microstep-test"}})
    for batch in token_batches(3, 8):
        eng.train_batch(batch, token_loss_sum)
    run = eng.monitor._wandb
    assert run is not None and run.settings.mode == "offline"
    last = eng.monitor.history[-1]
    assert run.summary["train/loss"] == pytest.approx(last["loss"])
    assert run.summary["train/tokens_per_s_per_device"] == pytest.approx(last["tokens_per_s_per_device"])
    eng.close()
    rows = list(csv.DictReader(open(tmp_path / "j" / "metrics.csv")))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert any(name.startswith("offline-run-") for name in os.listdir(tmp_path / "wandb"))
    assert wandb.run is None  # finished by close()
