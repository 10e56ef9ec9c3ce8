"""engine.compat.transformers: a Hugging Face Trainer script with its import line changed trains the whole
global batch's objective (float64 full-batch reference), where transformers' own Trainer, run beside it,
misses a mixture of experts' router term and the tokens of a model taking no loss kwargs; it saves a model
from_pretrained loads, resumes as if uninterrupted, evaluates, logs and calls back as transformers does,
and refuses what it cannot run."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from tests.support import hf_trainer as h
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, state

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from engine.compat.transformers import Trainer, TrainingArguments  # noqa: E402
from engine.errors import ConfigError  # noqa: E402


class Events(transformers.TrainerCallback):
    """Every callback event, in order."""

    def __init__(self):
        self.seen = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: object.__getattribute__(self, "seen").append(name)
        return object.__getattribute__(self, name)


def test_padded_rows_router_term_and_no_loss_kwargs_exact_on_one_process_where_transformers_misses(tmp_path):
    data = h.rows(16)
    for kind in ("dense", "moe"):
        expected = h.reference(kind, data, 4)
        door = h.train(Trainer, TrainingArguments, kind, data, str(tmp_path / kind))
        assert h.distance(door, expected) < h.TOL, kind
        # the loss logged is the global batch's: the first one is the reference's loss before any step
        net = h.model(kind)
        with torch.no_grad():
            first = net(**h.global_batches(data, 4)[0]).loss.item()
        assert door.state.log_history[0]["loss"] == pytest.approx(first, rel=1e-6)
        assert door.state.log_history[0]["grad_norm"] > 0
    for kind in ("moe", "no loss kwargs"):
        original = h.train(transformers.Trainer, transformers.TrainingArguments, kind, data, str(tmp_path / "hf"))
        assert h.distance(original, h.reference(kind, data, 4)) > h.MISSED, kind
    door = h.train(Trainer, TrainingArguments, "no loss kwargs", data, str(tmp_path / "no loss kwargs"))
    assert h.distance(door, h.reference("no loss kwargs", data, 4)) < h.TOL


def test_rows_packed_by_data_collator_with_flattening_exact_with_the_router_term(tmp_path):
    """Each micro-batch one row of its 2 documents (``DataCollatorWithFlattening``); the global batch's 4."""
    data = h.rows(16)
    door = h.train(Trainer, TrainingArguments, "moe", data, str(tmp_path / "door"), micro=2, accumulation=2,
                   collator=h.flattened)
    expected = h.reference("moe", data, 4, collator=h.flattened)
    assert h.distance(door, expected) < h.TOL
    original = h.train(transformers.Trainer, transformers.TrainingArguments, "moe", data, str(tmp_path / "hf"),
                       micro=2, accumulation=2, collator=h.flattened)
    assert h.distance(original, expected) > h.MISSED


def test_a_short_last_window_is_weighted_by_what_it_holds(tmp_path):
    """10 rows in windows of 4: the epoch's last window holds 2 micro-batches."""
    data = h.rows(10)
    door = h.train(Trainer, TrainingArguments, "moe", data, str(tmp_path), steps=-1, num_train_epochs=1)
    assert door.state.global_step == 3
    assert h.distance(door, h.reference("moe", data, 4, steps=3)) < h.TOL


def test_callback_events_fire_as_in_transformers(tmp_path):
    data = h.rows(12)
    seen = []
    for trainer_cls, args_cls in ((Trainer, TrainingArguments), (transformers.Trainer, transformers.TrainingArguments)):
        events = Events()
        net = h.model("dense")
        args = h.trainer_args(args_cls, str(tmp_path / args_cls.__module__), micro=1, accumulation=4, steps=3,
                              eval_strategy="steps", eval_steps=2)
        trainer_cls(model=net, args=args, train_dataset=data, eval_dataset=data[:4], data_collator=h.pad,
                    callbacks=[events]).train()
        seen.append([name for name in events.seen if name != "on_prediction_step"])
    assert seen[0] == seen[1]
    assert seen[0].count("on_substep_end") == 9 and seen[0].count("on_evaluate") == 2


def test_save_model_loads_with_from_pretrained_and_a_resumed_run_continues_as_if_uninterrupted(tmp_path):
    """transformers' own optimizer and schedule (AdamW, linear with warmup), shuffled data, a checkpoint
    at step 2 of 4: the resumed run ends where the uninterrupted one does."""
    data = h.rows(24)

    def run(out, resume=None):
        net = h.model("moe")
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=4, learning_rate=0.01, warmup_steps=1, weight_decay=0.1,
                                 save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                                 seed=3, disable_tqdm=True)
        trainer = Trainer(model=net, args=args, train_dataset=data, data_collator=h.pad)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(str(tmp_path / "whole"))
    resumed = run(str(tmp_path / "resumed"), resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert max_param_diff(h.trained_state(resumed), h.trained_state(whole)) < 1e-12
    assert resumed.state.log_history[-2]["loss"] == pytest.approx(whole.state.log_history[-2]["loss"], rel=1e-12)

    whole.save_model(str(tmp_path / "saved"))
    loaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float64,
                                                                experts_implementation="eager")
    assert max_param_diff(state(loaded), h.trained_state(whole)) == 0
    # evaluate() and predict() run on the trained model, as transformers' own evaluation of it does
    mine = whole.evaluate(data[:4])["eval_loss"]
    theirs = transformers.Trainer(model=loaded, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "eval"), report_to=[], use_cpu=True, per_device_eval_batch_size=8),
        data_collator=h.pad).evaluate(data[:4])["eval_loss"]
    assert mine == pytest.approx(theirs, rel=1e-12)
    assert whole.predict(data[:4]).metrics["test_loss"] == pytest.approx(mine, rel=1e-12)


