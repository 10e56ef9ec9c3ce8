"""Config loading: every format and alias, overrides, and one clear error for bad input."""
import json
import pickle
import textwrap
import warnings
from pathlib import Path

import pytest

from engine.batch_plan import plan_from_config
from engine.config import ALIASES, Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def load_quietly(source, overrides=None) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(source, overrides)


# -- the shipped configs ---------------------------------------------------------------
def test_mlp_yaml():
    config = load_config(CONFIGS / "mlp.yaml")
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (32, 4)
    assert config.optimizer.type == "AdamW" and config.optimizer.params["lr"] == 1e-3
    assert config.scheduler.type == "WarmupLR"
    assert config.gradient_clipping == 1.0 and config.zero_optimization.stage == 0
    assert config.source == str(CONFIGS / "mlp.yaml")
    assert plan_from_config(config, 2).gradient_accumulation_steps == 4


def test_deepspeed_json_loads_unchanged():
    path = CONFIGS / "deepspeed_zero2.json"
    original = json.loads(path.read_text())
    with pytest.warns(UserWarning, match="steps_per_print, wall_clock_breakdown"):
        config = load_config(path)
    assert config.train_batch_size == original["train_batch_size"]
    assert config.optimizer.model_dump() == original["optimizer"]
    assert config.scheduler.model_dump() == original["scheduler"]
    assert config.zero_optimization.model_dump() == {
        **original["zero_optimization"], "defer_reduction": False, "shard_unit_size": 16_000_000}
    assert config.zero_optimization.model_extra["overlap_comm"] is True
    assert config.deepspeed_extras == {"steps_per_print": 10, "wall_clock_breakdown": False}
    plan = plan_from_config(config, world_size=2)
    assert (plan.train_micro_batch_size_per_gpu, plan.gradient_accumulation_steps) == (4, 2)


def test_deepspeed_backend_uses_extras_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config({"backend": "deepspeed", "steps_per_print": 5,
                              "train_batch_size": 8})
    assert config.deepspeed_extras == {"steps_per_print": 5}


def test_colossal_python_config():
    config = load_config(CONFIGS / "param_unchanged.py")
    assert config.gradient_accumulation_steps == 4
    assert config.train_micro_batch_size_per_gpu == 2
    assert config.optimizer.type == "SGD" and config.optimizer.params == {"lr": 0.1}
    assert config.seed == 42
    assert config.constants == {"NUM_ITERATIONS": 8, "IN_FEATURES": 16}
    assert plan_from_config(config, 2).train_batch_size == 16


def test_balanced_yaml_with_cerebras_names():
    config = load_config(CONFIGS / "balanced.yaml")
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (30, 4)
    plan = plan_from_config(config, world_size=4, rank=3)
    assert plan.batch_split == "balanced" and plan.micro_batch_sizes == (4, 3)
    assert plan.notes


def test_python_config_skips_modules_functions_classes_and_private_names(tmp_path):
    path = write(tmp_path, "cfg.py", """
        import math
        from os import path as _path

        def helper():
            return 3

        class Thing:
            pass

        _scratch = 5
        HIDDEN_SIZE = 64
        train_batch_size = helper() * 4
        optimizer = {"type": "SGD", "params": {"lr": math.pi / 100}}
    """)
    config = load_config(path)
    assert config.train_batch_size == 12
    assert config.constants == {"HIDDEN_SIZE": 64}


# -- aliases ---------------------------------------------------------------------------
@pytest.mark.parametrize("alias, canonical", sorted(ALIASES.items()))
def test_every_alias(alias, canonical):
    value = {"enabled": True} if canonical == "bf16" else 4
    config = load_config({alias: value})
    assert getattr(config, canonical) == (config.bf16 if canonical == "bf16" else 4)
    assert alias not in config.to_dict()


def test_alias_equal_to_canonical_is_fine():
    assert load_config({"batch_size": 8, "train_batch_size": 8}).train_batch_size == 8


def test_alias_conflict(tmp_path):
    path = write(tmp_path, "c.yaml", """
        train_batch_size: 32
        batch_size: 16
    """)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}:2: batch_size: 16 conflicts with train_batch_size: 32 "
        "(batch_size is another name for train_batch_size; keep one)")


