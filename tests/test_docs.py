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
