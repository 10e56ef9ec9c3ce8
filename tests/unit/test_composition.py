"""docs/composition.md against the code: every pair of the features below appears once, and its verdict
is what ``python -m engine validate`` (``check_without_model``, which ``engine.initialize`` runs too) says
of a config with both: a ✓ or an "accepted, untested" row has no problem, a "refused" row's reason is
the first problem's words, a "refused at initialize" row's words are in the module it names; a ✓ row's
test exists. No processes, no model."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from engine.config.checks import check_without_model
from engine.config.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
FEATURES = {
    "ZeRO 0": {"zero_optimization": {"stage": 0}},
    "ZeRO 1": {"zero_optimization": {"stage": 1}},
    "ZeRO 2": {"zero_optimization": {"stage": 2}},
    "ZeRO 3": {"zero_optimization": {"stage": 3}},
    "hybrid": {"zero_optimization": {"shard_size": 2}},
    "pipeline": {"pipeline": {"stages": 2}},
    "tensor": {"tensor_parallel": {"size": 2}},
    "context": {"context_parallel": {"size": 2}},
    "experts": {"expert_parallel": {"size": 2}},
    "global balance": {"moe": {"load_balance": "global"}},
    "checkpointing": {"activation_checkpointing": {"enabled": True}},
    "compile": {"compile": {"enabled": True}},
    "offload": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
    "auto micro": {"train_micro_batch_size_per_gpu": "auto"},
    "deepspeed": {"backend": "deepspeed"},
}
# A feature without a ZeRO stage of its own runs at this one (hybrid and offload need a sharded stage).
DEFAULT_STAGE = {"hybrid": 3, "offload": 3}
STAGES = [name for name in FEATURES if name.startswith("ZeRO")]
# ZeRO stages against each other are alternatives, not a pair
PAIRS = [(a, b) for a, b in itertools.combinations(FEATURES, 2) if not (a in STAGES and b in STAGES)]


def _merge(into: dict, extra: dict) -> dict:
    out = dict(into)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def pair_config(a: str, b: str) -> dict:
    config = dict(BASE)
    stage = next((DEFAULT_STAGE[name] for name in (a, b) if name in DEFAULT_STAGE), None)
    if stage is not None:
        config = _merge(config, {"zero_optimization": {"stage": stage}})
    for name in (a, b):
        config = _merge(config, FEATURES[name])
    return config


def rows() -> dict[tuple[str, str], tuple[str, str]]:
    text = (ROOT / "docs" / "composition.md").read_text()
    found = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in FEATURES and cells[1] in FEATURES:
            assert (cells[0], cells[1]) not in found, f"{cells[0]} × {cells[1]} appears twice"
            found[(cells[0], cells[1])] = (cells[2], cells[3])
    return found


def test_every_pair_appears_once():
    assert sorted(rows()) == sorted(PAIRS)


@pytest.mark.parametrize("a, b", PAIRS, ids=[f"{a} x {b}" for a, b in PAIRS])
def test_the_table_says_what_validate_says(a, b):
    verdict, evidence = rows()[(a, b)]
    problems = check_without_model(load_config(pair_config(a, b)))
    if verdict == "refused":
        assert problems, f"{a} × {b}: the table refuses it, validate accepts it"
        assert evidence in problems[0].replace("|", "/"), (evidence, problems[0])
        return
    assert not problems, f"{a} × {b}: the table says {verdict}, validate says {problems}"
    if verdict == "refused at initialize":
        module, words = re.fullmatch(r"`([^`]+)`: (.+)", evidence).groups()
        assert words in (ROOT / module).read_text(), (module, words)
    elif verdict == "✓":
        path, name = evidence.strip("`").split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{evidence} names no test"
    else:
        assert verdict == "accepted, untested" and evidence == "—", (a, b, verdict)
