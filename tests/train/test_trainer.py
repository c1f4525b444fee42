"""End-to-end GRPO runs on a tiny model: finite metrics, a real learning signal, determinism."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from grpokit.config import load_config
from grpokit.models.loading import load_model
from grpokit.rewards.registry import WeightedReward
from grpokit.train.optim import learning_rate
from grpokit.train.trainer import GRPOTrainer
from tests.helpers import TIME_KEYS, varied

CONTRACT_KEYS = {
    "step",
    "loss",
    "reward_mean",
    "reward_std",
    "kl",
    "clip_fraction",
    "completion_length_mean",
    "zero_std_fraction",
    "tokens_per_s",
    "time_sampling_s",
    "time_scoring_s",
    "time_training_s",
}


def config(tmp_path, model_dir, name="run", **sets):
    base = {
        "model.name_or_path": str(model_dir),
        "train.output_dir": str(tmp_path / name),
        "train.quiet": True,
        "train.max_steps": 3,
        "train.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "train.eval_max_prompts": 16,
        "rollout.temperature": 1.2,
    }
    base.update(sets)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in base.items()])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_steps_end_to_end(tmp_path, tiny_dir):
    cfg = config(tmp_path, tiny_dir, **{"train.mu": 2, "train.micro_batch_size": 5})
    summary = GRPOTrainer(cfg).train()
    run = tmp_path / "run"
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(r) >= CONTRACT_KEYS
        for k in CONTRACT_KEYS | {"entropy", "grad_norm", "ratio_mean", "advantage_std", "lr"}:
            assert r[k] is not None and math.isfinite(r[k]), k
    assert summary["steps"] == 3 and summary["world_size"] == 1 and summary["wall_time_s"] > 0
    assert summary["task"] == "addition" and "accuracy_before" in summary and "accuracy_after" in summary
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    samples = [json.loads(s) for s in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 4 and {"prompt", "completion", "reward", "advantage"} <= set(samples[0])
    reloaded = load_config(run / "config.yaml")
    assert reloaded.to_dict() == cfg.to_dict()
    model, _ = load_model(str(run / "final"))
    assert sum(p.numel() for p in model.parameters()) > 0


def first_token_prob(model, tok, prompts, char):
    target = tok.convert_tokens_to_ids(char)
    with torch.no_grad():
        probs = []
        for p in prompts:
            logits = model(input_ids=torch.tensor([tok(p)["input_ids"]])).logits[0, -1]
            probs.append(torch.softmax(logits, -1)[target])
    return float(torch.stack(probs).mean())


def test_reward_for_a_token_raises_its_probability(tmp_path, tiny_dir):
    model, tok = load_model(str(tiny_dir))

    def likes_seven(prompts, completions, **_):
        return [1.0 if c.startswith("7") else 0.0 for c in completions]

    cfg = config(
        tmp_path,
        tiny_dir,
        **{
            "train.max_steps": 20,
            "train.lr": 1e-2,
            "algo.beta": 0.0,
            "rollout.group_size": 8,
            "rollout.max_new_tokens": 2,
        },
    )
    held_out = ["3+4=", "12+9=", "55+1="]
    before = first_token_prob(model, tok, held_out, "7")
    GRPOTrainer(cfg, model=model, tokenizer=tok, rewards=[WeightedReward("likes_seven", likes_seven)]).train()
    after = first_token_prob(model, tok, held_out, "7")
    # measured: about 0.012 -> 0.7 in 20 steps; a real signal, not noise
    assert before < 0.03 and after > 0.3, (before, after)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "run")]
    assert sum(rewards[-5:]) > sum(rewards[:5])


def strip_times(rows):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS and not k.startswith("eval_")} for r in rows]


def test_same_seed_same_run_and_eval_every_does_not_change_training(tmp_path, tiny_dir):
    a = config(tmp_path, tiny_dir, "a", **{"algo.beta": 0.0, "train.lr": 1e-3})
    b = config(tmp_path, tiny_dir, "b", **{"algo.beta": 0.0, "train.lr": 1e-3})
    c = config(tmp_path, tiny_dir, "c", **{"algo.beta": 0.0, "train.lr": 1e-3, "train.eval_every": 1})
    for cfg in (a, b, c):
        GRPOTrainer(cfg).train()
    ra, rb, rc = (read_metrics(tmp_path / n) for n in "abc")
    assert strip_times(ra) == strip_times(rb)
    assert strip_times(ra) == strip_times(rc)
    assert all(r["eval_accuracy"] is not None for r in rc) and "eval_accuracy" not in ra[0]
    assert (tmp_path / "a" / "samples.jsonl").read_text() == (tmp_path / "c" / "samples.jsonl").read_text()
    d = config(tmp_path, tiny_dir, "d", **{"algo.beta": 0.0, "train.lr": 1e-3, "train.seed": 1})
    GRPOTrainer(d).train()
    assert strip_times(read_metrics(tmp_path / "d")) != strip_times(ra)


def test_log_samples_does_not_change_training(tmp_path, tiny_dir):
    runs = {}
    for n in (0, 1, 16):  # none, one, every completion of a step
        cfg = config(
            tmp_path, tiny_dir, f"s{n}", **{"algo.beta": 0.0, "train.lr": 1e-3, "train.log_samples": n}
        )
        trainer = GRPOTrainer(cfg)
        trainer.train()
        runs[n] = (
            strip_times(read_metrics(tmp_path / f"s{n}")),
            [p.detach().clone() for p in trainer.model.parameters()],
        )
        lines = (tmp_path / f"s{n}" / "samples.jsonl").read_text().splitlines() if n else []
        assert len(lines) == 3 * n
    for n in (1, 16):
        assert runs[n][0] == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[n][1], runs[0][1], strict=True))


def test_no_signal_steps_are_skipped_and_change_nothing(tmp_path, tiny_dir):
    model, tok = load_model(str(tiny_dir))
    before = [p.detach().clone() for p in model.parameters()]

    def constant(prompts, completions, **_):
        return [0.7] * len(completions)

    cfg = config(tmp_path, tiny_dir, **{"algo.beta": 0.0, "train.lr": 1e-2})
    summary = GRPOTrainer(cfg, model=model, tokenizer=tok, rewards=[constant]).train()
    rows = read_metrics(tmp_path / "run")
    assert all(r["optimizer_step_skipped"] == 1 and r["zero_std_fraction"] == 1.0 for r in rows)
    assert summary["num_skipped_steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_kl_is_reported_with_a_reference_and_null_without(tmp_path, tiny_dir):
    def length(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    for name, beta in (("kl", 0.1), ("nokl", 0.0)):
        cfg = config(tmp_path, tiny_dir, name, **{"algo.beta": beta, "train.lr": 1e-2})
        GRPOTrainer(cfg, rewards=[length]).train()
    with_ref, without = read_metrics(tmp_path / "kl"), read_metrics(tmp_path / "nokl")
    assert with_ref[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert with_ref[-1]["kl"] > 0
    assert all(r["kl"] is None for r in without)


def test_learning_rate_schedule(tmp_path, tiny_dir):
    cfg = config(
        tmp_path,
        tiny_dir,
        **{
            "train.lr": 1.0,
            "train.warmup_steps": 2,
            "train.lr_schedule": "cosine",
            "train.max_steps": 4,
            "train.mu": 2,
        },
    )
    lrs = [learning_rate(k, cfg.train) for k in range(8)]
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 6)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))


def test_existing_run_dir_is_not_overwritten(tmp_path, tiny_dir):
    cfg = config(tmp_path, tiny_dir, **{"train.max_steps": 1})
    GRPOTrainer(cfg).train()
    with pytest.raises(FileExistsError, match="already holds a run"):
        GRPOTrainer(cfg).train()


def test_a_nonfinite_gradient_skips_its_optimizer_step(tmp_path, tiny_dir, monkeypatch, capsys):
    # one NaN in the first step's gradient: that optimizer step is skipped (weights and AdamW's
    # moments untouched, reported), and the run goes on with finite weights
    model, tok = load_model(str(tiny_dir))
    initial = [p.detach().clone() for p in model.parameters()]
    clip, seen = torch.nn.utils.clip_grad_norm_, []

    def poisoned(params, max_norm, *args, **kwargs):
        params = list(params)
        seen.append([p.detach().clone() for p in model.parameters()])  # the weights before this step
        if len(seen) == 1:
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)
    cfg = config(tmp_path, tiny_dir, **{"train.max_steps": 2, "algo.beta": 0.0, "train.quiet": False})
    trainer = GRPOTrainer(cfg, model=model, tokenizer=tok, rewards=[varied])
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert [r["grad_nonfinite_steps"] for r in rows] == [1, 0]
    assert [r["optimizer_step_skipped"] for r in rows] == [0, 0]  # (the no-signal rule's flag)
    assert rows[0]["grad_norm"] is None and math.isfinite(rows[1]["grad_norm"])
    assert len(seen) == 2 and all(torch.equal(a, b) for a, b in zip(initial, seen[1], strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {1}  # one AdamW step taken
    assert "1 optimizer step(s) skipped, the gradient norm was nan" in capsys.readouterr().out


def test_a_part_with_no_loss_tokens_is_handled(tmp_path, tiny_dir, monkeypatch):
    # steps_per_generation=2 and every completion of the second part masked out (as
    # mask_truncated_completions does when all of them are truncated): the step's statistics come
    # from the first part alone, nothing raises, and the empty part's optimizer step still counts
    cfg = config(
        tmp_path, tiny_dir, **{"train.steps_per_generation": 2, "train.max_steps": 2, "algo.beta": 0.0}
    )
    original = GRPOTrainer._batch

    def second_half_masked(self, rollout):
        batch, plans = original(self, rollout)
        batch.completion_mask[batch.num_rows // 2 :] = False
        return batch, plans

    monkeypatch.setattr(GRPOTrainer, "_batch", second_half_masked)
    GRPOTrainer(cfg).train()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["optimizer_step_skipped"] == 1 or (
            math.isfinite(r["clip_fraction"])
            and math.isfinite(r["ratio_mean"])
            and math.isfinite(r["entropy"])
        )


def test_update_stats_combine_weights_by_tokens_and_skips_empty_steps():
    from grpokit.train.batch import UpdateStats

    a = UpdateStats(
        loss=1.0, num_tokens=30, kl=0.1, clip_fraction=0.2, ratio_mean=1.0, ratio_max=1.5, entropy=2.0
    )
    b = UpdateStats(
        loss=3.0, num_tokens=10, kl=0.5, clip_fraction=0.6, ratio_mean=2.0, ratio_max=1.2, entropy=1.0
    )
    empty = UpdateStats(loss=0.0, num_tokens=0)
    c = UpdateStats.combine([a, empty, b])
    assert c.num_tokens == 40 and c.loss == pytest.approx(4.0 / 3)
    assert c.kl == pytest.approx((0.1 * 30 + 0.5 * 10) / 40) and c.clip_fraction == pytest.approx(0.3)
    assert c.ratio_max == 1.5 and c.entropy == pytest.approx(1.75)
    assert math.isnan(UpdateStats.combine([empty, empty]).kl)


def test_the_optimizer_is_torchs_fused_adamw_where_it_exists(tmp_path, tiny_dir):
    from grpokit.train.optim import adamw_kernel

    trainer = GRPOTrainer(config(tmp_path, tiny_dir))
    assert isinstance(trainer.optimizer, torch.optim.AdamW) and trainer.optimizer.defaults["fused"] is True
    assert adamw_kernel([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]) == {"fused": True}
    assert adamw_kernel([]) == {"foreach": True}
