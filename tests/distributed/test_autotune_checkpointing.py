"""``activation_checkpointing: auto``: the micro-size tuner chooses checkpointing on or off by
measurement (``explore``) or before halving (``auto``), every rank the same; the training
equals the float64 full-batch reference whatever it chose."""

import copy
import dataclasses
import functools
import json
import logging
import warnings

import pytest
import torch

import engine
from bench.model_transforms import lm, lm_loss, saved_activation_bytes, tokens
from engine.autotune.report import format_table, save_json, save_plot
from engine.config.deepspeed import deepspeed_config
from engine.config.schema import load_config
from engine.config.torch_features import without_our_keys
from tests.support.broken import checkpointing_switch_ignored
from tests.support.dist_utils import run_scenarios
from tests.support.oom_models import Block, BlockMLP
from tests.support.scenarios import needs_deepspeed
from tests.support.lm_models import TinyCausalLM, lm_batches, loss_sum_and_count, token_mean
from tests.support.reference import max_param_diff, mse, rank_slice, reference_train, regression_batches, state

TOL = 1e-10
# virtual seconds per block forward: 0.02 + 0.00005·rows² (a recomputed forward costs it again)
COST = dict(overhead=0.02, per_square=0.00005)


def plain_sgd(params):
    """No optimizer state: a micro-step's peak is the same at every step."""
    return torch.optim.SGD(params, lr=0.1)


def tuned(model, mode="auto", limit=None, **extra):
    """``model`` (a BlockMLP) under ``mode`` with ``activation_checkpointing: auto``."""
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": mode, "activation_checkpointing": "auto",
              **({"auto_memory_limit": float(limit)} if limit else {}), **extra}
    eng = engine.initialize(model, config, optimizer=plain_sgd)
    eng.micro_batch_tuner.clock = model.clock  # explore timed by the blocks' virtual clock
    return eng


def train(eng, batches):
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)


def measured_peaks(**extra) -> dict[tuple[int, bool], int]:
    """{(micro size, checkpointing): peak bytes} as explore measures them without a limit."""
    eng = tuned(BlockMLP(**COST), "explore", **extra)
    train(eng, regression_batches(1, 16))
    return {(row.micro_batch_size, row.checkpointing): row.peak_memory_bytes for row in eng.micro_batch_tuner.explored}


# -- the config -----------------------------------------------------------------------------------
def test_auto_needs_the_automatic_micro_size_and_both_spellings_are_one_request():
    for section in ("auto", {"enabled": "auto", "every": 2}):
        with pytest.raises(engine.ConfigError, match="activation_checkpointing.enabled: auto is chosen by the "
                                                     "automatic micro-batch size.*train_micro_batch_size_per_gpu: auto"):
            engine.initialize(BlockMLP(), {"train_batch_size": 16, "activation_checkpointing": section},
                              optimizer=plain_sgd)
    eng = tuned(BlockMLP(), activation_checkpointing={"enabled": "auto", "every": 2})
    assert eng.strategy.capabilities().checkpoint_switch is eng.micro_batch_tuner.switch
    assert not eng.micro_batch_tuner.checkpointing
    with pytest.raises(engine.ConfigError, match="activation_checkpointing.enabled: expected true, false or auto"):
        tuned(BlockMLP(), activation_checkpointing={"enabled": "sometimes"})
    with pytest.raises(engine.ConfigError, match="enabled: auto is not available under a pipeline of 2 stages"):
        engine.initialize(BlockMLP(), {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                       "pipeline": {"stages": 2}, "activation_checkpointing": "auto"},
                          optimizer=plain_sgd)


def test_deepspeed_gets_neither_spelling():
    for section, left in (("auto", None), ({"enabled": "auto", "cpu_checkpointing": True}, {"cpu_checkpointing": True})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                                  "activation_checkpointing": section})
        # DeepSpeed's own key is named as unused on the torch backend, Microstep's auto is not
        assert [("cpu_checkpointing configure DeepSpeed" in str(w.message)) for w in caught] == ([True] if left else [])
        assert without_our_keys(config.deepspeed_extras).get("activation_checkpointing") == left
        assert deepspeed_config(config, 1).get("activation_checkpointing") == left


