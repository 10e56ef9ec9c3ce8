"""Runs of Hugging Face's Trainer and TRL's SFTTrainer next to Microstep's doors, on tiny float64 models
and padded or packed rows, with their float64 full-batch references (tests/integration/test_compat_transformers.py,
test_compat_trl.py). Rows come as the data loader's collator pads them: each micro-batch to its own
longest row. transformers and TRL are imported inside the functions."""

from __future__ import annotations

import copy
import runpy
import shutil
from pathlib import Path

import torch

from tests.support import moe_models, own_loss
from tests.support.reference import max_param_diff, reference_train, sgd, state

# transformers takes the cross entropy (and the routers' term) in float32: the roundings of a run by
# micro-batches and of the whole batch differ below 1e-8 (tests/support/own_loss.py). A window weighted
# wrongly misses by 1e-4 and more.
REPO = Path(__file__).resolve().parents[2]
CORPUS = str(REPO / "examples" / "data" / "corpus.txt")
TOL = 1e-7
MISSED = 1e-4
VOCAB = 16
LENGTHS = [12, 2, 9, 3, 12, 5, 2, 10]  # real tokens per row: micro-batches of very different counts


def rows(count: int, seed: int = 5, lengths=LENGTHS) -> list[dict]:
    """``count`` unpadded rows ``{input_ids, labels}`` (labels = inputs: the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        ids = torch.randint(1, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def pad(features: list[dict]) -> dict:
    """The collator: right padding to the micro-batch's longest row (mask 0, label -100 there)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def global_batches(data: list[dict], global_batch: int, collator=pad) -> list[dict]:
    """The full-batch reference's batches: consecutive rows (sequential sampling), collated together."""
    return [collator(data[i:i + global_batch]) for i in range(0, len(data), global_batch)]


def model(kind: str) -> torch.nn.Module:
    """``dense``: a float64 Llama; ``moe``: a float64 Mixtral whose ``.loss`` holds its routers' term;
    ``no loss kwargs``: the Llama saying its forward takes no ``num_items_in_batch`` (as a model whose
    forward has no ``**kwargs``), for which transformers divides each micro-batch's mean by the accumulation."""
    if kind == "moe":
        return moe_models.hf_moe(coef=0.05)
    net = own_loss.model("causal")
    if kind == "no loss kwargs":
        net.accepts_loss_kwargs = False
    return net


def reference(kind: str, data: list[dict], global_batch: int, steps: int = 2, collator=pad) -> dict:
    """The plain model trained on its first ``steps`` whole global batches with its own ``.loss`` (SGD, momentum)."""
    net = model(kind)
    batches = global_batches(data, global_batch, collator)[:steps]
    with moe_models.float64_term(net) if kind == "moe" else _nothing():
        return state(reference_train(net, batches, own_loss.own_loss, sgd))


def trainer_args(args_cls, out: str, *, micro: int, accumulation: int, steps: int, **extra):
    """Arguments of a run whose only optimizer is the test's (constant rate, no clipping), data in order."""
    settings = dict(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                    max_steps=steps, learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0,
                    train_sampling_strategy="sequential", report_to=[], logging_steps=1, save_strategy="no",
                    use_cpu=True, seed=0, disable_tqdm=True)
    return args_cls(**{**settings, **extra})


def flattened(features: list[dict]) -> dict:
    """transformers' ``DataCollatorWithFlattening``: the rows end to end in one row, positions restarting
    per document, each document's first label -100; run without the cache, with which transformers would
    let attention cross the documents."""
    from transformers import DataCollatorWithFlattening

    return {**DataCollatorWithFlattening(return_tensors="pt")(features), "use_cache": False}


def train(trainer_cls, args_cls, kind: str, data: list[dict], out: str, *, micro: int = 1, accumulation: int = 4,
          steps: int = 2, collator=pad, **extra):
    """Train a fresh ``model(kind)`` with ``trainer_cls`` (transformers' or the door's); the trainer."""
    net = copy.deepcopy(model(kind))
    args = trainer_args(args_cls, out, micro=micro, accumulation=accumulation, steps=steps, **extra)
    trainer = trainer_cls(model=net, args=args, train_dataset=data, data_collator=collator,
                          optimizers=(sgd(net.parameters()), None))
    with moe_models.float64_term(net) if kind == "moe" else _nothing():
        trainer.train()
    return trainer


def trained_state(trainer) -> dict:
    eng = getattr(trainer, "microstep_engine", None)
    return eng.full_state_dict() if eng is not None else state(trainer.model)


