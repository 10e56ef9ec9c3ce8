"""``deepspeed.utils.zero_to_fp32``: one whole fp32 state dict from a checkpoint that
``model_engine.save_checkpoint(save_dir, tag)`` wrote sharded over the ranks (any ZeRO stage of
the torch backend), in one process, without the model or a process group:

    state = get_fp32_state_dict_from_zero_checkpoint("checkpoints")          # the tag `latest` names
    convert_zero_checkpoint_to_fp32_state_dict("checkpoints", "model.bin")   # a file torch.load reads
    load_state_dict_from_zero_checkpoint(model, "checkpoints")               # into a plain model

or from the command line, as DeepSpeed's script::

    python -m engine.compat.deepspeed.utils.zero_to_fp32 checkpoints model.bin [--tag TAG]

Checkpoints of ``backend: deepspeed`` hold DeepSpeed's own files: its ``zero_to_fp32`` reads
those (an error says where).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from engine.errors import CheckpointError, MicrostepError
from engine.state.checkpoint import STATE_DIR, verify_checkpoint
from engine.strategies.torch_checkpoint import read_model_state

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "main"]

LATEST = "latest"  # the file save_checkpoint writes next to its tags


def _checkpoint_path(checkpoint_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"no {LATEST} file in {checkpoint_dir}: pass tag= (the checkpoint's directory name)")
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(checkpoint_dir, str(tag))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor]:
    """The whole model state of ``checkpoint_dir/tag`` (``tag`` None: the one ``latest``
    names), floating-point tensors in fp32, on the CPU. ``exclude_frozen_parameters`` is
    accepted; frozen parameters are in the state (the checkpoint does not mark them)."""
    path = _checkpoint_path(checkpoint_dir, tag)
    manifest = verify_checkpoint(path)
    if manifest.get("state_format") != "torch-dcp":
        raise CheckpointError(
            f"{path} was saved by backend {manifest.get('strategy')!r} (state format "
            f"{manifest.get('state_format')!r}): its model state is DeepSpeed's own checkpoint in "
            f"{os.path.join(path, STATE_DIR)}; run DeepSpeed's zero_to_fp32 there")
    state = read_model_state(os.path.join(path, STATE_DIR))
    return {key: value.float() if value.is_floating_point() else value for key, value in state.items()}


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_file: str, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the whole fp32 state dict to ``output_file`` (``torch.save``; ``torch.load`` with
    ``weights_only=True`` reads it). Returns the path written."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    directory = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(directory, exist_ok=True)
    torch.save(state, output_file)
    return output_file


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None):
    """Load the checkpoint's whole state into ``model`` (on the CPU) and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=True)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.compat.deepspeed.utils.zero_to_fp32",
        description="Join a sharded checkpoint (model_engine.save_checkpoint) into one fp32 state dict file.")
    parser.add_argument("checkpoint_dir", help="the save_dir given to save_checkpoint (holds `latest` and the tags)")
    parser.add_argument("output_file", help="the state dict file to write (torch.save)")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint's tag (default: the one `latest` names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="accepted; frozen parameters stay")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag,
                                                          args.exclude_frozen_parameters)
    except MicrostepError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