# -- the switch ------------------------------------------------------------------------------------
def test_the_switch_checkpoints_between_windows_and_changes_no_gradient():
    """One engine, checkpointing flipped between windows (dropout included): the parameters of
    a run without checkpointing; saved activations drop while it is on."""
    model, batch = lm(layers=2, width=32, dropout=0.2), tokens(8, 24)
    runs = {}
    for name, section in (("without", {"enabled": False}), ("switched", "auto")):
        eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                                                       "activation_checkpointing": section},
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
        saved = []
        for window in range(4):
            if eng.strategy.capabilities().checkpoint_switch is not None:
                eng.strategy.capabilities().checkpoint_switch.on = window % 2 == 1
            saved.append(saved_activation_bytes(eng.module, eng.module, batch[:2]))
            eng.module.zero_grad(set_to_none=True)
            torch.manual_seed(window)  # the same dropout draws in both runs
            eng.train_batch(batch, lm_loss)
        runs[name] = (state(eng.module), saved)
    assert max_param_diff(runs["switched"][0], runs["without"][0]) < 1e-6  # measured 0
    off, on = runs["switched"][1][0], runs["switched"][1][1]
    assert on < 0.5 * off and runs["switched"][1][2] == off == runs["without"][1][0], runs


@pytest.mark.timeout(300)
def test_compiled_switchable_blocks_equal_eager_with_one_graph_per_position():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, batch = lm(layers=2, width=32), tokens(8, 16)
    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"compile": {"enabled": True, "backend": "aot_eager"}})):
        eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                                                       "activation_checkpointing": "auto", **extra},
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
        for window in range(4):
            eng.strategy.capabilities().checkpoint_switch.on = window % 2 == 1
            eng.train_batch(batch, lm_loss)
        runs[name] = state(eng.module)
    # both blocks share a graph per switch position; flipping back recompiles nothing
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert max_param_diff(runs["compiled"], runs["eager"]) < 1e-6


# -- auto -----------------------------------------------------------------------------------------
def test_auto_turns_checkpointing_on_instead_of_halving_when_that_fits(caplog):
    peaks = measured_peaks()
    assert peaks[(16, True)] < peaks[(8, False)] < peaks[(16, False)]
    limit = (peaks[(16, True)] + peaks[(8, False)]) // 2  # 16 fits only with checkpointing
    batches = regression_batches(3, 16)
    expected = reference_train(BlockMLP(), batches, mse, plain_sgd)
    eng = tuned(BlockMLP(), limit=limit)
    with caplog.at_level(logging.WARNING, logger="engine"):
        train(eng, batches)
    tuner = eng.micro_batch_tuner
    assert (eng.plan.train_micro_batch_size_per_gpu, tuner.checkpointing) == (16, True)
    assert tuner.changes == [{"global_step": 1, "old": 16, "new": 16, "ranks": [0], "reason": "memory limit exceeded",
                              "checkpointing": True}]
    assert "micro-batch size 16 kept, activation checkpointing on (memory limit exceeded on rank(s) 0" in caplog.text
    assert max_param_diff(state(eng.module), state(expected)) < TOL

    # broken: the switch turned on in name only: the blocks keep everything, the size halves
    # down to 4 (8 without checkpointing does not fit either)
    broken = checkpointing_switch_ignored(tuned(BlockMLP(), limit=limit))
    train(broken, batches)
    assert broken.plan.train_micro_batch_size_per_gpu == 4


