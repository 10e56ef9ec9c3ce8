"""The docs stay true to the tree: links resolve, CI runs README's test command."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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
    from engine.autosave import checkpoint_name

    readme = (REPO / "README.md").read_text()
    assert checkpoint_name(100) in readme and "step_<N>" not in readme


def test_lm_example_and_readme_agree_on_when_token_counts_normalise():
    """Counts are applied once at the optimizer step (gradient times G / U), not before the backwards."""
    readme, lm_example = (REPO / "README.md").read_text(), (REPO / "docs" / "lm_example.md").read_text()
    for doc in (readme, lm_example):
        assert "G / U" in doc and "before any backward" not in doc


# -- every `$ python -m engine ...` the docs show, run as shown ---------------------------------------------
SHELL_BLOCK = re.compile(r"```(?:text|console)\n(.*?)```", re.S)


def shown_sessions(doc: Path):
    """(command, the output shown under it, files written by a `$ cat FILE` shown before it);
    a command continued with a trailing backslash is joined."""
    for block in SHELL_BLOCK.findall(doc.read_text()):
        block = re.sub(r"\\\n\s*", " ", block)  # a command continued over lines, as a shell reads it
        files, parts = {}, re.split(r"^\$ (.*)\n", block, flags=re.M)
        for command, shown in zip(parts[1::2], parts[2::2]):
            if command.startswith("cat "):
                files[command[4:].strip()] = shown
            elif command.startswith("python -m engine "):
                yield command, shown, dict(files)


def shown_as_pattern(command: str, shown: str) -> str:
    """A regular expression for what a doc shows: "..." stands for what the doc leaves out (a
    line of its own: any number of lines); a measured explore row keeps its sizes and whether
    it fits, its timings vary (and so whether the fastest differs from the configured size, which
    the tuner's change line on stderr reports)."""
    lines = []
    for line in shown.rstrip("\n").splitlines():
        if line.strip() == "...":
            lines.append(r"(?:.*\n)*?")
        elif " explore " in command and re.match(r"\s+\d", line):
            micro, accumulation, *_ = line.split()
            lines.append(rf"\s+{micro}\s+{accumulation}\s.*\s{'yes' if 'yes' in line else 'no'}\b.*\n")
        else:
            lines.append(".*".join(re.escape(part) for part in line.split("...")) + r"\n")
    if " explore " in command:
        lines.append(r"(?:.*\(explore: fastest that fits, global step \d+\).*\n)?")
    return "".join(lines)


SESSIONS = [(doc, *session) for doc in DOCS for session in shown_sessions(doc)]


@pytest.mark.parametrize("doc, command, shown, files", SESSIONS,
                         ids=[f"{doc.name}: {command[:60]}" for doc, command, _, _ in SESSIONS])
def test_the_docs_engine_commands_print_what_they_show(tmp_path, doc, command, shown, files):
    import shlex
    import subprocess
    import sys

    argv = shlex.split(command)
    assert argv[4] in files or (REPO / argv[4]).exists(), f"{argv[4]}: show it with `$ cat {argv[4]}` first"
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for shared in ("configs", "examples"):
        (tmp_path / shared).symlink_to(REPO / shared)
    done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    printed = done.stdout + done.stderr
    printed += "" if printed.endswith("\n") else "\n"
    assert re.fullmatch(shown_as_pattern(command, shown), printed), (printed, shown)


def test_the_readme_says_how_to_reach_the_environment_before_its_first_python_command():
    readme = (REPO / "README.md").read_text()
    first_python = readme.index("$ python ")
    assert readme.index("source .venv/bin/activate") < first_python
    assert readme.index(".venv/bin/microstep") < first_python
    assert 'microstep = "engine.cli:main"' in (REPO / "pyproject.toml").read_text()


def test_the_readme_shows_what_the_demo_prints_first():
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"^\[demo\] (.*?): \.\.\.$", readme, re.M).group(1)
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert f'echo "[demo] {shown}:' in demo
    assert demo.rstrip().endswith('exec .venv/bin/python -m launch --nproc-per-node 2 examples/param_unchanged.py "$@"')
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert setup.count('say "') >= 4  # every step says what it does before it runs


def test_the_docs_match_the_code_on_the_papercuts_issue_34_found():
    deepspeed_doc = " ".join((REPO / "docs" / "deepspeed.md").read_text().split())
    assert "the torch backend in fp32 applies it" not in deepspeed_doc  # it discards the window
    assert "as the torch backend does in every precision" in deepspeed_doc
    if "pytest -q -n " in (REPO / "docs" / "compatibility.md").read_text():  # -n is pytest-xdist's
        assert re.search(r"^pytest-xdist==", (REPO / "requirements" / "ci.txt").read_text(), re.M)
        assert '"pytest-xdist' in (REPO / "pyproject.toml").read_text()
