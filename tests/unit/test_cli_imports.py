"""The command line imports only what a subcommand needs: ``--help`` no torch, ``validate`` and
``plan`` neither torch.distributed.tensor, transformers nor the engine itself; ``import engine``
loads its heavy public names on first use, and every one of them still imports. Each check runs
in a fresh interpreter, since this test process has imported everything already."""

import json
import os
import subprocess
import sys
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parents[2]
# what a config check has no use for: the sharded tensors, the Hugging Face models, the engine
HEAVY = ("torch.distributed.tensor", "torch.distributed.fsdp", "transformers", "engine.engine",
         "engine.build", "engine.window", "engine.strategies", "engine.verify")


def loaded_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints a JSON object as its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


LOADED = f"""
import json, sys
def heavy():
    return sorted(m for m in sys.modules if m.startswith({HEAVY!r}))
"""


def test_validate_and_plan_import_no_heavy_module():
    loaded = loaded_after(LOADED + """
from engine.cli import main
assert main(["validate", "configs/balanced.yaml"]) == 0
after_validate = heavy()
assert main(["plan", "configs/pipeline.yaml", "--world-size", "4"]) == 0
print(json.dumps({"validate": after_validate, "plan": heavy()}))
""")
    assert loaded == {"validate": [], "plan": []}


def test_help_imports_no_torch():
    loaded = loaded_after(LOADED + """
from engine.cli import main
try:
    main(["--help"])
except SystemExit as done:
    assert done.code == 0
print(json.dumps({"torch": "torch" in sys.modules, "heavy": heavy()}))
""")
    assert loaded == {"torch": False, "heavy": []}


def test_every_public_name_imports_on_first_use():
    loaded = loaded_after(LOADED + """
import engine
on_import = heavy()
from engine.verify import VerifyResult  # the submodule named like the function it defines
names = {name: type(getattr(engine, name)).__name__ for name in engine.__all__}
star = {}
exec("from engine import *", star)
print(json.dumps({"on_import": on_import, "verify": names["verify"], "Engine": names["Engine"],
                  "star": sorted(set(star) - {"__builtins__"}), "dir": sorted(set(engine.__all__) - set(dir(engine)))}))
""")
    assert loaded["on_import"] == []
    assert loaded["verify"] == "function" and loaded["Engine"] == "type"
    assert loaded["star"] == sorted(engine.__all__)
    assert loaded["dir"] == []


def test_an_unknown_name_is_an_attribute_error():
    try:
        engine.not_a_public_name
    except AttributeError as error:
        assert "not_a_public_name" in str(error)
    else:
        raise AssertionError("engine.not_a_public_name did not raise AttributeError")
