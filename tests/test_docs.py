"""The docs stay true to the tree: links resolve, CI runs README's test command."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "launch" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    missing = [target for target in LINK.findall(doc.read_text())
               if "://" not in target and not (doc.parent / target).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(bash scripts/\S+)\s+# \((a|b)\)", readme, re.M)
    assert [label for _, label in commands] == ["a", "b"], commands
    test_command = commands[1][0]
    assert test_command in (REPO / ".ci" / "run").read_text()


def _python_block_with(doc: Path, needle: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    matching = [block for block in blocks if needle in block]
    assert len(matching) == 1, f"{doc.name}: {len(matching)} python blocks hold {needle!r}"
    return matching[0]


def test_readme_batches_loop_trains_past_one_epoch():
    """The README's resumable loop with eng.batches() reaches total_steps when that is more
    than one epoch (a bare `for batch in eng.batches(...)` ends with the epoch)."""
    import torch

    import engine

    loop = "\n".join(line for line in _python_block_with(REPO / "README.md", "total_steps").splitlines()
                     if not line.startswith("eng = "))
    torch.manual_seed(0)
    eng = engine.initialize(torch.nn.Linear(4, 1), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))  # 2 steps per epoch

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    namespace = {"eng": eng, "dataset": dataset, "loss_fn": loss_fn, "total_steps": 5}
    exec(loop, namespace)
    assert eng.global_steps == 5


def test_readme_names_checkpoints_as_they_are_on_disk():
    from engine.state.autosave import checkpoint_name

    readme = (REPO / "README.md").read_text()
    assert checkpoint_name(100) in readme and "step_<N>" not in readme


def test_lm_example_and_readme_agree_on_when_token_counts_normalise():
    """Counts are applied once at the optimizer step (gradient times G / U), not before the backwards."""
    readme, lm_example = (REPO / "README.md").read_text(), (REPO / "docs" / "lm_example.md").read_text()
    for doc in (readme, lm_example):
        assert "G / U" in doc and "before any backward" not in doc
