"""Activation checkpointing and ``torch.compile`` from the config, on the LM example's model
(examples/gpt.py at configs/lm_tiny.yaml's size, or larger with --layers / --width), one process.

    python -m bench.model_transforms [--rounds 8] [--steps 1] [--compile]

Counted: the bytes of activations a forward saves for backward (every tensor autograd packs,
plus the inputs a checkpointed block keeps for its recomputation: distinct storages) and the
peak a micro-step reaches on CPU: what the engine holds (parameters, gradients, optimizer
state) + saved activations + the gradients the backward has yet to allocate. Timed (ratios,
interleaved rounds): the engine with each feature against the same feature written by hand
(``torch.utils.checkpoint`` / ``torch.compile`` on each block, an accumulation loop), and
against the engine without it. Results: bench/results/model_transforms.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and the examples importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import copy
import functools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import engine
from bench.common import add_record_argument, interleaved, save
from engine.memory import held_bytes, storage_bytes
from engine.strategies.model_transforms import repeated_blocks
from gpt import GPT, GPTConfig  # noqa: E402

VOCAB, TIME = 64, 192
GLOBAL, MICRO = 32, 8


def lm(layers: int = 2, width: int = 64, dropout: float = 0.0, time: int = TIME, heads: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=time, n_layer=layers, n_head=heads, n_embd=width,
                         dropout=dropout))


def tokens(rows: int = GLOBAL, time: int = TIME, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, time), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def saved_activation_bytes(run, model: torch.nn.Module, batch, loss_fn=lm_loss) -> int:
    """Bytes one forward of ``run`` (the engine, or ``model`` itself) keeps for its backward: what
    autograd packs, plus the inputs of ``model``'s blocks (which the non-reentrant checkpoint
    saves through autograd too: counted once, by storage), without the parameters."""
    storages: dict[int, int] = {}

    def keep(module, args):
        for tensor in args:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    blocks = repeated_blocks(model)
    hooks = [block.register_forward_pre_hook(keep) for block in blocks]
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_fn(run, batch)
    finally:
        for hook in hooks:
            hook.remove()
    loss.backward()
    return sum(n for pointer, n in storages.items() if pointer not in parameters)


def engine_for(model, **features):
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO, **features}
    return engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))


def peak_bytes(eng, batch) -> int:
    """Held + saved activations + gradients to come, at the end of a micro-step's forward."""
    eng.train_batch(batch, lm_loss)  # optimizer state exists from here
    params = list(eng.strategy.module.parameters())
    return held_bytes(eng.strategy) + saved_activation_bytes(eng, eng.module, batch[:MICRO]) + storage_bytes(params)


def hand_loop(model, checkpointed: bool, compiled: bool, batch):
    """The same training written by hand: each block checkpointed / compiled, 1/A accumulation."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        forward = block.forward
        if checkpointed:
            forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
        block.forward = torch.compile(forward) if compiled else forward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro_batches = batch.split(MICRO)

    def step():
        for micro in micro_batches:
            (lm_loss(model, micro) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="also time compiled against eager")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, batch = lm(args.layers, args.width), tokens()
    checkpointing = {"activation_checkpointing": {"enabled": True}}

    memory = {}
    for name, features in {"without": {}, "with activation checkpointing": checkpointing}.items():
        eng = engine_for(model, **features)
        memory[name] = {"saved_activation_bytes": saved_activation_bytes(eng, eng.module, batch[:MICRO]),
                        "peak_bytes": peak_bytes(eng, batch)}
    for name, row in memory.items():
        print(f"{name:32s} saved activations {row['saved_activation_bytes']:>12,} B   peak {row['peak_bytes']:>12,} B")

    engines = {"engine": engine_for(model), "engine, checkpointing": engine_for(model, **checkpointing)}
    variants = {"hand": hand_loop(model, False, False, batch), "hand, checkpointing": hand_loop(model, True, False, batch)}
    if args.compile:
        engines["engine, compiled"] = engine_for(model, compile={"enabled": True})
        variants["hand, compiled"] = hand_loop(model, False, True, batch)
    variants.update({name: functools.partial(eng.train_batch, batch, lm_loss) for name, eng in engines.items()})
    times = interleaved(variants, args.rounds, args.steps)
    ratios = {"engine / hand": times["engine"] / times["hand"],
              "engine checkpointing / hand checkpointing": times["engine, checkpointing"] / times["hand, checkpointing"],
              "checkpointing / without (engine)": times["engine, checkpointing"] / times["engine"]}
    if args.compile:
        ratios["engine compiled / hand compiled"] = times["engine, compiled"] / times["hand, compiled"]
        ratios["compiled / eager (engine)"] = times["engine, compiled"] / times["engine"]
    for name, t in times.items():
        print(f"{name:32s} {t * 1e3:8.1f} ms/step")
    for name, ratio in ratios.items():
        print(f"{name:44s} {ratio:.3f}")
    save("model_transforms" + ("_compile" if args.compile else ""), {
        "workload": f"examples/gpt.py, {args.layers} layers, width {args.width}, {TIME} tokens, global batch {GLOBAL}, "
                    f"micro {MICRO}, AdamW, 1 process, 1 thread",
        "memory": memory, "ms_per_step": {k: v * 1e3 for k, v in times.items()}, "ratios": ratios}, record=args.record)


if __name__ == "__main__":
    main()
