"""LoRA: only adapters train, the reference is the adapter-off base (no copy), checkpoints and export."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.algo import LossSpec
from grpokit.config import load_config
from grpokit.models.loading import load_model
from grpokit.rollout.decode import onednn_linear_available
from grpokit.rollout.sampler import SamplingParams, sample
from grpokit.train.batch import TrainBatch, accumulate_policy_gradient, batch_logprobs, plan_micro_batches
from grpokit.train.trainer import GRPOTrainer
from tests.helpers import varied


def make(tmp_path, tiny_dir, name="run", **sets):
    base = {
        "model.name_or_path": str(tiny_dir),
        "train.output_dir": str(tmp_path / name),
        "train.quiet": True,
        "train.max_steps": 3,
        "train.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 5,
        "train.eval_max_prompts": 4,
        "train.lr": 1e-2,
        "algo.beta": 0.1,
        "model.lora": {"r": 4, "alpha": 8},
        "rollout.temperature": 1.3,
    }
    base.update(sets)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in base.items()])


def test_only_adapters_train_and_the_reference_is_the_base(tmp_path, tiny_dir):
    trainer = GRPOTrainer(make(tmp_path, tiny_dir), rewards=[varied])
    assert trainer.ref_model is None and trainer.adapter_ref  # no second copy of the weights
    base_before = {k: v.clone() for k, v in trainer.model.named_parameters() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in trainer.model.named_parameters() if "lora_" in k}
    assert lora_before and all(
        not p.requires_grad for k, p in trainer.model.named_parameters() if "lora_" not in k
    )
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in base_before.items())
    assert any(not torch.equal(params[k], v) for k, v in lora_before.items())
    # the adapter-off model is exactly the untouched base
    plain, tok = load_model(str(tiny_dir))
    rollout = sample(
        plain, tok, ["12+3=", "4="], 2, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0)
    )
    batch = TrainBatch.from_rollout(rollout, torch.zeros(4))
    plan = plan_micro_batches(batch.total_lengths(), 8)
    with trainer.model.disable_adapter():
        ref = batch_logprobs(trainer.model, batch, plan, 0, 1.0)
    torch.testing.assert_close(ref, batch_logprobs(plain, batch, plan, 0, 1.0), rtol=0, atol=1e-6)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kl"] > 0  # the adapters moved the policy away from the base


def test_lora_resume_is_exact_and_export_merges(tmp_path, tiny_dir):
    GRPOTrainer(make(tmp_path, tiny_dir, "full", **{"train.save_every": 1}), rewards=[varied]).train()
    GRPOTrainer(
        make(tmp_path, tiny_dir, "cut", **{"train.save_every": 1, "train.max_steps": 2}), rewards=[varied]
    ).train()
    GRPOTrainer(make(tmp_path, tiny_dir, "cut", **{"train.save_every": 1}), rewards=[varied]).train(
        resume="auto"
    )

    def strip(path):
        keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per"))}  # noqa: E731
        return [keep(json.loads(x)) for x in path.read_text().splitlines()]

    assert strip(tmp_path / "cut" / "metrics.jsonl") == strip(tmp_path / "full" / "metrics.jsonl")
    out = tmp_path / "exported"
    res = subprocess.run(
        [sys.executable, "-m", "grpokit", "export", str(tmp_path / "full"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert not (out / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out)
    peft_model, _ = load_model(str(tmp_path / "full" / "final"))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def count_layer_forwards(model) -> list[int]:
    """Hooks on every decoder layer's MLP counting its calls while gradients are recorded: in a
    checkpointed layer it runs twice (the forward, then the recompute in the backward). (A pre-hook on
    the MLP, not the layer: transformers checkpoints the layer's ``forward``, inside its hooks, and
    torch's recompute stops early, right after the last tensor it needs, before the MLP returns.)"""
    calls = [0]

    def count(*_) -> None:
        calls[0] += torch.is_grad_enabled()

    for layer in model.get_decoder().layers:
        layer.mlp.register_forward_pre_hook(count)
    return calls


@pytest.mark.parametrize("share", [False, True])  # shared: the backward's recompute attends by layout
def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes(tiny_dir, share):
    from grpokit.models.loading import SharingCosts

    grads, forwards = [], []
    for checkpointing in (False, True):
        model, tok = load_model(str(tiny_dir), gradient_checkpointing=checkpointing)
        model = model.double()
        calls = count_layer_forwards(model)
        rollout = sample(
            model,
            tok,
            ["1+2=", "33="],
            3,
            SamplingParams(max_new_tokens=4, temperature=1.5),
            torch.Generator().manual_seed(1),
        )
        batch = TrainBatch.from_rollout(rollout, torch.tensor([1.0, -1.0, 0.5, 0.2, -0.3, 0.1]))
        model.train(checkpointing)
        plan = [list(range(6))] if share else plan_micro_batches(batch.total_lengths(), 2)
        layout = {"share": SharingCosts(1.0, 0.0)} if share else {}
        stats = accumulate_policy_gradient(model, batch, plan, 0, temperature=1.0, loss=LossSpec(), **layout)
        assert stats.shared_rows == (6 if share else 0)
        grads.append([p.grad.clone() for p in model.parameters()])
        forwards.append(calls[0])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert forwards[0] > 0 and forwards[1] == 2 * forwards[0]


def test_the_trainer_engages_gradient_checkpointing(tmp_path, tiny_dir):
    forwards = []
    for checkpointing in (False, True):
        cfg = make(
            tmp_path,
            tiny_dir,
            f"gc-{checkpointing}",
            **{
                "model.gradient_checkpointing": checkpointing,
                "model.lora": None,
                "algo.beta": 0.0,
                "train.max_steps": 1,
                "train.eval_every": 0,
            },
        )
        trainer = GRPOTrainer(cfg, rewards=[varied])
        calls = count_layer_forwards(trainer.model)
        trainer.step = 1  # as train() does before each step
        trainer.train_step()
        forwards.append(calls[0])
    assert forwards[0] > 0 and forwards[1] == 2 * forwards[0]


def test_lora_options_are_validated():
    from grpokit.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.lora.r: must be >= 1"):
        load_config(None, ["model.lora={r: 0}"])
    with pytest.raises(ConfigError, match=r"cannot be used with model\.lora"):
        load_config(None, ["model.lora={r: 4}", "algo.ref_sync_every=2"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model.lora.rank'; known keys: r, alpha"):
        load_config(None, ["model.lora={rank: 4}"])


@pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear in this torch")
def test_sampler_and_trainer_log_probs_agree_with_packed_lora_bases(tmp_path, tiny_dir, monkeypatch):
    """Every projection packed for oneDNN (PACK_NUMEL 0 here), LoRA bases fused and adapters
    stacked: the sampler's log-probs are the trainer's (peft's modules, F.linear) to float32
    round-off, at every step, while the adapters move."""
    import grpokit.rollout.decode as decode

    monkeypatch.setattr(decode, "PACK_NUMEL", 0)
    built = []
    real = decode.OwnDecoder.__init__

    def spy(self, model, *args):
        real(self, model, *args)
        qkv = self.layers[0].qkv[0]
        built.append((type(qkv.base).__name__, len(qkv.adapters)))

    monkeypatch.setattr(decode.OwnDecoder, "__init__", spy)
    GRPOTrainer(make(tmp_path, tiny_dir), rewards=[varied]).train()
    assert len(built) >= 3 and set(built) == {("Packed", 1)}  # every call: packed, one stacked adapter
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["logprob_mismatch"] < 1e-5 and r["logprob_ratio_outside"] == 0 for r in rows)
