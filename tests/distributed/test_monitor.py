"""engine.monitor: per-step metrics, files, progress on rank 0, gradient norm."""

from __future__ import annotations

import contextlib
import copy
import csv
import functools
import io
import json
import sys

import pytest
import torch

import engine
from engine.config.schema import MonitorConfig
from engine.monitor import FIELDS, Monitor
from engine.config.optim import WarmupLR
from tests.support.dist_utils import run_distributed, run_scenarios
from tests.support.reference import (
    TinyLM, mlp, mse, regression_batches, token_batches, token_loss_mean, token_loss_sum,
)

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                         "warmup_num_steps": 4, "warmup_type": "linear"}}


def config(global_batch=8, micro=2, stage=0, **monitor):
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "scheduler": WARMUP,
            "monitor": {"enabled": True, "progress": False, **monitor}}


def rank_slice(batch, plan):
    sizes = plan.per_device_batch_sizes
    start = sum(sizes[:plan.rank])
    if isinstance(batch, dict):
        return {k: v[start:start + sizes[plan.rank]] for k, v in batch.items()}
    return tuple(t[start:start + sizes[plan.rank]] for t in batch)


def reference_norms(model, batches, loss_fn) -> list[float]:
    """Norm of the full-batch gradient before each step, with the config's AdamW + schedule."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)  # the config's AdamW: DeepSpeed's default
    scheduler = WarmupLR(optimizer, **WARMUP["params"])
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        optimizer.step()
        scheduler.step()
    return norms


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


# -- config -------------------------------------------------------------------------------
def test_monitor_is_off_by_default():
    model = mlp()
    eng = engine.initialize(model, {"train_batch_size": 4},
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert eng.monitor is None
    assert engine.load_config({}).monitor == MonitorConfig()


def test_monitor_config_is_checked():
    with pytest.raises(engine.ConfigError, match="monitor.log_evry: unknown key; did you mean log_every"):
        engine.load_config({"monitor": {"log_evry": 2}})
    with pytest.raises(engine.ConfigError, match="monitor.log_every"):
        engine.load_config({"monitor": {"log_every": 0}})
    loaded = engine.load_config({}, ["monitor.enabled=true", "monitor.jsonl=out/m.jsonl"])
    assert loaded.monitor.enabled and loaded.monitor.jsonl == "out/m.jsonl"


# -- values -------------------------------------------------------------------------------
def test_record_values_follow_the_engine_and_the_schedule():
    model, batches = TinyLM(), token_batches(6, 8)
    eng = engine.initialize(copy.deepcopy(model), config())
    losses = [eng.train_batch(batch, token_loss_sum) for batch in batches]
    history = eng.monitor.history
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]
    assert set(history[0]) == set(FIELDS)
    assert [r["loss"] for r in history] == pytest.approx(losses, rel=1e-12)
    # The loss is the full-batch per-token mean: the reference on the first batch.
    assert history[0]["loss"] == pytest.approx(token_loss_mean(model, batches[0]).item(), rel=1e-10)
    # The lr the step used: WarmupLR linear 0 → 0.01 over 4 steps (not the one after it).
    assert [r["lr"] for r in history] == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01])
    for record, batch in zip(history, batches):
        assert record["tokens"] == int((batch["labels"] != -100).sum())
        assert record["samples"] == 8
        assert record["samples_per_s"] > 0 and record["step_time"] > 0
        assert record["tokens_per_s"] == pytest.approx(record["tokens"] / record["step_time"])
        assert record["micro_batch_size"] == 2 and record["accumulation_steps"] == 4
        assert record["peak_memory_mb"] > 0
        assert record["skipped"] is False and record["skipped_steps"] == 0
    assert history[-1]["elapsed"] == pytest.approx(sum(r["step_time"] for r in history))


def test_mean_loss_has_no_tokens_and_manual_loop_is_recorded():
    model, batches = mlp(), regression_batches(2, 8)
    eng = engine.initialize(copy.deepcopy(model), config())
    for batch in batches:
        for micro in zip(*(t.split(2) for t in batch)):
            eng.backward(mse(eng, micro))
            eng.step()
    history = eng.monitor.history
    assert len(history) == 2
    assert history[0]["tokens"] is None and history[0]["tokens_per_s"] is None
    assert history[0]["loss"] == pytest.approx(mse(model, batches[0]).item(), rel=1e-10)


def test_step_time_is_measured_from_the_previous_window():
    ticks = iter([-5.0, 0.0, 1.0, 3.0, 6.0])  # creation, attach, then three window closes
    monitor = Monitor(MonitorConfig(enabled=True, progress=False), clock=lambda: next(ticks))
    model = mlp()
    eng = engine.initialize(model, config(enabled=False))
    eng.monitor = monitor.attach(eng)
    for batch in regression_batches(3, 8):
        eng.train_batch(batch, mse)
    assert [r["step_time"] for r in monitor.history] == [1.0, 2.0, 3.0]
    assert [r["samples_per_s"] for r in monitor.history] == [8.0, 4.0, 8 / 3]
    assert [r["elapsed"] for r in monitor.history] == [1.0, 3.0, 6.0]


def test_a_monitor_set_without_attach_times_from_its_creation():
    ticks = iter([10.0, 12.5, 13.0])  # creation, then two window closes
    model = mlp()
    eng = engine.initialize(model, config(enabled=False))
    eng.monitor = Monitor({"enabled": True, "progress": False}, clock=lambda: next(ticks))
    for batch in regression_batches(2, 8):
        eng.train_batch(batch, mse)
    assert [r["step_time"] for r in eng.monitor.history] == [2.5, 0.5]
    assert eng.monitor.history[1]["lr"] == pytest.approx(0.0025)  # watched from step 2 on


def test_log_every_records_every_kth_step_and_the_last(tmp_path):
    eng = engine.initialize(mlp(), config(log_every=2, total_steps=5, jsonl=str(tmp_path / "m.jsonl")))
    computed = []
    for batch in regression_batches(5, 8):
        computed.append(eng.monitor.wants_grad_norm)
        eng.train_batch(batch, mse)
    assert [r["step"] for r in eng.monitor.history] == [2, 4, 5]
    # The norm is computed only for recorded steps; rates cover the steps since the last record.
    assert computed == [False, True, False, True, True]
    assert eng.monitor.history[0]["samples_per_s"] == pytest.approx(8 / eng.monitor.history[0]["step_time"])
    assert eng.monitor.history[0]["samples"] == 8


# -- files ----------------------------------------------------------------------------------
def test_jsonl_and_csv_are_written_and_parse(tmp_path):
    jsonl, csv_path = tmp_path / "logs" / "metrics.jsonl", tmp_path / "metrics.csv"
    eng = engine.initialize(TinyLM(), config(jsonl=str(jsonl), csv=str(csv_path)))
    losses = [eng.train_batch(batch, token_loss_sum) for batch in token_batches(3, 8)]
    eng.monitor.log_eval(3, 1.25)
    # Written as it goes (flushed per record), closed by close().
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    eng.monitor.close()
    eng.monitor.close()
    train = [line for line in lines if line["kind"] == "train"]
    assert [line["loss"] for line in train] == pytest.approx(losses)
    assert set(train[0]) == {"kind", *FIELDS}
    assert lines[-1] == {"kind": "eval", "step": 3, "eval_loss": 1.25}
    assert eng.monitor.eval_history == [{"step": 3, "eval_loss": 1.25}]
    rows = list(csv.DictReader(csv_path.open()))
    assert list(rows[0]) == list(FIELDS)
    assert [float(row["loss"]) for row in rows] == pytest.approx(losses)
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert rows[0]["lr"] == "0.0" and float(rows[0]["grad_norm"]) > 0


def test_a_resumed_run_continues_its_metrics_files(tmp_path):
    jsonl, csv_path = tmp_path / "metrics.jsonl", tmp_path / "metrics.csv"
    batches = token_batches(3, 8)
    first = engine.initialize(TinyLM(), config(jsonl=str(jsonl), csv=str(csv_path)))
    for batch in batches[:2]:
        first.train_batch(batch, token_loss_sum)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    resumed = engine.initialize(TinyLM(), config(jsonl=str(jsonl), csv=str(csv_path)))
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.train_batch(batches[2], token_loss_sum)
    resumed.close()
    assert [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] == [1, 2, 3]
    assert [int(row["step"]) for row in csv.DictReader(csv_path.open())] == [1, 2, 3]
    assert resumed.monitor.history[-1]["grad_norm"] is not None


def test_missing_tensorboard_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    with pytest.warns(UserWarning, match="tensorboard package is not installed.*pip install tensorboard") as caught:
        eng = engine.initialize(mlp(), config(tensorboard=str(tmp_path / "tb"), jsonl=str(tmp_path / "m.jsonl")))
        for batch in regression_batches(3, 8):
            eng.train_batch(batch, mse)
    assert sum("tensorboard" in str(w.message) for w in caught) == 1
    assert len(eng.monitor.history) == 3
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
    eng.monitor.close()


# -- progress -------------------------------------------------------------------------------
def test_progress_lines_without_a_tty():
    stream = io.StringIO()
    eng = engine.initialize(mlp(), config(total_steps=4))
    eng.monitor = Monitor(MonitorConfig(enabled=True, total_steps=4), stream=stream).attach(eng)
    for batch in regression_batches(4, 8):
        eng.train_batch(batch, mse)
    eng.monitor.log_eval(4, 0.5)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 5 and "\r" not in stream.getvalue()
    assert lines[0].startswith("[") and "step 1/4" in lines[0] and "ETA" in lines[0]
    for part in ("loss ", "lr ", "samples/s", "/step"):
        assert part in lines[0]
    assert "ETA" not in lines[3]
    assert lines[4] == "eval step 4 | loss 0.5000"


def test_progress_updates_one_line_on_a_tty():
    stream = FakeTTY()
    eng = engine.initialize(TinyLM(), config())
    eng.monitor = Monitor(MonitorConfig(enabled=True), stream=stream).attach(eng)
    eng.monitor.total_steps = 3  # a script may set the total after the fact
    for batch in token_batches(2, 8):
        eng.train_batch(batch, token_loss_sum)
    text = stream.getvalue()
    assert text.count("\r") == 2 and "\n" not in text and "tok/s" in text
    eng.monitor.close()
    assert stream.getvalue().endswith("\n") and "step 2/3" in stream.getvalue()


def _progress_on_ranks(rank, world, tmp):
    model = TinyLM()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        eng = engine.initialize(model, config(progress=True, jsonl=f"{tmp}/metrics.jsonl"))
        losses = [eng.train_batch(rank_slice(batch, eng.plan), token_loss_sum)
                  for batch in token_batches(3, 8)]
        eng.monitor.close()
    return {"stderr": err.getvalue(), "history": eng.monitor.history, "losses": losses}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_progress_and_files_on_rank_zero_only(tmp_path):
    rank0, rank1 = run_distributed(_progress_on_ranks, 2, args=(str(tmp_path),))
    assert rank0["stderr"].count("step ") == 3 and "loss" in rank0["stderr"]
    assert rank1["stderr"] == "" and rank1["history"] == []
    assert [r["loss"] for r in rank0["history"]] == pytest.approx(rank0["losses"])
    assert rank0["losses"] == pytest.approx(rank1["losses"])  # the loss over all ranks
    batches = token_batches(3, 8)
    assert [r["tokens"] for r in rank0["history"]] == [int((b["labels"] != -100).sum()) for b in batches]
    assert [r["samples"] for r in rank0["history"]] == [8, 8, 8]
    for record in rank0["history"]:  # two devices share the run's tokens
        assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)
    assert "tok/s/device" in rank0["stderr"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


# -- gradient norm ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mean", "tokens"])
def test_grad_norm_is_the_full_batch_gradient_norm(kind):
    if kind == "mean":
        model, batches, loss_fn, reference_loss = mlp(), regression_batches(3, 11), mse, mse
    else:
        model, batches, loss_fn, reference_loss = TinyLM(), token_batches(3, 11), token_loss_sum, token_loss_mean
    expected = reference_norms(model, batches, reference_loss)
    # Unequal micro-batches (4, 4, 3) and a clip that does not bind.
    eng = engine.initialize(copy.deepcopy(model), {**config(11, 4), "batch_split": "balanced",
                                                   "gradient_clipping": 1e6})
    assert eng.plan.micro_batch_sizes == (4, 4, 3)
    for batch in batches:
        eng.train_batch(batch, loss_fn)
    assert [r["grad_norm"] for r in eng.monitor.history] == pytest.approx(expected, rel=1e-10)


def test_grad_norm_can_be_turned_off():
    eng = engine.initialize(mlp(), config(grad_norm=False))
    eng.train_batch(regression_batches(1, 8)[0], mse)
    assert eng.monitor.history[0]["grad_norm"] is None
    assert eng.last_window.step.grad_norm is None


def _grad_norms(rank, world, stage, defer=False):
    model, batches = TinyLM(), token_batches(3, 8)
    cfg = config(stage=stage)
    if stage >= 2:
        cfg["zero_optimization"]["defer_reduction"] = defer
    eng = engine.initialize(copy.deepcopy(model), cfg)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), token_loss_sum)
    return [float(eng.last_window.step.grad_norm)] + [r["grad_norm"] for r in eng.monitor.history]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_grad_norm_on_two_ranks_equals_the_full_batch_norm():
    """Every stage, both defer settings at ZeRO-2/3, in one set of ranks."""
    expected = reference_norms(TinyLM(), token_batches(3, 8), token_loss_mean)
    settings = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]
    results = run_scenarios({setting: functools.partial(_grad_norms, stage=setting[0], defer=setting[1])
                             for setting in settings}, world_size=2, timeout=100)
    for setting, (rank0, rank1) in results.items():
        assert rank0[1:] == pytest.approx(expected, rel=1e-10), setting
        assert rank1[0] == pytest.approx(rank0[0], rel=1e-12), setting  # the same norm on every rank
        assert rank1[1:] == [], setting  # rank 1 keeps no history