def test_auto_walks_size_off_then_on_down_the_sizes():
    peaks = measured_peaks()
    assert peaks[(8, True)] < peaks[(16, True)] < peaks[(8, False)]
    limit = (peaks[(8, True)] + peaks[(16, True)]) // 2  # only 8 with checkpointing (or smaller) fits
    batches = regression_batches(2, 16)
    eng = tuned(BlockMLP(), limit=limit)
    train(eng, batches)
    assert [(c["old"], c["new"], c["checkpointing"]) for c in eng.micro_batch_tuner.changes] == [
        (16, 16, True), (16, 8, False), (8, 8, True)]
    assert (eng.plan.train_micro_batch_size_per_gpu, eng.micro_batch_tuner.checkpointing) == (8, True)
    assert max_param_diff(state(eng.module), state(reference_train(BlockMLP(), batches, mse, plain_sgd))) < TOL


def test_the_choice_survives_a_checkpoint(tmp_path):
    peaks = measured_peaks()
    limit = (peaks[(16, True)] + peaks[(8, False)]) // 2
    batches = regression_batches(3, 16)
    eng = tuned(BlockMLP(), limit=limit)
    train(eng, batches[:2])
    eng.save_checkpoint(tmp_path / "ckpt")
    resumed = tuned(BlockMLP(), limit=limit)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.micro_batch_tuner.checkpointing is True and resumed.strategy.capabilities().checkpoint_switch.on
    train(resumed, batches[2:])
    assert resumed.micro_batch_tuner.changes == eng.micro_batch_tuner.changes  # no failed window after resuming
    assert max_param_diff(state(resumed.module), state(reference_train(BlockMLP(), batches, mse, plain_sgd))) < TOL


