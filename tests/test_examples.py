"""The example recipes load, validate, and run one step as shipped (on the tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpokit.config import load_config
from grpokit.train.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", ["gsm8k", "math"])
def test_recipe_runs_one_step(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes name their sample files relative to the repository
    cfg = load_config(
        ROOT / "examples" / recipe / "train.yaml",
        [
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=8",
            "train.quiet=true",
            "data.max_prompt_length=null",
        ],
    )
    summary = GRPOTrainer(cfg).train()
    assert summary["steps"] == 1 and summary["accuracy_before"] is not None
