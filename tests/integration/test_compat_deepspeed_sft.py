"""examples/deepspeed_sft.py, a DeepSpeed-Chat-style supervised fine-tuning script (a Hugging Face
causal LM, right-padded rows labelled -100 at the padding, FusedAdam on weight-decay groups, a cosine
schedule, accumulation 2, clipping 1.0, its own ZeRO-3 save), launched by ``python -m launch`` on two
processes with DeepSpeed and accelerate absent: at ZeRO 0, ZeRO 3 and ZeRO 3 with ``--offload``
(``DeepSpeedCPUAdam``, the optimizer on the host) the model it saves loads with
``weights_only=True`` into the Hugging Face model and equals float64 plain PyTorch on each whole
global batch. The control is the same file with DeepSpeed's import lines, run with DeepSpeed 0.19 (ZeRO 0) on two
gloo ranks that receive ``--local_rank`` as under the deepspeed launcher (tests/support/dist_utils.py's
ranks, which spare the launcher's start-up): it averages the micro-batches' token means and misses."""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from examples.deepspeed_sft import WEIGHTS_NAME, optimizer_grouped_parameters, parse_args, synthetic_rows
from tests.support import absent
from tests.support.absent import finish
from tests.support.dist_utils import run_distributed
from tests.support.deepspeed_facade_checks import tiny_llama

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "deepspeed_sft.py"
WORLD = 2
TOL = 1e-6  # fp32 training against the float64 reference (measured 2.2e-7)
MISS = 1e-3  # DeepSpeed's mean of micro-batch means (measured 7.2e-2)


def deepspeed_imports(source: str) -> str:
    """The script before its migration: DeepSpeed's (and transformers') import lines."""
    lines = []
    for line in source.splitlines():
        if line.startswith(("import ", "from ")) and "engine.compat.deepspeed" in line:
            line = line.split("  # was:")[0]
            line = line.replace("engine.compat.deepspeed.hf", "transformers.integrations.deepspeed")
            line = line.replace("import engine.compat.deepspeed as deepspeed", "import deepspeed")
            line = line.replace("engine.compat.deepspeed", "deepspeed")
        lines.append(line)
    return "\n".join(lines) + "\n"


def reference(model_dir: Path) -> dict[str, torch.Tensor]:
    """The script's run in plain PyTorch and float64: each optimizer step on the whole global batch
    (the micro-batches of both ranks' DistributedSamplers in that window), the same optimizer,
    schedule and clipping."""
    from transformers import AutoModelForCausalLM, default_data_collator, get_scheduler

    args = parse_args(["--model_name_or_path", str(model_dir)])
    model = AutoModelForCausalLM.from_pretrained(model_dir).double()
    rows = synthetic_rows(args.num_samples, args.max_seq_len, model.config.vocab_size, args.data_seed)
    loaders = [list(DataLoader(rows, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size,
                               sampler=DistributedSampler(rows, num_replicas=WORLD, rank=rank)))
               for rank in range(WORLD)]
    accumulation = args.gradient_accumulation_steps
    steps = math.ceil(len(loaders[0]) / accumulation)
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate,
                                  betas=(0.9, 0.95), eps=1e-8)
    scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=args.num_train_epochs * steps)
    for _ in range(args.num_train_epochs):  # the script never calls set_epoch: each epoch has the same order
        for step in range(steps):
            window = [micro for loader in loaders for micro in loader[step * accumulation:(step + 1) * accumulation]]
            batch = {key: torch.cat([micro[key] for micro in window]) for key in window[0]}
            optimizer.zero_grad()
            model(**batch, use_cache=False).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
    return model.state_dict()


def launch(script: Path, out: Path, env: dict, *script_args: str) -> subprocess.Popen:
    """``python -m launch --nproc-per-node 2 script ...`` started; :func:`finish` waits for it."""
    return subprocess.Popen([sys.executable, "-m", "launch", "--nproc-per-node", str(WORLD), str(script),
                             "--model_name_or_path", str(out.parent / "model"), "--output_dir", str(out),
                             *script_args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_script(rank: int, world_size: int, path: str, argv: list[str]) -> None:
    """The script at ``path`` on this rank, given ``--local_rank`` as the deepspeed launcher gives it."""
    spec = importlib.util.spec_from_file_location("deepspeed_sft_control", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([f"--local_rank={rank}", *argv])


def saved_distance(out: Path, expected: dict[str, torch.Tensor]) -> float:
    """Load the saved file as from_pretrained would (weights only, strict) and measure it."""
    state = torch.load(out / WEIGHTS_NAME, weights_only=True)
    model = tiny_llama()
    model.load_state_dict(state)
    return max(float((value.double() - expected[name]).abs().max()) for name, value in model.state_dict().items())


@pytest.mark.timeout(600)
def test_sft_script_with_only_its_imports_changed_is_exact_at_zero_0_and_3_without_deepspeed(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "model")
    expected = reference(tmp_path / "model")
    source = SCRIPT.read_text()
    original = deepspeed_imports(source)
    changed = [line for line, before in zip(source.splitlines(), original.splitlines()) if line != before]
    assert len(source.splitlines()) == len(original.splitlines())
    assert len(changed) == 5 and all(line.startswith(("import ", "from ")) for line in changed), changed
    control = tmp_path / "deepspeed_sft.py"
    control.write_text(original)

    # Both launches and the control at once: their processes mostly wait on imports.
    without_deepspeed = absent.environment(("deepspeed", "accelerate"))
    runs = {"zero0": ["--zero_stage", "0"], "zero3": ["--zero_stage", "3"],
            "zero3-offload": ["--zero_stage", "3", "--offload"]}  # --offload: DeepSpeedCPUAdam, offload_optimizer
    launches = {name: launch(SCRIPT, tmp_path / name, without_deepspeed, *args) for name, args in runs.items()}
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    run_distributed(run_script, WORLD, timeout=240, env={"TORCH_EXTENSIONS_DIR": extensions},
                    args=(str(control), ["--model_name_or_path", str(tmp_path / "model"), "--zero_stage", "0",
                                         "--output_dir", str(tmp_path / "deepspeed_zero0")]))
    for name, process in launches.items():
        assert "epoch 2/2: eval loss" in finish(process), name  # tput_timer.update_epoch_count() after each epoch
        assert saved_distance(tmp_path / name, expected) < TOL, name
    assert saved_distance(tmp_path / "deepspeed_zero0", expected) > MISS