class BlockLM(TinyCausalLM):
    """TinyCausalLM with a residual Block of width 64 on its running means: something to checkpoint."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(6, 64), Block(6, 64)])
        self.double()

    def forward(self, input_ids, attention_mask):
        h = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1]))
        h = h.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)[:, None]
        for block in self.blocks:
            h = block(h)
        return self.head(torch.tanh(h))


def test_a_token_budget_is_kept_with_checkpointing_too():
    """micro_batch_tokens under auto: the budget is the size; checkpointing comes before halving it."""
    def token_engine(mode, limit=None):
        config = {"train_batch_size": 8, "micro_batch_tokens": 64, "train_micro_batch_size_per_gpu": mode,
                  "activation_checkpointing": "auto", **({"auto_memory_limit": float(limit)} if limit else {})}
        eng = engine.initialize(BlockLM(), config, optimizer=plain_sgd, loss_fn=loss_sum_and_count)
        eng.micro_batch_tuner.warmup, eng.micro_batch_tuner.repeats = 0, 1
        return eng

    batches = lm_batches()
    probe = token_engine("explore")
    probe.train_batch(batches[0])
    peaks = {(row.micro_batch_tokens, row.checkpointing): row.peak_memory_bytes for row in probe.micro_batch_tuner.explored}
    assert peaks[(64, True)] < peaks[(32, False)], peaks
    eng = token_engine("auto", (peaks[(64, True)] + peaks[(32, False)]) // 2)  # 64 fits only with checkpointing
    for batch in batches:
        eng.train_batch(batch)
    assert (eng.plan.micro_batch_tokens, eng.micro_batch_tuner.checkpointing) == (64, True)
    assert [(c["old"], c["new"], c["checkpointing"]) for c in eng.micro_batch_tuner.changes] == [(64, 64, True)]
    assert max_param_diff(state(eng.module), state(reference_train(BlockLM(), batches, token_mean, plain_sgd))) < TOL


# -- explore --------------------------------------------------------------------------------------
def window_seconds(micro: int, checkpointing: bool) -> float:
    """16 rows in 16/micro micro-steps; 3 blocks, each forward run twice when checkpointed."""
    return 16 / micro * 3 * (2 if checkpointing else 1) * (COST["overhead"] + COST["per_square"] * micro ** 2)


@pytest.mark.parametrize("fits_without, chosen", [(4, (16, True)), (8, (8, False))])
def test_explore_measures_both_series_and_keeps_the_fastest_that_fits(fits_without, chosen):
    """The limit lets checkpointing-off fit up to ``fits_without`` rows; with it every size fits.
    (16, on) beats (4, off) by the clock; (8, off) beats (16, on)."""
    peaks = measured_peaks()
    limit = (peaks[(fits_without, False)] + peaks[(2 * fits_without, False)]) // 2
    assert peaks[(16, True)] < limit
    batches = regression_batches(2, 16)
    eng = tuned(BlockMLP(**COST), "explore", limit=limit)
    train(eng, batches)
    rows = eng.micro_batch_tuner.explored
    measured = [(m, c) for m in (1, 2, 4, 8, 16) for c in (False, True) if c or m <= 2 * fits_without]
    assert [(r.micro_batch_size, r.checkpointing) for r in rows] == measured
    assert [r.fits for r in rows] == [r.checkpointing or r.micro_batch_size <= fits_without for r in rows]
    fitting = [r for r in rows if r.fits]
    assert [r.samples_per_second for r in fitting] == pytest.approx(
        [16 / window_seconds(r.micro_batch_size, r.checkpointing) for r in fitting], rel=1e-9)
    assert [(r.micro_batch_size, r.checkpointing) for r in rows if r.recommended] == [chosen]
    assert (eng.plan.train_micro_batch_size_per_gpu, eng.micro_batch_tuner.checkpointing) == chosen
    assert max_param_diff(state(eng.module), state(reference_train(BlockMLP(), batches, mse, plain_sgd))) < TOL

    # broken: the limit ignored while choosing: the fastest of all, which does not fit
    broken = tuned(BlockMLP(**COST), "explore")
    train(broken, batches[:1])
    assert (broken.plan.train_micro_batch_size_per_gpu, broken.micro_batch_tuner.checkpointing) == (16, False)


def test_the_report_shows_both_series(tmp_path):
    peaks = measured_peaks()
    eng = tuned(BlockMLP(**COST), "explore", limit=(peaks[(4, False)] + peaks[(8, False)]) // 2)
    train(eng, regression_batches(1, 16))
    rows = eng.micro_batch_tuner.explored
    table = format_table(rows).splitlines()
    assert table[0].split()[:3] == ["micro", "checkpointing", "accum"]
    assert [line.split()[:2] for line in table[1:3]] == [["1", "off"], ["1", "on"]]
    assert "out of memory" in table[7] and "recommended" in table[-1] and table[-1].split()[:2] == ["16", "on"]
    saved = json.loads(save_json(rows, tmp_path / "explore.json").read_text())
    assert [c["checkpointing"] for c in saved["candidates"]] == [r.checkpointing for r in rows]
    plot = save_plot(rows, tmp_path / "explore.png")
    assert plot is None or plot.stat().st_size > 1000
    # without the lever the table is as before
    plain = [dataclasses.replace(row, checkpointing=None) for row in rows[::2]]
    assert format_table(plain).splitlines()[0].split()[:2] == ["micro", "accum"]


# -- two ranks ------------------------------------------------------------------------------------
def agreeing_ranks(rank, world, stage, mode, broken=False, backend="torch"):
    """8 rows per rank; the limit (the same on both ranks) lets 8 fit only with checkpointing, 4 without.
    DeepSpeed trains fp32 parameters (float64 is refused there)."""
    zero = {"zero_optimization": {"stage": stage}, "backend": backend}
    dtype = torch.float64 if backend == "torch" else torch.float32
    probe = tuned(BlockMLP(**COST).to(dtype), "explore", **zero)
    train(probe, regression_batches(1, 16, dtype=dtype))
    peaks = {(r.micro_batch_size, r.checkpointing): r.peak_memory_bytes for r in probe.micro_batch_tuner.explored}
    probe.close()
    # one limit for both ranks (their shards may differ in size)
    limit = torch.tensor([(max(peaks[(8, True)], peaks[(4, False)]) + peaks[(8, False)]) // 2])
    torch.distributed.all_reduce(limit, op=torch.distributed.ReduceOp.MAX)
    limit = int(limit)
    assert max(peaks[(8, True)], peaks[(4, False)]) < limit < peaks[(8, False)], (limit, peaks)
    exact = regression_batches(2, 16)
    batches = [(x.to(dtype), y.to(dtype)) for x, y in exact]
    eng = tuned(BlockMLP(**COST).to(dtype), mode, limit=limit, **zero)
    if broken:
        checkpointing_switch_ignored(eng, ranks=(1,))
    train(eng, batches)
    result = {"micro": eng.plan.train_micro_batch_size_per_gpu,
              "checkpointing": eng.strategy.capabilities().checkpoint_switch.on,
              "changes": eng.micro_batch_tuner.changes,
              "diff": max_param_diff(eng.full_state_dict(), state(reference_train(BlockMLP(), exact, mse, plain_sgd)))}
    eng.close()
    return result


def switched_under_zero3(rank, world):
    """ZeRO-3 (each block a shard unit, its checkpointed region inside), checkpointing flipped
    between windows, eager and compiled per block (aot_eager): (compiled vs eager, eager vs a
    run without checkpointing), largest parameter differences."""
    model, batch = lm(layers=2, width=32), tokens(8, 16)
    share = batch[4 * rank:4 * rank + 4]
    torch._dynamo.reset()
    runs = {}
    for name, extra in (("without", {"activation_checkpointing": {"enabled": False}}),
                        ("eager", {"activation_checkpointing": "auto"}),
                        ("compiled", {"activation_checkpointing": "auto",
                                      "compile": {"enabled": True, "backend": "aot_eager"}})):
        config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3},
                  **extra}
        eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
        for window in range(4):
            if eng.strategy.capabilities().checkpoint_switch is not None:
                eng.strategy.capabilities().checkpoint_switch.on = window % 2 == 1
            eng.train_batch(share, lm_loss)
        runs[name] = eng.full_state_dict()
        eng.close()
    return max_param_diff(runs["compiled"], runs["eager"]), max_param_diff(runs["eager"], runs["without"])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ranks_agree_on_the_choice_at_zero_stages_0_and_3():
    scenarios = {(stage, mode): functools.partial(agreeing_ranks, stage=stage, mode=mode)
                 for stage in (0, 3) for mode in ("auto", "explore")}
    scenarios["broken"] = functools.partial(agreeing_ranks, stage=0, mode="auto", broken=True)
    scenarios["zero3, compiled"] = switched_under_zero3
    results = run_scenarios(scenarios, world_size=2, timeout=260)
    for compiled_vs_eager, eager_vs_without in results.pop("zero3, compiled"):
        assert compiled_vs_eager < 1e-6 and eager_vs_without < 1e-6, (compiled_vs_eager, eager_vs_without)
    broken = results.pop("broken")
    for (stage, mode), (first, second) in results.items():
        assert first["diff"] < TOL and second["diff"] < TOL, (stage, mode, first, second)
        # auto keeps 8 with checkpointing; explore measured 4 without it faster (3 · 0.1248 s vs 0.1392 s)
        chosen = (8, True) if mode == "auto" else (4, False)
        assert (first["micro"], first["checkpointing"]) == chosen == (second["micro"], second["checkpointing"]), stage
        assert first["changes"] == second["changes"], (stage, mode)
    # checkpointing on rank 0 only: rank 1 still breaches the limit and both ranks halve (and word
    # the change alike, though only rank 1 measured the breach)
    assert [result["micro"] for result in broken] == [4, 4]
    assert broken[0]["changes"] == broken[1]["changes"]
    assert (broken[0]["changes"][-1]["ranks"], broken[0]["changes"][-1]["reason"]) == ([1], "memory limit exceeded")


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ranks_agree_on_the_backend_deepspeed_too():
    """Microstep wraps the blocks before deepspeed.initialize: the same switch, fp32 (to rounding)."""
    (first, second), = run_scenarios({"auto": functools.partial(agreeing_ranks, stage=0, mode="auto",
                                                                 backend="deepspeed")},
                                     world_size=2, timeout=200).values()
    assert (first["micro"], first["checkpointing"]) == (8, True) == (second["micro"], second["checkpointing"])
    assert first["changes"] == second["changes"] and max(first["diff"], second["diff"]) < 1e-5
