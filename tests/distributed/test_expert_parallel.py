"""Expert parallelism (engine.experts.parallel) against the float64 full-batch reference, the
load-balancing term on, with the broken variants the promise rules out."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import engine
from engine.config.setup import mesh_layout
from engine.experts.parallel import expert_count, find_expert_modules, hugging_face_patterns
from engine.memory import storage_bytes
from tests.support import broken
from tests.support.dist_utils import run_scenarios
from tests.support.moe_models import (VOCAB, StackedMoE, float64_term, full_batch_loss, hf_loss, hf_moe, lm_batches,
                              lm_sum_with_balance, stacked_mean_loss, stacked_sum_loss)
from tests.support.reference import max_param_diff, rank_slice, reference_train, sgd, state

pytest.importorskip("transformers")

# Hugging Face's .loss is read as its sum over the micro-batch's tokens (engine.window.model_loss):
# transformers' float32 cross entropy is then scaled by the count and by 1 / U where the full batch
# divides by U at once (measured 3.3e-9 after two steps); a broken variant misses by 1e-4 and more.
TOL = 1e-8
TOL_FLOAT32_ROUTER = 1e-8  # padded rows: Hugging Face's float32 router probabilities (tests/test_experts.py)
MISSES = 1e-7
STACKED = {"modules": ["blocks.*.experts"]}


def reference(model, batches, loss_fn, clip=0.0):
    with float64_term(model):
        return state(reference_train(model, batches, loss_fn, sgd, clip=clip))


def ep_engine(model, accumulation=2, expert=2, stage=0, **config):
    return engine.initialize(copy.deepcopy(model), {
        "train_batch_size": 8, "gradient_accumulation_steps": accumulation, "zero_optimization": {"stage": stage},
        "expert_parallel": {"size": expert, **config.pop("expert_parallel", {})}, **config}, optimizer=sgd)


def trained(model, batches, loss_fn, breaking=broken.intact, **settings):
    eng = breaking(ep_engine(model, **settings))
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), loss_fn)
    return eng


def differences(model, batches, loss_fn, expected, variants, **settings) -> dict:
    results = {}
    for name, breaking in variants:
        eng = trained(model, batches, loss_fn, breaking, **settings)
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        eng.close()
    return results


def uneven_batches() -> list[dict]:
    """Padded rows; step 1: rank 0's rows (the first half) route to experts 0 and 1 only, so rank 0
    sends nothing to rank 1; step 2: every row does, so experts 2 and 3 get no token at all."""
    batches = lm_batches(2, 8, padded=True, seed=5)
    batches[0]["input_ids"][:4] %= VOCAB // 2
    batches[1]["input_ids"] %= VOCAB // 2
    for batch in batches:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batches


# -- two ranks: expert 2 ---------------------------------------------------------------------------
def hugging_face_scenario(rank, world, kind, stage, accumulation):
    model, batches = hf_moe(kind), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    eng = ep_engine(model, accumulation, stage=stage)
    experts = eng.module.model.layers[0].mlp.experts
    # parameter bytes this rank holds, counted: at ZeRO 0 / 1 the dense part whole and half the experts
    whole = storage_bytes(list(model.parameters()))
    half_the_experts = storage_bytes([p for name, p in model.named_parameters() if ".experts." in name]) // 2
    held = storage_bytes(list(eng.module.parameters()))
    local = (tuple(experts.gate_up_proj.shape), experts.num_experts, held == whole - half_the_experts or stage > 1,
             type(eng.strategy).__name__)
    # evaluation (no gradients) dispatches too: the same loss as every rank holding every expert
    evaluated = eng.eval_batch(rank_slice(batches[0], eng.plan), hf_loss)
    eng.close()
    whole_experts = ep_engine(model, accumulation, expert=1, stage=stage)
    local += (abs(evaluated - whole_experts.eval_batch(rank_slice(batches[0], whole_experts.plan), hf_loss)),)
    whole_experts.close()
    return local, differences(model, batches, hf_loss, expected,
                              [("exact", broken.intact), ("averaged", broken.experts_averaged_over_the_expert_group),
                               ("per micro-batch term", broken.moe_micro_batch_term)],
                              accumulation=accumulation, stage=stage)


def transformed_scenario(rank, world):
    """transformers' batched_mm experts implementation (the module's own forward runs, whichever it
    is); activation checkpointing and compile of the blocks around the dispatch."""
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    results = differences(model, batches, hf_loss, expected, [("checkpointed and compiled", broken.intact)],
                          activation_checkpointing={"enabled": True},
                          compile={"enabled": True, "backend": "aot_eager"})
    model.config._experts_implementation = "batched_mm"  # the config object every layer holds
    return results | differences(model, batches, hf_loss, expected, [("batched_mm", broken.intact)])


def clipping_scenario(rank, world):
    model, batches = hf_moe(), lm_batches(2, 8)
    clip = 0.05
    expected = reference(model, batches, hf_loss, clip=clip)
    results = differences(model, batches, hf_loss, expected,
                          [("exact", broken.intact), ("norm on every rank", broken.experts_norm_counted_on_every_rank)],
                          gradient_clipping=clip)
    eng = trained(model, batches[:1], hf_loss, gradient_clipping=clip)
    results["norm"] = float(eng.last_window.step.grad_norm)
    eng.close()
    return results


def uneven_scenario(rank, world):
    model, batches = StackedMoE(), uneven_batches()
    expected = state(reference_train(model, batches, stacked_mean_loss, sgd))
    results = differences(model, batches, stacked_sum_loss, expected,
                          [("exact", broken.intact), ("averaged", broken.experts_averaged_over_the_expert_group)],
                          stage=3, expert_parallel=STACKED)
    eng = trained(model, batches, stacked_sum_loss, expert_parallel=STACKED)
    results["exact at ZeRO 0"] = max_param_diff(eng.full_state_dict(), expected)
    results["load"] = eng.experts.last_load.per_expert().tolist()
    eng.close()
    return results


def padded_scenario(rank, world):
    model, batches = hf_moe(), lm_batches(2, 8, padded=True)
    coef = model.config.router_aux_loss_coef
    expected = reference(model, batches, full_batch_loss(coef))
    return differences(model, batches, lm_sum_with_balance(coef), expected,
                       [("exact", broken.intact), ("averaged", broken.experts_averaged_over_the_expert_group)],
                       stage=3)


def checkpoint_scenario(rank, world, root):
    """Saved after step 1 at one expert size, resumed at the other for step 2: the uninterrupted run."""
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    results = {}
    for name, (first, second) in {"2 -> 1": ((2, 0), (1, 3)), "1 -> 2": ((1, 0), (2, 3))}.items():
        path = os.path.join(root, name.replace(" ", ""))
        (expert, stage), (resumed_expert, resumed_stage) = first, second
        eng = trained(model, batches[:1], hf_loss, expert=expert, stage=stage)
        eng.save_checkpoint(path)
        eng.close()
        eng = ep_engine(hf_moe(seed=1), expert=resumed_expert, stage=resumed_stage)
        eng.load_checkpoint(path)
        eng.train_batch(rank_slice(batches[1], eng.plan), hf_loss)
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        eng.close()
    return results


def refusal_scenario(rank, world):
    refused = {}
    for name, model, settings in [("three experts", StackedMoE(experts=3), STACKED),
                                  ("no experts", torch.nn.Linear(2, 2), {}),
                                  ("patterns match nothing", StackedMoE(), {"modules": ["layers.*.mlp"]})]:
        try:
            ep_engine(model, expert_parallel=settings)
        except engine.ConfigError as error:
            refused[name] = str(error)
    return refused


def example_scenario(rank, world):
    from examples import moe
    return moe.main(["--set", "expert_parallel.size=2"])["difference"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    scenarios = {
        ("mixtral", 0, 2): functools.partial(hugging_face_scenario, kind="mixtral", stage=0, accumulation=2),
        ("olmoe", 1, 4): functools.partial(hugging_face_scenario, kind="olmoe", stage=1, accumulation=4),
        ("qwen2_moe", 2, 2): functools.partial(hugging_face_scenario, kind="qwen2_moe", stage=2, accumulation=2),
        "clipping": clipping_scenario, "uneven": uneven_scenario, "padded": padded_scenario,
        "checkpoint": functools.partial(checkpoint_scenario, root=str(tmp_path_factory.mktemp("ep"))),
        "refusals": refusal_scenario, "example": example_scenario, "transformed": transformed_scenario,
    }
    return run_scenarios(scenarios, world_size=2, timeout=400)


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind, stage, accumulation", [("mixtral", 0, 2), ("olmoe", 1, 4), ("qwen2_moe", 2, 2)])
def test_expert_2_on_2_ranks_equals_the_full_batch(two_ranks, kind, stage, accumulation):
    for rank, (local, result) in enumerate(two_ranks[(kind, stage, accumulation)]):
        assert local[1] == 2 and local[0][0] == 2, local  # this rank's 2 of the 4 experts
        assert local[2], "a rank holds the dense parameters and half the experts' bytes"
        assert local[3] == ("FullyShardedDataParallel" if stage > 1 else "DataParallel")  # experts beside DDP, FSDP2
        assert local[4] < 1e-12, local
        assert result["exact"] < TOL, (rank, result)
        assert result["averaged"] > MISSES, (rank, result)
        assert result["per micro-batch term"] > MISSES, (rank, result)  # the global balance still counts


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_another_experts_implementation_checkpointing_and_compile(two_ranks):
    for rank, result in enumerate(two_ranks["transformed"]):
        assert result["batched_mm"] < TOL and result["checkpointed and compiled"] < TOL, (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_clipping_counts_each_expert_slice_once(two_ranks):
    for rank, result in enumerate(two_ranks["clipping"]):
        assert result["norm"] > 0.05  # clipping is active
        assert result["exact"] < TOL, (rank, result)
        assert result["norm on every rank"] > MISSES, (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_uneven_tokens_per_expert_and_experts_without_tokens(two_ranks):
    """A model of one's own named by expert_parallel.modules; rank 0 sends rank 1 nothing in step 1,
    and no token reaches experts 2 and 3 in step 2; padded rows, (sum, count) loss, ZeRO 3 and 0."""
    for rank, result in enumerate(two_ranks["uneven"]):
        assert result["load"][2:] == [0, 0] and sum(result["load"]) > 0
        assert result["exact"] < TOL and result["exact at ZeRO 0"] < TOL, (rank, result)
        assert result["averaged"] > MISSES, (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_padded_rows_of_a_hugging_face_model(two_ranks):
    for rank, result in enumerate(two_ranks["padded"]):
        assert result["exact"] < TOL_FLOAT32_ROUTER, (rank, result)
        assert result["averaged"] > 1e3 * TOL_FLOAT32_ROUTER, (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_a_checkpoint_resumes_onto_another_expert_size(two_ranks):
    for rank, result in enumerate(two_ranks["checkpoint"]):
        assert result["2 -> 1"] < TOL, (rank, result)
        assert result["1 -> 2"] < TOL, (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_bad_input_is_refused_with_its_reason(two_ranks):
    for refused in two_ranks["refusals"]:
        assert "blocks.0.experts: its 3 experts do not divide over expert_parallel.size 2 (3 % 2 = 1)" \
            in refused["three experts"]
        assert "no module of experts found in Linear" in refused["no experts"]
        assert "expert_parallel.modules" in refused["no experts"]
        assert "expert_parallel.modules (layers.*.mlp) matches no module of StackedMoE" \
            in refused["patterns match nothing"]


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_the_example_with_its_experts_split_over_2_ranks(two_ranks):
    assert all(difference < TOL_FLOAT32_ROUTER for difference in two_ranks["example"])


# -- four ranks: expert 2 × data 2 ------------------------------------------------------------------
def four_ranks_scenario(rank, world, root):
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    results = differences(model, batches, hf_loss, expected,
                          [("exact", broken.intact), ("averaged", broken.experts_averaged_over_the_expert_group),
                           ("not over replicas", broken.experts_not_reduced_over_replicas)], stage=3)
    # saved by 2 expert groups holding the same slices, resumed with every rank holding every expert
    eng = trained(model, batches[:1], hf_loss, stage=1)
    eng.save_checkpoint(root)
    eng.close()
    eng = ep_engine(hf_moe(seed=1), expert=1, stage=3)
    eng.load_checkpoint(root)
    eng.train_batch(rank_slice(batches[1], eng.plan), hf_loss)
    results["resumed at expert 1"] = max_param_diff(eng.full_state_dict(), expected)
    eng.close()
    # tensor 2 × experts 2: attention split over the tensor pair, the experts (left whole by the tensor
    # plan) over the two data ranks of each tensor index; saved and resumed on 4 plain data ranks
    split = hf_moe(kv_heads=2)  # 2 key/value heads: one per tensor rank
    tensor = {"tensor_parallel": {"size": 2}}
    expected = reference(split, batches, hf_loss)
    results.update({f"tensor 2 {name}": value for name, value in differences(
        split, batches, hf_loss, expected, [("exact", broken.intact),
                                            ("averaged", broken.experts_averaged_over_the_expert_group)],
        stage=3, **tensor).items()})
    eng = trained(split, batches[:1], hf_loss, stage=3, **tensor)
    results["tensor 2 expert slice"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                           for p in eng.module.parameters()) / sum(p.numel() for p in split.parameters())
    eng.save_checkpoint(root + "-tensor")
    eng.close()
    eng = ep_engine(hf_moe(kv_heads=2, seed=1), expert=1, stage=0)
    eng.load_checkpoint(root + "-tensor")
    eng.train_batch(rank_slice(batches[1], eng.plan), hf_loss)
    results["tensor 2 resumed on data 4"] = max_param_diff(eng.full_state_dict(), expected)
    eng.close()
    # pipeline 2 × experts 2: each stage's experts split over its two data ranks, the router term of the
    # global batch (the stages' counts summed over the pipeline and data ranks before the first backward)
    pipeline = {"pipeline": {"stages": 2}}
    expected = reference(model, batches, hf_loss)
    results.update({f"pipeline 2 {name}": value for name, value in differences(
        model, batches, hf_loss, expected, [("exact", broken.intact),
                                            ("averaged", broken.experts_averaged_over_the_expert_group),
                                            ("weight without ranks", broken.moe_pipeline_weight_without_ranks)],
        stage=3, **pipeline).items()})
    eng = trained(model, batches[:1], hf_loss, stage=1, **pipeline)
    eng.save_checkpoint(root + "-pipeline")
    eng.close()
    eng = ep_engine(hf_moe(seed=1), expert=1, stage=0)
    eng.load_checkpoint(root + "-pipeline")
    eng.train_batch(rank_slice(batches[1], eng.plan), hf_loss)
    results["pipeline 2 resumed on data 4"] = max_param_diff(eng.full_state_dict(), expected)
    eng.close()
    return results


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_expert_2_by_data_2_by_tensor_2_and_by_pipeline_2_on_4_ranks(tmp_path):
    scenario = functools.partial(four_ranks_scenario, root=str(tmp_path / "expert2x2"))
    for rank, result in enumerate(run_scenarios({"four": scenario}, world_size=4, timeout=500)["four"]):
        assert result["exact"] < TOL, (rank, result)
        assert result["averaged"] > MISSES, (rank, result)
        assert result["not over replicas"] > MISSES, (rank, result)
        assert result["resumed at expert 1"] < TOL, (rank, result)
        assert result["tensor 2 exact"] < TOL and result["tensor 2 resumed on data 4"] < TOL, (rank, result)
        assert result["tensor 2 averaged"] > MISSES, (rank, result)
        assert result["tensor 2 expert slice"] < 0.5, (rank, result)  # half the heads, half the experts, ZeRO 3
        assert result["pipeline 2 exact"] < TOL and result["pipeline 2 resumed on data 4"] < TOL, (rank, result)
        assert result["pipeline 2 averaged"] > MISSES, (rank, result)
        assert result["pipeline 2 weight without ranks"] > MISSES, (rank, result)


def eight_ranks_scenario(rank, world):
    """Pipeline 2 × tensor 2 × data 2, experts split over the 2 data ranks of each (stage, tensor index),
    the global batch's router term (every stage's counts summed before the first backward: GPipe, whose
    own forwards count them; the 4-rank pipeline runs 1F1B's counting schedule), ZeRO 3, activation
    checkpointing, compiled blocks (aot_eager: the CPU's quick backend)."""
    split, batches = hf_moe(kv_heads=2), lm_batches(2, 8)
    expected = reference(split, batches, hf_loss)
    return differences(split, batches, hf_loss, expected,
                       [("exact", broken.intact), ("averaged", broken.experts_averaged_over_the_expert_group)],
                       stage=3, pipeline={"stages": 2, "schedule": "gpipe"}, tensor_parallel={"size": 2},
                       activation_checkpointing={"enabled": True}, compile={"enabled": True, "backend": "aot_eager"})


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_expert_2_by_pipeline_2_by_tensor_2_by_data_2_on_8_ranks():
    for rank, result in enumerate(run_scenarios({"eight": eight_ranks_scenario}, world_size=8, timeout=280)["eight"]):
        assert result["exact"] < TOL, (rank, result)
        assert result["averaged"] > MISSES, (rank, result)


# -- one process: finding experts, the config ------------------------------------------------------
def test_the_hugging_face_plan_names_the_experts():
    model = hf_moe()
    assert hugging_face_patterns(model) == ["model.layers.*.mlp.experts"]
    assert list(find_expert_modules(model, None)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert hugging_face_patterns(model.model) == ["layers.*.mlp.experts"]  # the base model itself
    assert list(find_expert_modules(StackedMoE(), ["blocks.*.experts"])) == ["blocks.0.experts", "blocks.1.experts"]
    assert expert_count("experts", model.model.layers[0].mlp.experts, 2) == 4
    with pytest.raises(engine.ConfigError, match=r"its 4 experts do not divide over expert_parallel.size 3 "
                                                 r"\(4 % 3 = 1\).*divisor of 4"):
        expert_count("experts", model.model.layers[0].mlp.experts, 3)
    block = model.model.layers[0].mlp
    with pytest.raises(engine.ConfigError, match="mlp .MixtralSparseMoeBlock. has no integer num_experts attribute"):
        expert_count("mlp", block, 2)
    block.num_experts = 4
    with pytest.raises(engine.ConfigError, match=r"does not hold its experts as parameters \[num_experts=4, ...\] of "
                                                 r"its own: gate.weight"):
        expert_count("mlp", block, 2)


def test_a_mistaken_module_name_gets_the_nearest_and_the_block_names_its_experts():
    model = hf_moe()
    with pytest.raises(engine.ConfigError, match=r"matches no module of MixtralForCausalLM; did you mean "
                                                 r"'model.layers.\*.mlp.experts'\?"):
        find_expert_modules(model, ["model.layers.*.mlp.expert"])
    with pytest.raises(engine.ConfigError, match=r"did you mean 'blocks.\*.experts'\?"):
        find_expert_modules(StackedMoE(), ["block.*.experts"])
    with pytest.raises(engine.ConfigError, match=r"model.layers.0.mlp \(MixtralSparseMoeBlock\) has no integer "
                                                 r"num_experts attribute: it is not a module of experts but holds "
                                                 r"model.layers.0.mlp.experts \(MixtralExperts\)"):
        expert_count("model.layers.0.mlp", model.model.layers[0].mlp, 2)


@pytest.mark.parametrize("world, context, fix", [
    (1, 1, "launch a multiple of 4 processes (python -m launch --nproc-per-node 4 ...), or set expert_parallel.size: 1"),
    (2, 1, "launch a multiple of 4 processes (python -m launch --nproc-per-node 4 ...), or use a divisor of 2"),
    (6, 1, "use a divisor of 6, or launch a multiple of 4 processes"),
    (2, 2, "launch a multiple of 4 processes"),
])
def test_an_expert_size_the_ranks_cannot_hold_says_how_many_processes_to_launch(world, context, fix):
    from engine.distributed.mesh import MeshLayout

    with pytest.raises(engine.ConfigError) as refused:
        MeshLayout(world, context=context, expert=4)
    assert fix in str(refused.value) and "divisor of 1" not in str(refused.value), str(refused.value)


@pytest.mark.filterwarnings("ignore:.*offload_param")
def test_what_expert_parallelism_does_not_compose_with_is_refused():
    from engine.config.checks import check_without_model
    base = {"train_batch_size": 8, "expert_parallel": {"size": 2}}
    assert check_without_model(engine.load_config(base)) == []
    for extra, reason in [({"backend": "deepspeed"}, "DeepSpeed's expert parallelism needs its own layer"),
                          ({"train_micro_batch_size_per_gpu": "auto"}, "leaves its expert group waiting")]:
        problems = check_without_model(engine.load_config({**base, **extra}))
        assert any(reason in problem for problem in problems), (extra, problems)
    # offload composes (tests/distributed/test_offload.py): the experts' slices stay on the device, said at setup
    assert check_without_model(engine.load_config(
        {**base, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})) == []
    assert engine.load_config({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 2}}
                              ).expert_parallel.size == 2


def test_the_mesh_names_the_expert_size(tmp_path, capsys):
    config = engine.load_config({"train_batch_size": 8, "expert_parallel": {"size": 2}})
    mesh = mesh_layout(config, 4)
    assert mesh.describe() == ("world 4 = pipeline 1 × data 4 × context 1 × tensor 1, experts over 2 of the "
                               "data × context ranks")
    assert [mesh.expert_index(rank) for rank in range(4)] == [0, 1, 0, 1]
    assert mesh.expert_layout() == [[[[0, 1], [2, 3]]]]  # expert groups {0, 1} and {2, 3}
    with pytest.raises(engine.ConfigError, match=r"expert_parallel.size 4 does not divide the data 2 × context 1"):
        mesh_layout(engine.load_config({"train_batch_size": 8, "expert_parallel": {"size": 4}}), 2)
    from engine.batching.mesh_plan import plan_for_mesh
    with pytest.raises(engine.BatchConfigError, match="experts over 2 of the data × context ranks"):
        plan_for_mesh(engine.load_config({"train_batch_size": 6, "expert_parallel": {"size": 2},
                                          "train_micro_batch_size_per_gpu": 4}), mesh)
    from engine.cli import main
    path = tmp_path / "ep.yaml"
    path.write_text("train_batch_size: 16\ntrain_micro_batch_size_per_gpu: 2\nexpert_parallel: {size: 2}\n")
    assert main(["plan", str(path), "--world-size", "4"]) == 0 and main(["validate", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "mesh: world 4 = pipeline 1 × data 4 × context 1 × tensor 1, experts over 2" in printed
    assert "expert parallel 2" in printed
