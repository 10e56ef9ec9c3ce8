"""Global-batch load balancing against each micro-batch's own term: time per step and the
activations a window holds, one process.

    python bench/moe.py [--rounds 5] [--steps 2]
    python -m launch --nproc-per-node 2 bench/moe.py     # data 2: each rank half the global batch
    python -m launch --nproc-per-node 2 bench/moe.py --stage 3   # the same at ZeRO 3 (or 1, 2)

Workload: a Hugging Face Mixtral (transformers, random init, fp32): 4 layers, hidden 128, 8 experts
top-2, output_router_logits, router_aux_loss_coef 0.02; global batch 16 rows of 128 tokens,
accumulation 4, AdamW, ``m(**b).loss``. Variants, without and with activation checkpointing:
``moe.load_balance: micro_batch`` (the model's own per-forward term: the baseline), ``global`` with
``count_forward`` (equal memory: one more forward per micro-batch) and with ``hold_forwards``
(equal FLOPs: every micro-batch's activations held until the window's backwards), and a second
copy of the baseline whose ratio is the run's noise floor. Times are
interleaved medians (bench/common.py). "Held activations" is the most bytes of tensors saved for
backward alive at once during a window (parameters excluded; storages counted once; bytes, not
timed); "peak" adds the bytes of parameters, gradients and optimizer state this rank holds (what a
window holds at most: those and its saved activations). On several ranks ``hold_forwards`` is
measured with checkpointing only (where ``auto`` chooses it): ZeRO 0 / 1 then reduce after the window,
ZeRO 2 / 3 each held forward's backward into shards as a micro-step does. A gathered (unsharded) parameter saved for backward is not an activation: the
parameter's shard is counted with the parameters. Results: bench/results/moe.json, moe_w<W>.json
(moe_w<W>_zero<S>.json at another stage).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import argparse
import copy
import weakref

import torch

import engine
from bench.common import adamw, add_record_argument, interleaved, save
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from engine.memory import format_bytes, storage_bytes, storages

GLOBAL_BATCH, ACCUMULATION, SEQ, VOCAB = 16, 4, 128, 512


def mixtral() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ,
        output_router_logits=True, router_aux_loss_coef=0.02, experts_implementation="eager",
        attn_implementation="sdpa")
    return transformers.MixtralForCausalLM(config)


def lm_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def hf_loss(model, batch):
    return model(**batch).loss


class HeldActivations:
    """The most bytes of tensors saved for backward alive at once (parameters excluded)."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = set(storages(model.parameters()))  # a DTensor's local shard
        self.references: dict[int, int] = {}  # storage address -> saved tensors alive on it
        self.live = self.peak = 0

    def pack(self, tensor):
        address = tensor.untyped_storage().data_ptr()
        if address in self.parameters or isinstance(tensor, torch.nn.Parameter):
            return tensor
        if self.references.get(address, 0) == 0:
            self.live += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.references[address] = self.references.get(address, 0) + 1
        weakref.finalize(tensor, self._release, address, tensor.untyped_storage().nbytes())
        return tensor

    def _release(self, address: int, size: int) -> None:
        self.references[address] -= 1
        if self.references[address] == 0:
            self.live -= size

    def measure(self, run) -> int:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            run()
        return self.peak


VARIANTS = {  # name: (load_balance, global_counts, checkpointing, forwards per micro-batch)
    "micro_batch": ("micro_batch", "auto", False, 1),
    "micro_batch, second copy (noise floor)": ("micro_batch", "auto", False, 1),
    "global, count_forward": ("global", "count_forward", False, 2),
    "global, hold_forwards": ("global", "hold_forwards", False, 1),
    "micro_batch, checkpointing": ("micro_batch", "auto", True, 2),
    "global, count_forward, checkpointing": ("global", "count_forward", True, 3),
    "global, hold_forwards, checkpointing": ("global", "hold_forwards", True, 2),
}


def main(argv=None) -> None:
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (default 0)")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    model, whole = mixtral(), lm_batch()
    share = GLOBAL_BATCH // info.world_size
    batch = {key: value[info.rank * share:(info.rank + 1) * share] for key, value in whole.items()}
    engines, held, statics, peaks = {}, {}, {}, {}
    for name, (balance, counts, checkpointing, _) in VARIANTS.items():
        if counts == "hold_forwards" and info.world_size > 1 and not checkpointing:
            continue  # auto would not choose it there; measured with checkpointing
        eng = engine.initialize(copy.deepcopy(model), {
            "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ACCUMULATION,
            "moe": {"load_balance": balance, "global_counts": counts},
            "activation_checkpointing": {"enabled": checkpointing},
            "zero_optimization": {"stage": args.stage}}, optimizer=adamw)
        eng.train_batch(batch, hf_loss)  # optimizer state exists from here on
        held[name] = HeldActivations(eng.module).measure(lambda: eng.train_batch(batch, hf_loss))
        state = [t for per_param in eng.optimizer.state.values() for t in per_param.values() if torch.is_tensor(t)]
        static = storage_bytes([*eng.module.parameters(), *(p.grad for p in eng.module.parameters()
                                                            if p.grad is not None), *state])
        statics[name], peaks[name] = static, static + held[name]
        engines[name] = eng
    times = interleaved({name: (lambda eng=eng: eng.train_batch(batch, hf_loss)) for name, eng in engines.items()},
                        rounds=args.rounds, steps=args.steps, warmup=1, distributed=info.world_size > 1)
    rows = []
    for name, (_, _, checkpointing, forwards) in VARIANTS.items():
        if name not in engines:
            continue
        base = "micro_batch, checkpointing" if checkpointing else "micro_batch"
        rows.append({"variant": name, "seconds": times[name], "ratio": times[name] / times[base],
                     "held_activation_bytes": held[name], "held_ratio": held[name] / held[base],
                     "parameters_gradients_optimizer_bytes": statics[name],
                     "peak_bytes": peaks[name], "peak_ratio": peaks[name] / peaks[base],
                     "forwards_per_micro_batch": forwards})
    if info.rank == 0:
        print(f"{info.world_size} rank(s), ZeRO {args.stage}")
        print(f"{'variant':40} {'s/step':>8} {'ratio':>6} {'params+grads+AdamW':>18} {'held activations':>18} "
              f"{'ratio':>6} {'peak':>10} {'ratio':>6} forwards")
        for row in rows:
            print(f"{row['variant']:40} {row['seconds']:8.3f} {row['ratio']:6.3f} "
                  f"{format_bytes(row['parameters_gradients_optimizer_bytes']):>18} "
                  f"{format_bytes(row['held_activation_bytes']):>18} {row['held_ratio']:6.2f} "
                  f"{format_bytes(row['peak_bytes']):>10} {row['peak_ratio']:6.2f} {row['forwards_per_micro_batch']}")
        name = f"moe_w{info.world_size}" if info.world_size > 1 else "moe"
        print("results:", save(name + (f"_zero{args.stage}" if args.stage else ""),
                               {"stage": args.stage, "rounds": args.rounds, "steps": args.steps, "global_batch": GLOBAL_BATCH,
                                "accumulation": ACCUMULATION, "sequence": SEQ, "rows": rows}, record=args.record))


if __name__ == "__main__":
    main()