# -- other formats and features --------------------------------------------------------
def test_yaml_reads_exponent_floats(tmp_path):
    path = write(tmp_path, "c.yml", "optimizer: {type: Adam, params: {lr: 1e-3, eps: 1E-8}}\n")
    assert load_config(path).optimizer.params == {"lr": 1e-3, "eps": 1e-8}


def test_empty_yaml_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "c.yaml", "# nothing yet\n")).to_dict() == Config().to_dict()


def test_huggingface_auto_micro_batch():
    config = load_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"})
    assert config.train_micro_batch_size_per_gpu == "auto"
    assert plan_from_config(config, 4).micro_batch_mode == "auto"


def test_defaults_and_sections():
    config = Config()
    assert config.batch_split == "strict" and config.backend == "torch"
    assert config.gradient_clipping == 0.0 and config.zero_optimization.stage == 0
    assert config.fp16.loss_scale == 0 and config.fp16.initial_scale_power == 16
    assert config.distributed.timeout_seconds == 1800 and config.distributed.backend == "auto"
    assert config.batch_statistics == "warn" and config.constants == {}


def test_to_dict_round_trips_and_omits_source():
    config = load_quietly(CONFIGS / "deepspeed_zero2.json")
    plain = config.to_dict()
    assert "source" not in plain and "_source" not in plain
    assert plain["zero_optimization"]["overlap_comm"] is True
    again = load_quietly(plain)
    assert again.to_dict() == plain
    assert load_config(config) is config


# -- overrides -------------------------------------------------------------------------
def test_overrides_as_strings():
    config = load_quietly(CONFIGS / "mlp.yaml", [
        "zero_optimization.stage=2", "fp16.enabled=true", "optimizer.params.lr=1e-4",
        "gradient_accumulation=8", "train_micro_batch_size_per_gpu=2", "steps_per_print=7",
        "distributed.backend=gloo"])
    assert config.zero_optimization.stage == 2 and config.fp16.enabled is True
    assert config.optimizer.params == {"lr": 1e-4, "weight_decay": 0.01}
    assert config.gradient_accumulation_steps == 8
    assert config.deepspeed_extras == {"steps_per_print": 7}
    assert config.distributed.backend == "gloo"


def test_overrides_as_dict_and_on_a_config():
    base = load_config(CONFIGS / "mlp.yaml")
    config = load_config(base, {"zero_optimization.stage": 3, "seed": 7})
    assert (config.zero_optimization.stage, config.seed) == (3, 7)
    assert base.zero_optimization.stage == 0  # the original is untouched
    assert config.source == base.source


def test_override_creates_missing_sections():
    config = load_config({}, ["scheduler.type=OneCycleLR", "scheduler.params.max_lr=0.1"])
    assert config.scheduler.params == {"max_lr": 0.1}


def test_bad_overrides_are_reported_together():
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "mlp.yaml", ["zero_optimization.stagee=2", "nonsense",
                                           "optimizer.type.name=x", "seed=-1"])
    assert caught.value.problems == [
        "--set: 'nonsense': expected key.path=value",
        "--set: optimizer.type.name: optimizer.type is str, not a section with keys",
        "--set: zero_optimization.stagee: unknown key; did you mean stage?",
        "--set: seed: must be >= 0, got -1",
    ]


