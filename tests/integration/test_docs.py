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


ROUNDED = r"\d\.\d+e[-+]\d+"  # a figure as verify prints it (1.95e-05)
# a row of verify's table: tensor, relative, |difference|, |update|
VERIFY_ROW = re.compile(rf"(\S+\s+)({ROUNDED})(\s+)({ROUNDED})(\s+)({ROUNDED})")
VERIFY_WORST = re.compile(rf"\(worst \S+: ({ROUNDED})\)")
VERIFY_TOLERANCE = re.compile(r"^equal: every tensor within (\S+) of its update ", re.M)


def _literal(text: str) -> str:
    return ".*".join(re.escape(part) for part in text.split("..."))


def shown_as_pattern(command: str, shown: str) -> tuple[str, dict[str, float]]:
    """A regular expression for what a doc shows, and the most each of its named groups may print:
    "..." stands for what the doc leaves out (a line of its own: any number of lines); a measured
    explore row keeps its sizes and whether it fits, its timings vary (and so whether the fastest
    differs from the configured size, which the tuner's change line on stderr reports); verify's
    figures that come from floating-point rounding (a row's relative and |difference|, the worst
    tensor's relative) may be any value within the tolerance its shown `equal:` line states
    (|difference|: that tolerance of the row's |update|), while the tensors' names, their |update|,
    the losses and every word stay exact."""
    lines, limits = [], {}
    stated = VERIFY_TOLERANCE.search(shown) if " verify " in command else None
    tolerance = float(stated.group(1)) if stated else None
    for line in shown.rstrip("\n").splitlines():
        row, worst = VERIFY_ROW.fullmatch(line), VERIFY_WORST.search(line)
        if line.strip() == "...":
            lines.append(r"(?:.*\n)*?")
        elif " explore " in command and re.match(r"\s+\d", line):
            micro, accumulation, *_ = line.split()
            lines.append(rf"\s+{micro}\s+{accumulation}\s.*\s{'yes' if 'yes' in line else 'no'}\b.*\n")
        elif tolerance is not None and row:
            name, _, gap, _, gap_update, update = row.groups()
            relative, difference = f"relative_{len(lines)}", f"difference_{len(lines)}"
            limits |= {relative: tolerance, difference: tolerance * float(update)}
            lines.append(rf"{re.escape(name)}(?P<{relative}>{ROUNDED}){re.escape(gap)}(?P<{difference}>{ROUNDED})"
                         rf"{re.escape(gap_update)}{re.escape(update)}\n")
        elif tolerance is not None and worst:
            group = f"worst_{len(lines)}"
            limits[group] = tolerance
            lines.append(rf"{_literal(line[:worst.start(1)])}(?P<{group}>{ROUNDED}){_literal(line[worst.end(1):])}\n")
        else:
            lines.append(_literal(line) + r"\n")
    if " explore " in command:
        lines.append(r"(?:.*\(explore: fastest that fits, global step \d+\).*\n)?")
    return "".join(lines), limits


def printed_as_shown(command: str, shown: str, printed: str) -> bool:
    pattern, limits = shown_as_pattern(command, shown)
    match = re.fullmatch(pattern, printed)
    return match is not None and all(float(match[group]) <= limit for group, limit in limits.items())


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
    assert printed_as_shown(command, shown, printed), (printed, shown)


def test_the_docs_verify_figures_may_round_differently_but_not_exceed_the_tolerance():
    """docs/exactness.md's verify example: its rounding-dependent figures (1.95e-05 there, 1.77e-05 on other
    CPUs) may differ within the stated tolerance 0.001; words, names, losses and |update| may not."""
    [(command, shown)] = [(command, shown) for doc, command, shown, _ in SESSIONS
                          if doc.name == "exactness.md" and " verify " in command]
    printed = re.sub(r"^\.\.\.\n", "", shown, flags=re.M)  # the rows the doc leaves out: none
    assert "1.95e-05     4.650e-06   2.389e-01" in printed
    assert "(worst model.layers.0.self_attn.q_proj.weight: 1.95e-05)" in printed
    assert printed_as_shown(command, shown, printed)
    assert printed_as_shown(command, shown, printed.replace("1.95e-05", "1.77e-05").replace("4.650e-06", "4.226e-06"))
    assert printed_as_shown(command, shown, printed.replace("1.95e-05", "1.00e-03").replace("4.650e-06", "2.380e-04"))
    for wrong in [("1.95e-05", "1.01e-03"), ("weight: 1.95e-05", "weight: 1.01e-03"), ("4.650e-06", "2.390e-04"),
                  ("2.389e-01", "2.390e-01"), ("loss 3.47689", "loss 3.47690"), ("equal: every", "not equal: every"),
                  ("q_proj.weight   1.95e-05", "k_proj.weight   1.95e-05"),
                  ("worst model.layers.0", "worst model.layers.1")]:
        assert wrong[0] in printed
        assert not printed_as_shown(command, shown, printed.replace(wrong[0], wrong[1], 1)), wrong


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
