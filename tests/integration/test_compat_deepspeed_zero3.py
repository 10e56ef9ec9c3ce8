"""engine.compat.deepspeed where DeepSpeed was never installed: ZeRO 3 as DeepSpeed scripts see it,
``--local_rank`` under ``python -m launch``, transformers' ``HfDeepSpeedConfig``, and every name of
docs/migrating.md's survey table, provided or refused with a message.

One test, two processes: tests/support/deepspeed_facade_checks.py launched on two ranks with the
deepspeed and accelerate packages made absent (tests/support/absent.py; the files its ZeRO-3 saves
leave are loaded here with ``weights_only=True`` into the Hugging Face model), and the control, a
process with DeepSpeed installed: every name the table provides is DeepSpeed's own, and a script
that imports the real package next to the facade gets one warning on ``backend: torch``, none when
only a library imported it, none on ``backend: deepspeed``."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from launch.cli import free_port
from tests.support import absent
from tests.support.absent import finish
from tests.support.deepspeed_facade_checks import tiny_llama
from tests.support.deepspeed_names import survey_rows

REPO = Path(__file__).resolve().parents[2]
# Names the surveyed scripts reach that DeepSpeed 0.19 no longer has (bing_bert predates their removal).
GONE_FROM_DEEPSPEED = {"deepspeed.runtime.config.ONEBIT_LAMB_OPTIMIZER"}
# The control, with DeepSpeed installed, in one process: the table's provided names are DeepSpeed's
# own; a half-migrated script is warned once on backend: torch, not for a library's import, not on
# backend: deepspeed.
CONTROL = textwrap.dedent("""
    import importlib, json, sys, warnings
    import torch
    import engine.compat.deepspeed as facade
    from tests.support.deepspeed_names import resolve, survey_rows

    def exists(name):
        try:
            resolve(name, facade=False)
            return True
        except (ImportError, AttributeError):
            return False

    def from_pretrained_imports_deepspeed(directory):
        # with DeepSpeed installed, the facade's HfDeepSpeedConfig at ZeRO 3 leaves from_pretrained alone
        from transformers import AutoModelForCausalLM
        dschf = facade.HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
        model = AutoModelForCausalLM.from_pretrained(directory)
        return [facade.is_deepspeed_zero3_enabled(), "deepspeed" in sys.modules, model.num_parameters() > 0]

    def status_equal():
        # backend: deepspeed marks parameters with DeepSpeed's own enum; the script compares with the facade's
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as Real
        Facade = facade.zero.ZeroParamStatus
        return [Real.NOT_AVAILABLE == Facade.NOT_AVAILABLE, Facade.AVAILABLE == Real.AVAILABLE,
                Real.AVAILABLE != Facade.NOT_AVAILABLE]

    def mixed_warnings(backend):
        config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "backend": backend}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            facade.initialize(model=torch.nn.Linear(4, 2), config=config)
        return [str(w.message) for w in caught if "real deepspeed" in str(w.message)]

    found = {"from_pretrained": from_pretrained_imports_deepspeed(sys.argv[1])}
    found["names"] = {name: exists(name) for name, refused in survey_rows()
                      if not refused and not name.startswith("engine.")}
    found["status_equal"] = status_equal()
    importlib.import_module("deepspeed")  # a library's import: nothing of it among the script's names
    found["library"] = mixed_warnings("torch")
    import deepspeed  # the script's own: half migrated
    found["backend_deepspeed"] = mixed_warnings("deepspeed")
    found["mixed"] = mixed_warnings("torch")
    found["again"] = mixed_warnings("torch")
    print("RESULT " + json.dumps(found))
""")



def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(300)
def test_facade_without_deepspeed_and_deepspeed_itself_as_the_control(tmp_path):
    # the two processes at once: the launch's ranks and the control mostly wait on imports
    script = tmp_path / "half_migrated.py"
    script.write_text(CONTROL)
    tiny_llama().save_pretrained(tmp_path / "control_model")  # here: transformers' save imports deepspeed
    control = start([sys.executable, str(script), str(tmp_path / "control_model")],
                    absent.environment(TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                                       LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1"))
    facade = start([sys.executable, "-m", "launch", "--nproc-per-node", "2", "tests/support/deepspeed_facade_checks.py",
                    str(tmp_path)], absent.environment(("deepspeed", "accelerate")))
    finish(facade)
    check_facade(tmp_path)
    check_control(finish(control))


def check_facade(tmp_path: Path) -> None:
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, found in enumerate(ranks):
        assert found["modules"] == {"deepspeed": False, "accelerate": False}
        # a parser without --local_rank parses as before; one declaring it reads LOCAL_RANK
        assert found["local_rank"] == {"environment": rank, "undeclared": rank, "declared": rank}
        zero3 = found["zero3"]
        assert zero3["sharded"] and zero3["marked"] and zero3["unique_ids"], zero3
        # exactly the parameter given is whole inside the block; the other stays a shard
        assert zero3["inside"] == {"status": "AVAILABLE", "whole": True, "value": True,
                                   "other_status": "NOT_AVAILABLE", "other_sharded": True}
        assert zero3["after"] == {"status": "NOT_AVAILABLE", "sharded": True}
        assert zero3["written"] and zero3["others_untouched"] and zero3["loaded"], zero3
        assert all(map(torch.isfinite, torch.tensor([zero3["loss"], zero3["trains_after"]])))
        assert found["zero0"] == {"unmarked": True, "written": True}
        assert found["transformers"] == {"zero3": True, "stage": 3, "offload": True, "transformers_zero3": False,
                                         "whole": True, "zero3_after": False,
                                         "transformers_class": "PackageNotFoundError"}

    trained = torch.load(tmp_path / "zero3_module_state_dict.bin", weights_only=True)
    for saved in ("zero3_pattern.bin", "zero3_16bit.bin", "zero3_module_state_dict.bin"):
        state = torch.load(tmp_path / saved, weights_only=True)
        assert all(type(value) is torch.Tensor for value in state.values()), saved
        model = tiny_llama()
        model.load_state_dict(state)  # strict: every key, whole shapes
        assert all(torch.equal(value, trained[name]) for name, value in model.state_dict().items()), saved

    for name, refused in survey_rows():
        outcome = ranks[0]["names"][name]
        if not refused:
            assert outcome == "provided", (name, outcome)
        elif name.startswith("engine.optimizer."):  # the torch optimizer's missing attribute, as the table says
            assert outcome.startswith("missing:"), (name, outcome)
        else:
            assert outcome.startswith(f"refused: NotProvidedError: {name} is not provided by Microstep ("), \
                (name, outcome)




def check_control(out: str) -> None:
    found = json.loads(out.split("RESULT ", 1)[1])
    missing = {name for name, present in found["names"].items() if not present}
    assert missing == GONE_FROM_DEEPSPEED, missing
    assert found["from_pretrained"] == [True, False, True]  # zero3 on, deepspeed not imported, a whole model
    assert found["status_equal"] == [True, True, True]
    assert found["library"] == [] and found["backend_deepspeed"] == [] and found["again"] == []
    assert len(found["mixed"]) == 1 and "(deepspeed in half_migrated.py)" in found["mixed"][0], found["mixed"][0]