# -- errors ----------------------------------------------------------------------------
BAD_CONFIGS = [
    ("c.yaml", "gradient_acumulation_steps: 4\n",
     "{path}:1: gradient_acumulation_steps: unknown key; did you mean gradient_accumulation_steps?"),
    ("c.yaml", "fp16:\n  enabeld: true\n",
     "{path}:2: fp16.enabeld: unknown key; did you mean enabled?"),
    ("c.yaml", "zero_optimization:\n  stage: 2\n  overlap_com: true\n",
     "{path}:3: zero_optimization.overlap_com: unknown key; did you mean overlap_comm?"),
    ("c.yaml", "distributed:\n  port: 1\n",
     "{path}:2: distributed.port: unknown key; expected one of: timeout_seconds, agreement_timeout_seconds, backend"),
    ("c.yaml", "seed: abc\n", "{path}:1: seed: expected an integer, got 'abc' (str)"),
    ("c.yaml", "gradient_accumulation_steps: true\n",
     "{path}:1: gradient_accumulation_steps: expected an integer, got True (bool)"),
    ("c.yaml", "train_batch_size: 0\n", "{path}:1: train_batch_size: must be > 0, got 0"),
    ("c.yaml", "zero_optimization:\n  stage: 4\n",
     "{path}:2: zero_optimization.stage: must be <= 3, got 4"),
    ("c.yaml", "gradient_clipping: -1\n", "{path}:1: gradient_clipping: must be >= 0, got -1"),
    ("c.yaml", "batch_split: even\n",
     "{path}:1: batch_split: input should be 'strict' or 'balanced', got 'even'"),
    ("c.yaml", "train_micro_batch_size_per_gpu: fast\n",
     "{path}:1: train_micro_batch_size_per_gpu: expected a positive integer, 'auto' or "
     "'explore', got 'fast'"),
    ("c.yaml", "optimizer:\n  params: {lr: 0.1}\n", "{path}:1: optimizer.type: required key is missing"),
    ("c.yaml", "fp16: {enabled: true}\nbf16: {enabled: true}\n",
     "{path}:2: bf16: fp16.enabled and bf16.enabled are both true; enable at most one"),
    ("c.json", '{\n  "train_batch_size": "auto"\n}\n',
     "{path}:2: train_batch_size: expected an integer, got 'auto' (str); 'auto' (a Hugging "
     "Face Trainer placeholder) is only understood for train_micro_batch_size_per_gpu: give a value"),
    ("c.json", '{\n  "train_batch_size": 8,\n  "seed": 1,\n}\n',
     "{path}:4:1: invalid JSON: Expecting property name enclosed in double quotes "
     "(trailing comma? JSON allows no comma after the last item, line 3)"),
    ("c.json", '{\n  "seed": 1 // the seed\n}\n',
     "{path}:2:13: invalid JSON: Expecting ',' delimiter (JSON does not allow comments)"),
    ("c.json", "[1, 2]\n", "{path}: the top level must be a mapping of keys, got list"),
    ("c.yaml", "fp16:\n\tenabled: true\n",
     "{path}:2:1: invalid YAML: found character '\\t' that cannot start any token "
     "(YAML forbids tabs for indentation; indent with spaces)"),
    ("c.yaml", "seed: 1\n  batch_split: strict\n",
     "{path}:2:14: invalid YAML: mapping values are not allowed here"),
    ("c.py", "seed = 1\ntrain_batch_size = undefined_name\n",
     "{path}:2: NameError: name 'undefined_name' is not defined"),
    ("c.py", "seed = 1\nif True\n    seed = 2\n", "{path}:2: SyntaxError: expected ':'"),
    ("c.py", "seed = 1 / 0\n", "{path}:1: ZeroDivisionError: division by zero"),
    ("c.py", "lr = 0.1\n", "{path}:1: lr: unknown key"),
    ("c.toml", "seed = 1\n", "{path}: unsupported config format '.toml'; use .yaml, .yml, .json or .py"),
]


@pytest.mark.parametrize("name, text, expected", BAD_CONFIGS)
def test_bad_configs(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == expected.format(path=path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_wrong_source_type():
    with pytest.raises(ConfigError, match="must be a path, a dict or an engine.Config, got int"):
        load_config(3)


def test_several_problems_in_one_error(tmp_path):
    path = write(tmp_path, "c.yaml", """
        train_batch_size: 32
        gradient_acumulation_steps: 4
        optimizer:
          type: AdamW
          parms: {lr: 0.1}
        zero_optimization:
          stage: 9
        seed: -3
    """)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}:2: gradient_acumulation_steps: unknown key; did you mean gradient_accumulation_steps?",
        f"{path}:5: optimizer.parms: unknown key; did you mean params?",
        f"{path}:7: zero_optimization.stage: must be <= 3, got 9",
        f"{path}:8: seed: must be >= 0, got -3",
    ]
    assert str(caught.value) == "\n".join(caught.value.problems)


def test_dict_source_errors_name_the_dict():
    with pytest.raises(ConfigError, match=r"^<dict>: fp16\.enabled: expected true or false"):
        load_config({"fp16": {"enabled": "yes please"}})


def test_config_error_survives_pickling():
    error = ConfigError(["a: one", "b: two"])
    assert isinstance(error, ValueError)
    assert pickle.loads(pickle.dumps(error)).problems == ["a: one", "b: two"]
