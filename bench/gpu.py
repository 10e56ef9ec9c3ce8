"""One command for a GPU machine: what only a GPU can show, at a size that fills it.

    python -m bench.gpu                         # CUDA: sized to the device; CPU: toy size
    python -m bench.gpu --toy --no-compile      # the quick CPU run tests/integration/test_bench_gpu.py makes
    python -m launch --nproc-per-node N bench/gpu.py   # several GPUs: every ZeRO stage

What it runs:

1. ``cuda tests``: the test suite's CUDA-only tests (``pytest -m cuda``); on CPU: skipped.
2. ``out of memory``: ``train_micro_batch_size_per_gpu: auto`` on a micro size that cannot fit
   (a real ``torch.OutOfMemoryError`` from filling the device): the run shrinks the micro size,
   recovers, and its parameters equal the same training with a micro size that fits. CUDA only.
3. ``throughput``: the engine against the same training written by hand (a plain accumulation
   loop; with several processes, ``fully_shard`` per block with the same mixed precision) on a
   Llama-style decoder (examples/gpt.py: pre-norm blocks, causal attention) in bf16 with
   activation checkpointing and ``torch.compile`` per block: tokens/s, MFU (6·N·tokens plus
   attention over the device's dense bf16 peak, where known), peak memory
   (``torch.cuda.max_memory_allocated``; on CPU the counted peak of bench/model_transforms.py),
   for each ZeRO stage (and ``defer_reduction`` setting at 2/3) the process count allows.
4. ``checkpointing choice``: ``explore`` with ``activation_checkpointing: auto`` on the same
   model (eager): each micro size with checkpointing off and on (a real out-of-memory where one
   does not fit), and which the tuner chose.

Writes ``gpu_<device>.json`` and ``gpu_<device>.md`` (a markdown table) into --out
(default bench/results/latest/; bench/results/ with --record).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import engine
from bench.common import add_record_argument, results_directory
from bench.model_transforms import lm, saved_activation_bytes, tokens
from engine.autotune.report import format_table
from engine.memory import held_bytes, storage_bytes

REPO = Path(__file__).resolve().parents[1]
# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def sizes(device: torch.device, toy: bool) -> dict:
    """Model and batch for the device: toy on CPU (or when asked), else about a tenth of the
    device's memory in parameters and optimizer state, long enough lines to need checkpointing."""
    if toy or device.type != "cuda":
        return {"layers": 2, "width": 64, "heads": 4, "time": 64, "micro": 4, "accumulation": 2}
    memory = torch.cuda.get_device_properties(device).total_memory
    width = 2048 if memory > 60e9 else 1024
    # heads of 128 channels: what flash attention kernels are built for
    return {"layers": 16 if memory > 60e9 else 8, "width": width, "heads": width // 128, "time": 2048, "micro": 8,
            "accumulation": 4}


def flops_per_token(model: torch.nn.Module, layers: int, width: int, time: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's 12·layers·width·time."""
    parameters = sum(p.numel() for p in model.parameters())
    return 6 * parameters + 12 * layers * width * time


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_BF16.items() if key in name), None)


def one_process() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def run_reported(section, *args) -> dict:
    """Run one part of the report. In one process a part that fails is reported as failed (its
    traceback printed) while the others still run: a GPU lease is too short to lose them. With
    several processes it raises: the other ranks would wait for this one in a collective."""
    try:
        return section(*args)
    except Exception as error:  # noqa: BLE001 - any failure is the finding
        if not one_process():
            raise
        traceback.print_exc()
        return {"status": f"failed: {type(error).__name__}: {error}"}


# -- 1. CUDA-only tests --------------------------------------------------------------------------
def cuda_tests(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"status": "skipped: no CUDA device"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "tests"], cwd=REPO,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode == 0:
        return {"status": "passed", "summary": result.stdout.strip().splitlines()[-1]}
    print(result.stdout[-6000:], result.stderr[-3000:], sep="\n")  # what failed, into the run's log
    return {"status": f"failed (exit {result.returncode})", "summary": (result.stdout + result.stderr)[-2000:]}


