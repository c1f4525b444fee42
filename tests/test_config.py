"""Configuration: YAML + overrides, presets, and a clear error for every bad value."""

from __future__ import annotations

import pytest

from grpokit.config import ConfigError, GRPOConfig, describe, load_config


def test_defaults_validate_and_resolve_the_preset():
    cfg = GRPOConfig()
    assert cfg.algorithm == "grpo" and cfg.algo.estimator == "grpo" and cfg.algo.beta == 0.04
    assert cfg.algo.clip_high == cfg.algo.clip_low == 0.2
    assert cfg.data.task == "addition" and cfg.rewards[0].name == "task_verifier"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        'train:\n  max_steps: 10\n  lr: 1e-5\nalgo:\n  clip_low: 0.1\nrollout:\n  stop: ["\\n"]\n'
    )
    cfg = load_config(
        path, ["train.max_steps=6", "algo.clip_high=0.28", "rewards=[{name: task_verifier, weight: 2}]"]
    )
    assert cfg.train.max_steps == 6 and cfg.train.lr == 1e-5  # YAML's "1e-5" string is accepted as a number
    assert cfg.algo.clip_low == 0.1 and cfg.algo.clip_high == 0.28 and cfg.rollout.stop == ["\n"]
    assert cfg.rewards[0].weight == 2.0
    # an explicit algo field beats the preset; an unset clip_high follows clip_low
    assert load_config(None, ["algo.clip_low=0.1"]).algo.clip_high == 0.1


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.max_steps=7", "rollout.top_k=5"])
    cfg.save(tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_step=3", "unknown config key 'train.max_step'; did you mean 'train.max_steps'?"),
        ("trian.max_steps=3", "unknown config key 'trian'"),
        ("train.max_steps=three", "train.max_steps: expected an integer, got 'three'"),
        ("train.max_steps=0", "train.max_steps: must be >= 1, got 0"),
        ("train.lr=-1", "train.lr: must be > 0, got -1.0"),
        ("train.lr=fast", "train.lr: expected a number, got 'fast'"),
        ("train.quiet=maybe", "train.quiet: expected true or false, got 'maybe'"),
        (
            "train.lr_schedule=linear",
            "train.lr_schedule: 'linear' is not allowed; choose one of constant, cosine",
        ),
        ("train.micro_batch_tokens=0", "train.micro_batch_tokens: must be >= 1 or null"),
        ("rollout.group_size=1", "rollout.group_size: must be an int >= 2"),
        ("rollout.temperature=0", "rollout.temperature: must be > 0"),
        ("rollout.top_p=1.5", "rollout.top_p: must be in (0, 1]"),
        ("rollout.top_k=-1", "rollout.top_k: must be >= 0"),
        ("rollout.stop=['']", "rollout.stop: must be a list of non-empty strings"),
        ("rollout.stop=x", "rollout.stop: expected a list, got 'x'"),
        ("rollout.engine=sglang", "rollout.engine: 'sglang' is not allowed; choose one of builtin, vllm"),
        ("algorithm=ppo", "algorithm: 'ppo' is not allowed; choose one of grpo"),
        ("algo.estimator=ppo", "algo.estimator: 'ppo' is not allowed; choose one of grpo, dr_grpo, rloo"),
        ("algo.estimator=dr_grpo", "algo.scale: dr_grpo means no std scaling, got 'group'"),
        ("algo.scale=std", "algo.scale: 'std' is not allowed"),
        ("algo.aggregation=mean", "algo.aggregation: 'mean' is not allowed"),
        ("algo.ratio_level=seq", "algo.ratio_level: 'seq' is not allowed; choose one of token, sequence"),
        ("algo.clip_low=1.0", "algo.clip_low: must be in [0, 1)"),
        ("algo.clip_high=-0.1", "algo.clip_high: must be >= 0"),
        ("algo.beta=-0.1", "algo.beta: must be >= 0"),
        ("algo.kl=k4", "algo.kl: 'k4' is not allowed; choose one of k1, k2, k3"),
        ("model.dtype=int8", "model.dtype: 'int8' is not allowed"),
        ("data.task=chess", "data.task: 'chess' is not allowed; choose one of addition"),
        ("data.task=null", "data: set data.task (a built-in task) or data.path (a JSONL file)"),
        ("data.path=x.jsonl", "data: set data.task or data.path, not both"),
        ("rewards=[]", "rewards: at least one reward is needed"),
        ("rewards=[{nam: x}]", "unknown config key 'rewards[0].nam'; did you mean 'rewards[0].name'?"),
        ("train=5", "train: expected a mapping of keys, got 5"),
        ("train.max_steps", "override 'train.max_steps' must look like key=value"),
    ],
)
def test_every_bad_value_names_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_every_option_has_help():
    rows = describe()
    assert len(rows) > 30
    assert all(help_text for _, _, help_text in rows), [k for k, _, h in rows if not h]


def test_configuration_doc_is_up_to_date():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "config_reference.py"
    res = subprocess.run([sys.executable, str(script), "--check"])
    assert res.returncode == 0, "docs/configuration.md is stale: run scripts/config_reference.py"


@pytest.mark.parametrize(
    ("key", "table"),
    [
        ("algo.estimator", "grpokit.algo.advantages:ESTIMATORS"),
        ("algo.scale", "grpokit.algo.advantages:SCALES"),
        ("algo.aggregation", "grpokit.algo.losses:AGGREGATIONS"),
        ("algo.ratio_level", "grpokit.algo.losses:RATIO_LEVELS"),
        ("algo.surrogate", "grpokit.algo.losses:SURROGATES"),
        ("algo.kl", "grpokit.algo.kl:KL_KINDS"),
    ],
)
def test_algo_choices_are_the_algo_tables(monkeypatch, key, table):
    import dataclasses
    import importlib

    module, name = table.split(":")
    choices = tuple(getattr(importlib.import_module(module), name))
    field = next(f for f in dataclasses.fields(GRPOConfig().algo) if f.name == key.split(".")[1])
    assert all(c in field.metadata["help"] for c in choices), "the option's help lists every choice"
    for choice in choices:
        extra = ["algo.scale=none"] if key == "algo.estimator" and choice == "dr_grpo" else []
        if key == "algo.scale" and choice != "none":
            extra = ["algo.estimator=grpo"]
        load_config(None, [f"{key}={choice}", *extra])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [f"{key}=not_a_choice"])
    # a variant added to the table is accepted by the config without touching config.py
    extended = {**dict.fromkeys(choices), "new_variant": None}
    table_obj = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(
        importlib.import_module(module), name, extended if isinstance(table_obj, dict) else tuple(extended)
    )
    load_config(None, [f"{key}=new_variant"])