def distance(trainer, expected: dict) -> float:
    return max_param_diff(trained_state(trainer), expected)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def door_against_reference(rank: int, world_size: int, kind: str, out: str, *, micro: int = 1,
                           accumulation: int = 2, microstep: dict | None = None) -> float:
    """The door's run on ``world_size`` ranks against the full-batch reference: its distance."""
    from engine.compat.transformers import Trainer, TrainingArguments

    data = rows(8 * world_size)
    extra = {"microstep": microstep} if microstep else {}
    trainer = train(Trainer, TrainingArguments, kind, data, out, micro=micro, accumulation=accumulation, **extra)
    return distance(trainer, reference(kind, data, micro * accumulation * world_size))


def original_against_reference(rank: int, world_size: int, kind: str, out: str, *, micro: int = 1,
                               accumulation: int = 2) -> float:
    """transformers' own Trainer on the same run: the control."""
    import transformers

    data = rows(8 * world_size)
    trainer = train(transformers.Trainer, transformers.TrainingArguments, kind, data, out, micro=micro,
                    accumulation=accumulation)
    return distance(trainer, reference(kind, data, micro * accumulation * world_size))


def saved_under_zero_3(rank: int, world_size: int, out: str) -> tuple[float, float]:
    """``save_model`` after a ZeRO 3 run: the folder ``from_pretrained`` loads holds the whole weights, and
    ``evaluate()`` on the sharded model agrees with transformers' own evaluation of the loaded one: the
    weights' distance and the evaluation losses' relative difference."""
    import torch.distributed as dist
    import transformers

    from engine.compat.transformers import Trainer, TrainingArguments

    data = rows(8 * world_size)
    trainer = train(Trainer, TrainingArguments, "moe", data, f"{out}/zero3", accumulation=2,
                    microstep={"zero_optimization": {"stage": 3}})
    trainer.save_model(f"{out}/zero3/saved")
    dist.barrier()
    loaded = transformers.MixtralForCausalLM.from_pretrained(f"{out}/zero3/saved", dtype=torch.float64,
                                                             experts_implementation="eager")
    mine = trainer.evaluate(data)["eval_loss"]
    theirs = transformers.Trainer(model=loaded, args=transformers.TrainingArguments(
        output_dir=f"{out}/zero3/eval", report_to=[], use_cpu=True), data_collator=pad).evaluate(data)["eval_loss"]
    return max_param_diff(state(loaded), trained_state(trainer)), abs(mine - theirs) / theirs


DOOR_IMPORT = "from engine.compat.transformers import Trainer, TrainingArguments"
ORIGINAL_IMPORT = "from transformers import Trainer, TrainingArguments"


def example_variants(where: Path, example: str = "hf_trainer_clm.py", door: str = DOOR_IMPORT,
                     original: str = ORIGINAL_IMPORT) -> dict[str, Path]:
    """``examples/<example>`` as written (``door``) and a copy whose import line is the library's own
    (``original``), beside the helper module it imports."""
    written = REPO / "examples" / example
    lines = written.read_text().splitlines(keepends=True)
    changed = [original + "\n" if line.startswith(door) else line for line in lines]
    assert changed != lines, f"{example} has no line starting with {door!r}"
    copy_dir = where / "original_script"
    copy_dir.mkdir()
    shutil.copy(REPO / "examples" / "hf_local.py", copy_dir)
    (copy_dir / example).write_text("".join(changed))
    return {"door": written, "original": copy_dir / example}


def run_example(path: Path, argv: list[str]) -> None:
    """The script's ``main(argv)`` in this process (imports already paid)."""
    runpy.run_path(str(path), run_name="example")["main"](argv)


def resumed_under_zero_3(rank: int, world_size: int, out: str) -> float:
    """A run of 4 steps checkpointed at step 2 (sharded, ZeRO 3, AdamW and a linear schedule, shuffled data)
    and the run resumed from that checkpoint: the distance between their final weights."""
    from engine.compat.transformers import Trainer, TrainingArguments

    data = rows(8 * world_size)

    def run(where: str, resume: str | None = None):
        args = TrainingArguments(output_dir=where, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                 max_steps=4, learning_rate=0.01, warmup_steps=1, save_strategy="steps",
                                 save_steps=2, report_to=[], use_cpu=True, seed=3, disable_tqdm=True,
                                 microstep={"zero_optimization": {"stage": 3}})
        trainer = Trainer(model=model("moe"), args=args, train_dataset=data, data_collator=pad)
        with moe_models.float64_term(trainer.model):
            trainer.train(resume_from_checkpoint=resume)
        return trained_state(trainer)

    whole = run(f"{out}/resume/whole")
    return max_param_diff(run(f"{out}/resume/resumed", resume=f"{out}/resume/whole/checkpoint-2"), whole)