@pytest.mark.parametrize("optim, built", [("adamw_torch_fused", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor")])
def test_the_optim_argument_builds_transformers_optimizer_which_the_engine_steps(tmp_path, optim, built):
    net = h.model("dense")
    args = h.trainer_args(TrainingArguments, str(tmp_path), micro=2, accumulation=2, steps=1, optim=optim,
                          lr_scheduler_type="cosine", warmup_steps=0)
    trainer = Trainer(model=net, args=args, train_dataset=h.rows(8), data_collator=h.pad)
    before = state(net)
    trainer.train()
    assert type(trainer.microstep_engine.optimizer).__name__ == built
    assert trainer.lr_scheduler is trainer.microstep_engine.lr_scheduler
    assert max_param_diff(h.trained_state(trainer), before) > 0


def test_bf16_is_the_engines_bf16_with_float32_master_weights(tmp_path):
    net = h.model("dense").float()
    args = h.trainer_args(TrainingArguments, str(tmp_path), micro=2, accumulation=2, steps=2, bf16=True)
    trainer = Trainer(model=net, args=args, train_dataset=h.rows(8), data_collator=h.pad)
    trainer.train()
    assert trainer.microstep_engine.config.bf16.enabled
    assert {p.dtype for p in trainer.microstep_engine.module.parameters()} == {torch.float32}
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)


class OwnStep(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("change, message", [
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor: the smoothed loss"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size: transformers halves the global batch"),
    ({"microstep": {"tensor_parallel": {"size": 2}}}, "tensor_parallel: 2: the Trainer's data loader"),
    ({"microstep": {"train_micro_batch_size_per_gpu": "auto"}}, "'auto': the Trainer's data loader forms"),
    ({"trainer": OwnStep}, "training_step is overridden by OwnStep"),
])
def test_what_the_door_cannot_run_is_refused_in_one_line(tmp_path, change, message):
    change = dict(change)
    trainer_cls = change.pop("trainer", Trainer)
    with pytest.raises(ConfigError, match=message):
        h.train(trainer_cls, TrainingArguments, "dense", h.rows(8), str(tmp_path), **change)


def test_a_deepspeed_json_is_read_with_its_auto_values_filled(tmp_path):
    deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
                 "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9}}}
    door = h.train(Trainer, TrainingArguments, "dense", h.rows(16), str(tmp_path), deepspeed=deepspeed,
                   max_grad_norm=1.0)
    config = door.microstep_engine.config
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps, config.train_batch_size,
            config.gradient_clipping, config.zero_optimization.stage) == (1, 4, 4, 1.0, 1)
    assert door.args.deepspeed is None  # transformers' own DeepSpeed integration stays off


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_processes_padded_rows_router_term_zero_3_saved_and_resumed(tmp_path):
    out = str(tmp_path)
    results = run_scenarios({
        "dense": functools.partial(h.door_against_reference, kind="dense", out=out),
        "moe": functools.partial(h.door_against_reference, kind="moe", out=out),
        "moe, transformers' own": functools.partial(h.original_against_reference, kind="moe", out=out),
        "moe, ZeRO 3": functools.partial(h.door_against_reference, kind="moe", out=out,
                                         microstep={"zero_optimization": {"stage": 3}}),
        "ZeRO 3 saved": functools.partial(h.saved_under_zero_3, out=out),
        "ZeRO 3 resumed": functools.partial(h.resumed_under_zero_3, out=out),
    }, world_size=2, timeout=200)
    for name in ("dense", "moe", "moe, ZeRO 3"):
        assert max(results[name]) < h.TOL, (name, results[name])
    assert min(results["moe, transformers' own"]) > h.MISSED
    assert [weights for weights, _ in results["ZeRO 3 saved"]] == [0.0, 0.0]
    assert max(evaluation for _, evaluation in results["ZeRO 3 saved"]) < 1e-12
    assert max(results["ZeRO 3 resumed"]) < 1e-12


def test_the_run_clm_shaped_example_trains_evaluates_saves_and_differs_from_its_original_import(tmp_path):
    """examples/hf_trainer_clm.py as written (the door) and with its import line put back to transformers':
    both run; the door's model is saved whole and loads; the original trains another model (it adds each
    micro-batch's router term)."""
    saved = {}
    for name, source in h.example_variants(tmp_path).items():
        out = tmp_path / name
        h.run_example(source, ["--output_dir", str(out), "--do_train", "--do_eval", "--max_steps", "3",
                               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                               "--max_train_samples", "32", "--report_to", "none", "--use_cpu", "--seed", "1",
                               "--train_file", h.CORPUS, "--block_size", "32", "--disable_tqdm", "true"])
        results = json.loads((out / "all_results.json").read_text())
        assert results["train_loss"] > 0 and math.isfinite(results["perplexity"])
        saved[name] = state(transformers.MixtralForCausalLM.from_pretrained(str(out)))
    assert max_param_diff(saved["door"], saved["original"]) > h.MISSED