# -- 2. a real out-of-memory under auto --------------------------------------------------------
def out_of_memory(device: torch.device) -> dict:
    """Fill the device but for room enough for small micro-batches, train with ``auto`` starting
    at a micro size that cannot fit, and compare with a fixed micro size that does."""
    if device.type != "cuda":
        return {"status": "skipped: needs a CUDA device (a real allocator out-of-memory)"}
    width, rows = 1024, 65536
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(rows, width, device=device), torch.randn(rows, width, device=device))

    def mse(m, b):
        return F.mse_loss(m(b[0]), b[1])

    def sgd(p):
        return torch.optim.SGD(p, lr=0.5)

    # One small step first: the CUDA libraries (cuBLAS and its workspace, the kernels' code) take
    # device memory outside the allocator when first used, and must not find the device full.
    warm = copy.deepcopy(model).to(device)
    mse(warm, (batch[0][:8], batch[1][:8])).backward()
    del warm
    # A micro-step keeps about five rows x width fp32 tensors for backward (the linears' inputs, the
    # GELU's input, the output and its gradient): leave room for an eighth of the whole batch's.
    activations = 5 * rows * width * 4
    model_bytes = 3 * sum(p.numel() for p in model.parameters()) * 4  # weights, gradients, momentum-free SGD
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    ballast = torch.empty(max(0, free - model_bytes - activations // 8 - 512 * 2**20), dtype=torch.uint8,
                          device=device)
    config = {"train_batch_size": rows, "train_micro_batch_size_per_gpu": "auto", "auto_max": rows}
    try:
        eng = engine.initialize(copy.deepcopy(model), config, optimizer=sgd)
        eng.train_batch(batch, mse)
        changes = [(c["old"], c["new"]) for c in eng.micro_batch_tuner.changes]
        chosen = eng.plan.train_micro_batch_size_per_gpu
        auto = {k: v.detach().cpu() for k, v in eng.module.state_dict().items()}
        eng.close()
    finally:
        del ballast
        torch.cuda.empty_cache()
    fixed = engine.initialize(copy.deepcopy(model), {"train_batch_size": rows, "train_micro_batch_size_per_gpu": 1024},
                              optimizer=sgd)
    fixed.train_batch(batch, mse)
    expected = {k: v.detach().cpu() for k, v in fixed.module.state_dict().items()}
    fixed.close()
    # The update's error relative to its size (the two runs sum the window in different micro sizes).
    update = max(float((expected[k] - initial[k]).abs().max()) for k in auto)
    diff = max(float((auto[k] - expected[k]).abs().max()) for k in auto)
    recovered = bool(changes) and diff <= 1e-4 * update
    return {"status": "passed" if recovered else "failed", "shrinks": changes, "micro_size": chosen,
            "max_update": update, "max_param_diff": diff}


# -- 3. throughput ---------------------------------------------------------------------------------
def hand_loop(model, batch, micro: int, device: torch.device, compiled: bool):
    """The same training by hand: bf16 parameters (FSDP2's mixed precision when several
    processes run, a bf16 copy with fp32 masters otherwise), each block checkpointed and compiled."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = copy.deepcopy(model).to(device)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    compute = model if sharded else copy.deepcopy(model).to(torch.bfloat16)
    for block in compute.blocks:
        forward = block.forward

        def checkpointed(*args, _forward=forward):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False)

        block.forward = torch.compile(checkpointed) if compiled else checkpointed
    if sharded:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    masters = list(model.parameters())
    optimizer = torch.optim.AdamW(masters, lr=1e-4)
    micro_batches = batch.split(micro)

    def step():
        for micro_batch in micro_batches:
            (lm_loss(compute, micro_batch) / len(micro_batches)).backward()
        if compute is not model:
            for master, half in zip(masters, compute.parameters()):
                master.grad = half.grad.float()
                half.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if compute is not model:
            with torch.no_grad():
                for master, half in zip(masters, compute.parameters()):
                    half.copy_(master)

    return step


def timed(step, device: torch.device, steps: int) -> tuple[float, int]:
    """Seconds per step (after two warm-up steps that compile) and the peak bytes allocated."""
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    return seconds, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the throughput table."""

    stage: int
    defer: bool = False  # defer_reduction (ZeRO-2/3)
    checkpointing: bool = True
    precision: str = "bf16"  # the config key: bf16 or fp16


def release(device: torch.device) -> None:
    """Return what the last run held, so that the next one's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def throughput(device: torch.device, size: dict, compiled: bool, steps: int) -> list[dict]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = lm(size["layers"], size["width"], time=size["time"], heads=size["heads"])
    rows = size["micro"] * size["accumulation"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    batch = tokens(rows, size["time"] + 1, seed=rank).to(device)
    # One process also shows the run without checkpointing (the memory it saves, the time it
    # costs) and fp16 with loss scaling.
    settings = ([Setting(0), Setting(0, checkpointing=False), Setting(0, precision="fp16")] if world == 1 else
                [Setting(0), Setting(1), Setting(2), Setting(2, defer=True), Setting(3), Setting(3, defer=True)])
    # The hand-written loop the engine is compared with: one process, or FSDP2 (as ZeRO-3).
    hand = Setting(0) if world == 1 else Setting(3)
    rows_out = []
    for setting in settings:
        try:
            rows_out.append(measure_setting(model, batch, size, device, compiled, steps, setting,
                                            against_hand=setting == hand))
        except Exception as error:  # noqa: BLE001 - reported in the table; the other settings still run
            if not one_process():
                raise  # the other ranks would wait for this one
            traceback.print_exc()
            rows_out.append({**dataclasses.asdict(setting), "error": f"{type(error).__name__}: {error}"[:500]})
            release(device)
    return rows_out


def measure_setting(model, batch, size: dict, device: torch.device, compiled: bool, steps: int, setting: Setting, *,
                    against_hand: bool) -> dict:
    """One row of the table: the engine at this setting (and the hand-written loop when asked)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = size["micro"] * size["accumulation"]
    stage = setting.stage
    config = {"train_batch_size": rows * world, "train_micro_batch_size_per_gpu": size["micro"],
              "zero_optimization": {"stage": stage, **({"defer_reduction": setting.defer} if stage >= 2 else {})},
              setting.precision: {"enabled": True}, "activation_checkpointing": {"enabled": setting.checkpointing},
              "compile": {"enabled": compiled}}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    seconds, peak_bytes = timed(lambda: eng.train_batch(batch, lm_loss), device, steps)
    if device.type != "cuda":  # the counted peak: what is held + saved activations + gradients to come
        params = list(eng.strategy.module.parameters())
        peak_bytes = held_bytes(eng.strategy) + saved_activation_bytes(eng, eng.strategy.forward_module,
                                                                       batch[:size["micro"]], lm_loss) \
            + storage_bytes(params)
    eng.close()
    del eng
    release(device)
    hand_seconds = hand_peak = None
    if against_hand:
        hand_seconds, hand_peak = timed(hand_loop(model, batch, size["micro"], device, compiled), device, steps)
        release(device)
    tokens_per_second = rows * size["time"] / seconds
    peak = peak_flops(device)
    per_token = flops_per_token(model, size["layers"], size["width"], size["time"])
    return {**dataclasses.asdict(setting), "tokens_per_s_per_device": tokens_per_second,
            "mfu": tokens_per_second * per_token / peak if peak else None, "peak_bytes": peak_bytes,
            "engine_over_hand": seconds / hand_seconds if hand_seconds else None, "hand_peak_bytes": hand_peak}


# -- 4. checkpointing or a smaller micro size, by measurement ------------------------------------
def checkpointing_choice(device: torch.device, size: dict) -> dict:
    """``explore`` with ``activation_checkpointing: auto`` on the throughput model (eager, bf16):
    every micro size up to the whole per-device batch, checkpointing off and on, a real
    out-of-memory where a size does not fit; the fastest pair that fits is the choice."""
    model = lm(size["layers"], size["width"], time=size["time"], heads=size["heads"])
    rows = size["micro"] * size["accumulation"]
    batch = tokens(rows, size["time"] + 1).to(device)
    config = {"train_batch_size": rows, "train_micro_batch_size_per_gpu": "explore", "auto_max": rows,
              "bf16": {"enabled": True}, "activation_checkpointing": "auto"}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    eng.train_batch(batch, lm_loss)  # explores first, then trains the window at the choice
    tuner = eng.micro_batch_tuner
    result = {"status": "passed", "micro_size": eng.plan.train_micro_batch_size_per_gpu,
              "checkpointing": tuner.checkpointing, "table": format_table(tuner.explored),
              "candidates": [dataclasses.asdict(candidate) for candidate in tuner.explored]}
    eng.close()
    del eng
    release(device)
    return result


def markdown(report: dict) -> str:
    lines = [f"Device: {report['device']} x{report['world_size']}, torch {report['torch']}; model: "
             f"{report['size']['layers']} blocks, width {report['size']['width']}, {report['size']['time']} tokens, "
             f"micro {report['size']['micro']} x {report['size']['accumulation']}, "
             f"compile {'on' if report['compile'] else 'off'}", "",
             f"CUDA-only tests: {report['cuda_tests']['status']}. Out of memory under auto: "
             f"{report['out_of_memory']['status']}.", "",
             "| stage | defer_reduction | checkpointing | precision | tokens/s per device | MFU | peak memory "
             "| engine / hand | hand's peak memory |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["throughput"]:
        if "error" in row:
            lines.append(f"| {row['stage']} | {row['defer']} | {row['checkpointing']} | {row['precision']} | failed: "
                         f"{row['error'].splitlines()[0]} | | | | |")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        ratio = f"{row['engine_over_hand']:.3f}" if row["engine_over_hand"] is not None else "-"
        hand_peak = f"{row['hand_peak_bytes'] / 2**20:,.1f} MiB" if row["hand_peak_bytes"] else "-"
        lines.append(f"| {row['stage']} | {row['defer']} | {row['checkpointing']} | {row['precision']} | "
                     f"{row['tokens_per_s_per_device']:,.0f} | {mfu} | {row['peak_bytes'] / 2**20:,.1f} MiB | {ratio} "
                     f"| {hand_peak} |")
    choice = report["checkpointing_choice"]
    lines += ["", f"Checkpointing or a smaller micro size (explore, eager): {choice['status']}"]
    if "table" in choice:
        lines += [f"chose micro size {choice['micro_size']} with checkpointing "
                  f"{'on' if choice['checkpointing'] else 'off'}", "", "```text", choice["table"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="toy size even on a GPU")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks (compiling is slow on CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, help="the folder for its files (default: as --record says)")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    out = args.out or results_directory(args.record)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    size = sizes(device, args.toy)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": size, "compile": not args.no_compile,
              "cuda_tests": cuda_tests(device), "out_of_memory": run_reported(out_of_memory, device)}
    report["throughput"] = throughput(device, size, not args.no_compile, args.steps)
    report["checkpointing_choice"] = run_reported(checkpointing_choice, device, size)
    report["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        name = "gpu_" + report["device"].replace(" ", "_")
        (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"{name}.md").write_text(markdown(report))
        print(markdown(report))
    return report


if __name__ == "__main__":
    main()
