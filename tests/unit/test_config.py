"""Config loading: every format and alias, overrides, and one clear error for bad input."""
import json
import pickle
import re
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from engine.batching.plan import plan_from_config
from engine.config.deepspeed import DEEPSPEED_TOP_LEVEL_KEYS
from engine.config.schema import ALIASES, Config, ConfigError, load_config
from engine.errors import BatchConfigError
from engine.config.colossalai import COLOSSALAI_TOP_LEVEL_KEYS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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
        **original["zero_optimization"], "defer_reduction": False, "shard_unit_size": 16_000_000,
        "shard_size": None}
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


def test_python_config_skips_modules_functions_classes_imported_and_private_names(tmp_path):
    path = write(tmp_path, "cfg.py", """
        import math
        from os import path as _path
        from math import e, tau as TWO_PI

        def helper():
            return 3

        class Thing:
            pass

        _scratch = 5
        HIDDEN_SIZE = 64
        train_batch_size = helper() * 4
        optimizer = {"type": "SGD", "params": {"lr": math.pi / 100 + e - e}}
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
    ("c.py", "lr = 0.1\n",
     "{path}:1: lr: unknown key (a value of your own? name it in UPPER_CASE: it is kept in constants)"),
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


# -- Colossal-AI (legacy API) configs as written ----------------------------------------
TORCH_SCALER = {"fp16.enabled": True, "fp16.initial_scale_power": 16, "fp16.loss_scale_window": 2000,
                "fp16.hysteresis": 1, "fp16.loss_scale": 0.0}

# (id, config.py text, expected attribute values, warning substrings, error or None)
COLOSSAL_SHAPES = [
    ("issue", """
        from colossalai.amp import AMP_TYPE
        BATCH_SIZE = 128
        NUM_EPOCHS = 200
        gradient_accumulation = 4
        clip_grad_norm = 1.0
        fp16 = dict(mode=AMP_TYPE.TORCH)
        parallel = dict(pipeline=1, tensor=dict(size=1, mode=None))
        logging = dict(root_path='./logs')
        num_epochs = 2
     """, {**TORCH_SCALER, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
           "train_batch_size": None, "constants": {"BATCH_SIZE": 128, "NUM_EPOCHS": 200},
           "colossalai_extras": {"logging": {"root_path": "./logs"}, "num_epochs": 2}},
     ["kept in config.colossalai_extras: logging, num_epochs"], None),
    ("tutorial accumulation", """
        from colossalai.legacy.amp import AMP_TYPE
        BATCH_SIZE = 128
        gradient_accumulation = 4
     """, {"gradient_accumulation_steps": 4, "fp16.enabled": False, "constants": {"BATCH_SIZE": 128}},
     [], None),
    ("torch AMP with scaler keys", """
        from colossalai.amp import AMP_TYPE
        fp16 = dict(mode=AMP_TYPE.TORCH, init_scale=2.**10, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=500, enabled=True)
        clip_grad_norm = 0.5
     """, {**TORCH_SCALER, "fp16.initial_scale_power": 10, "fp16.loss_scale_window": 500,
           "gradient_clipping": 0.5}, [], None),
    ("torch AMP without its grad scaler", """
        from colossalai.amp import AMP_TYPE
        fp16 = dict(mode=AMP_TYPE.TORCH, enabled=False, growth_factor=4.0)
     """, {"fp16.enabled": True, "fp16.loss_scale": 1.0},
     ["fp16.growth_factor: 4.0 is not used: Microstep's loss scale always doubles"], None),
    ("own fp16 keys next to the mode", """
        fp16 = dict(mode='torch', growth_interval=500, loss_scale_window=10, min_loss_scale=0.5)
     """, {**TORCH_SCALER, "fp16.loss_scale_window": 10, "fp16.min_loss_scale": 0.5}, [], None),
    ("naive AMP", """
        from colossalai.amp import AMP_TYPE
        fp16 = dict(mode=AMP_TYPE.NAIVE, log_num_zeros_in_grad=False, initial_scale=2 ** 16,
                    min_scale=2, growth_factor=2, backoff_factor=0.5, growth_interval=100, hysteresis=3)
        clip_grad_norm = 1.0
     """, {"fp16.enabled": True, "fp16.initial_scale_power": 16, "fp16.min_loss_scale": 2.0,
           "fp16.loss_scale_window": 100, "fp16.hysteresis": 3, "gradient_clipping": 1.0},
     ["fp16.mode NAIVE: Colossal-AI's naive AMP casts the whole model to fp16",
      "fp16.log_num_zeros_in_grad: not used by Microstep (Colossal-AI naive AMP setting)"], None),
    ("apex AMP", """
        from colossalai.amp import AMP_TYPE
        fp16 = dict(mode=AMP_TYPE.APEX, enabled=True, opt_level='O1', cast_model_type=None,
                    loss_scale=None, min_loss_scale=None, max_loss_scale=16777216.0)
     """, {**TORCH_SCALER, "fp16.min_loss_scale": 1.0},
     ["fp16.mode APEX: apex is not used", "fp16.opt_level: not used by Microstep",
      "fp16.max_loss_scale: not used by Microstep"], None),
    ("apex AMP, fixed scale", """
        fp16 = dict(mode='apex', loss_scale=128.0)
     """, {"fp16.enabled": True, "fp16.loss_scale": 128.0}, ["apex is not used"], None),
    ("ZeRO level 3, fp32", """
        from colossalai.amp import AMP_TYPE
        BATCH_SIZE = 16
        fp16 = dict(mode=None)
        zero = dict(level=3, offload_optimizer_config=dict(device='cpu', pin_memory=True))
        parallel = dict(pipeline=dict(size=1), tensor=dict(size=1, mode=None))
     """, {"fp16.enabled": False, "zero_optimization.stage": 0,
           "colossalai_extras": {"zero": {"level": 3, "offload_optimizer_config": {
               "device": "cpu", "pin_memory": True}}}},
     ["zero (for ZeRO set zero_optimization: {stage: 0..3})"], None),
    ("sharded model with a colossalai class", """
        from colossalai.amp import AMP_TYPE
        from colossalai.zero.shard_utils import TensorShardStrategy
        fp16 = dict(mode=AMP_TYPE.TORCH)
        zero = dict(model_config=dict(shard_strategy=TensorShardStrategy()),
                    optimizer_config=dict(initial_scale=2 ** 5))
        cudnn_benchmark = True
        parallel = dict(data=2, pipeline=1)
     """, {**TORCH_SCALER},
     ["cudnn_benchmark (set torch.backends.cudnn.benchmark in the script)", "zero (for ZeRO"], None),
    ("tensor parallel", """
        parallel = dict(pipeline=1, tensor=dict(mode='1d', size=2))
     """, {"tensor_parallel.size": 2, "tensor_parallel.plan": "auto"}, [], None),
    ("tensor parallel 2d", """
        parallel = dict(tensor=dict(mode='2d', size=4))
     """, {}, [],
     "{path}:1: parallel.tensor: mode '2d': Microstep's tensor parallelism is 1-D (PyTorch's column / row "
     "split, Colossal-AI's mode '1d'); set mode='1d', or keep Colossal-AI for its 2d / 2.5d / 3d modes"),
    ("tensor parallel twice", """
        parallel = dict(tensor=dict(mode='1d', size=4))
        tensor_parallel = dict(size=2)
     """, {}, [],
     "{path}:1: parallel.tensor: size 4 conflicts with tensor_parallel.size: 2; keep one"),
    ("pipeline parallel and a typo", """
        parallel = dict(
            pipeline=dict(size=2),
            tensr=dict(size=1),
        )
     """, {}, [],
     "{path}:3: parallel.tensr: unknown key; did you mean tensor?"),
    ("pipeline parallel", """
        parallel = dict(pipeline=2, tensor=dict(size=1, mode=None))
     """, {"pipeline.stages": 2}, [], None),
    ("pipeline and tensor parallel: the 3-D mesh", """
        parallel = dict(pipeline=2, tensor=dict(size=2, mode='1d'))
     """, {"pipeline.stages": 2, "tensor_parallel.size": 2}, [], None),
    ("pipeline parallel written twice", """
        parallel = dict(pipeline=2)
        pipeline = dict(stages=4)
     """, {}, [],
     "{path}:1: parallel.pipeline: size 2 conflicts with pipeline.stages: 4; keep one"),
    ("unknown AMP mode", """
        fp16 = dict(mode='bf16')
     """, {}, [],
     "{path}:1: fp16.mode: 'bf16' is not a Colossal-AI AMP mode; use AMP_TYPE.TORCH, AMP_TYPE.NAIVE, "
     "AMP_TYPE.APEX or None (no fp16)"),
    ("scale that is no power of two", """
        from colossalai.amp import AMP_TYPE
        fp16 = dict(mode=AMP_TYPE.TORCH,
                    init_scale=1000.0)
     """, {}, [],
     "{path}:3: fp16.init_scale: 1000.0 is not a power of 2; Microstep's dynamic loss scale starts at "
     "2**initial_scale_power: give a power of 2"),
    ("clipping written twice", """
        clip_grad_norm = 1.0
        gradient_clipping = 0.5
     """, {}, [],
     "{path}:1: clip_grad_norm: 1.0 conflicts with gradient_clipping: 0.5 (clip_grad_norm is another "
     "name for gradient_clipping; keep one)"),
    ("typos", """
        clip_grad_nrom = 1.0
        num_epoch = 3
     """, {}, [],
     "{path}:1: clip_grad_nrom: unknown key; did you mean clip_grad_norm? (a value of your own? name it "
     "in UPPER_CASE: it is kept in constants)\n"
     "{path}:2: num_epoch: unknown key; did you mean num_epochs? (a value of your own? name it in "
     "UPPER_CASE: it is kept in constants)"),
]


def attribute(config: Config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("text, expected, warned, error",
                         [shape[1:] for shape in COLOSSAL_SHAPES], ids=[shape[0] for shape in COLOSSAL_SHAPES])
def test_colossal_config_shapes(tmp_path, text, expected, warned, error):
    path = write(tmp_path, "config.py", text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if error is not None:
            with pytest.raises(ConfigError) as raised:
                load_config(path)
            assert str(raised.value) == error.format(path=path)
            return
        config = load_config(path)
    assert {key: attribute(config, key) for key in expected} == expected
    messages = [str(warning.message) for warning in caught]
    for fragment in warned:
        assert any(fragment in message for message in messages), (fragment, messages)
    if not warned:
        assert messages == []


def test_colossal_stand_ins_exist_only_while_the_config_runs(tmp_path):
    path = write(tmp_path, "config.py", """
        import colossalai
        from colossalai.amp import AMP_TYPE
        from colossalai.nn.optimizer import HybridAdam
        fp16 = dict(mode=AMP_TYPE.NAIVE)
        zero = dict(optimizer=HybridAdam, launch=colossalai.launch_from_torch)
    """)
    finders = list(sys.meta_path)
    config = load_quietly(path)
    assert config.fp16.enabled and config.fp16.initial_scale_power == 32
    assert not [name for name in sys.modules if name.partition(".")[0] == "colossalai"]
    assert sys.meta_path == finders
    assert repr(config.colossalai_extras["zero"]["optimizer"]) == \
        "<colossalai.nn.optimizer.HybridAdam: colossalai is not installed>"
    again = pickle.loads(pickle.dumps(config))  # checkpoints pickle the config
    assert repr(again.colossalai_extras["zero"]["launch"]) == \
        "<colossalai.launch_from_torch: colossalai is not installed>"
    with pytest.raises(ModuleNotFoundError):
        __import__("colossalai")


def test_colossal_stand_in_where_a_value_is_needed_is_an_error(tmp_path):
    path = write(tmp_path, "config.py", """
        from colossalai.nn.optimizer import HybridAdam
        optimizer = dict(type=HybridAdam, params=dict(lr=1e-3))
    """)
    with pytest.raises(ConfigError, match=r":2: optimizer.type: expected a string, got "
                                          r"<colossalai.nn.optimizer.HybridAdam: colossalai is not installed>"):
        load_config(path)


def test_an_installed_colossalai_is_imported_for_real(tmp_path, monkeypatch):
    package = tmp_path / "site" / "colossalai"
    (package / "amp").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "amp" / "__init__.py").write_text(
        "import enum\nclass AMP_TYPE(enum.Enum):\n    TORCH = 'torch'\n    REAL = 'real'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        config = load_config(write(tmp_path, "config.py", """
            from colossalai.amp import AMP_TYPE
            fp16 = dict(mode=AMP_TYPE.TORCH)
            REAL = AMP_TYPE.REAL
        """))
        assert config.fp16.enabled and config.constants["REAL"].value == "real"
        assert sys.modules["colossalai.amp"].__file__ == str(package / "amp" / "__init__.py")
    finally:
        for name in [name for name in sys.modules if name.partition(".")[0] == "colossalai"]:
            del sys.modules[name]


def test_colossal_and_deepspeed_pass_through_keys_are_distinct():
    assert not set(COLOSSALAI_TOP_LEVEL_KEYS) & DEEPSPEED_TOP_LEVEL_KEYS
    assert not set(COLOSSALAI_TOP_LEVEL_KEYS) & set(Config.model_fields)


def test_colossal_keys_in_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "c.yaml", """
        fp16: {mode: torch}
        num_epochs: 3
    """)
    with pytest.warns(UserWarning, match="colossalai_extras: logging, num_epochs"):
        config = load_config(path, ["logging.root_path=./logs", "clip_grad_norm=2"])
    assert config.fp16.enabled and config.fp16.loss_scale_window == 2000
    assert config.colossalai_extras == {"num_epochs": 3, "logging": {"root_path": "./logs"}}
    assert config.gradient_clipping == 2.0


# -- papercuts (issue 34) ----------------------------------------------------------------------------------
def test_text_where_an_optimizer_takes_a_number_is_named_not_failed_on_inside_torch():
    from engine.config.checks import check_without_model

    config = load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "3e-4x", "eps": 1e-8}}})
    assert check_without_model(config) == [
        "<dict>: optimizer.params.lr: expected a number, got the text '3e-4x' (e.g. lr: 0.001)"]


def test_a_pipeline_split_without_a_pipeline_is_said_to_have_no_effect():
    with pytest.warns(UserWarning, match=r"pipeline.split \['blocks.2'\] has no effect with pipeline.stages 1"):
        load_config({"train_batch_size": 8, "pipeline": {"split": ["blocks.2"]}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto, the default, written or not: nothing to say
        load_config({"train_batch_size": 8, "pipeline": {"stages": 1, "split": "auto"}})


def test_a_way_of_counting_the_window_routers_beside_a_per_micro_batch_term_is_refused():
    from engine.config.checks import check_without_model

    problems = check_without_model(load_config({"train_batch_size": 8, "moe": {"load_balance": "micro_batch",
                                                                               "global_counts": "hold_forwards"}}))
    assert any("moe.global_counts: hold_forwards says how the window's router counts are learnt" in p
               and "load_balance: micro_batch" in p for p in problems), problems
    assert not check_without_model(load_config({"train_batch_size": 8, "moe": {"load_balance": "micro_batch"}}))


@pytest.mark.parametrize("text, expected", [
    ("batch_size: 30\ngradient_accumulation: 4\nmicro_batch_size: 4\n",
     "batch_size 30 is not divisible by world size 4"),  # the planner's words, as the Cerebras / Colossal keys
    ("per_device_train_batch_size: 0\n",
     "per_device_train_batch_size: expected a positive integer"),  # the schema's, as Hugging Face's key
])
def test_errors_name_the_key_as_the_user_wrote_it(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises((ConfigError, BatchConfigError)) as caught:
        plan_from_config(load_config(path), 4)
    assert expected in str(caught.value)
    assert not re.search(r"(?<!\w)(train_batch_size|train_micro_batch_size_per_gpu)\b", str(caught.value))
