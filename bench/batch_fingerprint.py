"""What the batch fingerprint costs a window (``engine.distributed.batch_fingerprint``): the
milliseconds to fingerprint a Hugging Face batch (input ids, attention mask, labels: int64) of a few
shapes on one CPU thread (and on CUDA when there is one), against one pass that only sums the batch.

    python -m bench.batch_fingerprint [--repeats 20]

Reported: the median over repeats, after one warm-up call (which makes the kept keys)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.distributed.batch_fingerprint import batch_fingerprint

SHAPES = [(8, 512), (8, 2048), (64, 2048)]


def median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        for rows, length in SHAPES:
            ids = torch.randint(0, 50_000, (rows, length), device=device)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
            fingerprint = median_ms(lambda: batch_fingerprint(batch, device), args.repeats, device)
            summed = median_ms(lambda: sum(t.sum() for t in batch.values()), args.repeats, device)
            print(f"{device.type} {rows}x{length} x3 int64: fingerprint {fingerprint:.3f} ms, one sum {summed:.3f} ms")


if __name__ == "__main__":
    main()
