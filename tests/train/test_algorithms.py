"""The algorithm family in the trainer: presets, loss equivalence from dumped tensors, and the knobs."""

from __future__ import annotations

import json

import pytest
import torch

from grpokit.algo import decoupled_advantages, group_advantages
from grpokit.config import PRESETS, load_config
from grpokit.rewards.format import overlong_penalty
from grpokit.rewards.registry import Scores, WeightedReward
from grpokit.train.trainer import GRPOTrainer
from tests.algo import reference as ref
from tests.helpers import varied


def parity(prompts, completions, **_):
    return [float(len(c) % 2) for c in completions]


def make(tmp_path, tiny_dir, name="run", **sets):
    base = {
        "model.name_or_path": str(tiny_dir),
        "train.output_dir": str(tmp_path / name),
        "train.quiet": True,
        "train.max_steps": 3,
        "train.prompts_per_step": 3,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "train.eval_max_prompts": 4,
        "rollout.temperature": 1.3,
        "train.lr": 3e-3,
        "train.micro_batch_size": 64,
        "train.dump_tensors": True,
        "train.save_every": 0,
    }
    base.update(sets)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in base.items()])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", list(PRESETS))
def test_each_preset_trains_and_its_loss_is_the_papers(tmp_path, tiny_dir, algorithm):
    cfg = make(tmp_path, tiny_dir, **{"algorithm": algorithm, "train.mu": 2})
    GRPOTrainer(cfg, rewards=[varied]).train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in rows)
    preset = PRESETS[algorithm]
    for step in (1, 2, 3):
        path = tmp_path / "run" / "tensors" / f"step-{step:06d}.pt"
        if not path.exists():  # a skipped (no-signal) step dumps nothing
            continue
        d = torch.load(path, weights_only=False)
        kw = d["loss_spec"]
        assert kw["aggregation"] == preset["aggregation"] and kw["ratio_level"] == preset["ratio_level"]
        assert kw["clip_low"] == preset["clip_low"]
        assert kw["clip_high"] == (preset["clip_high"] or preset["clip_low"])
        assert kw["beta"] == (preset["beta"] if preset["kl_placement"] == "loss" else 0.0)
        # the whole batch is one micro-batch here, so the reference's own denominators apply
        assert d["counts"]["num_tokens"] == int(d["mask"].sum())
        expected = ref.policy_loss(
            d["logp"].double().tolist(),
            d["old_logp"].double().tolist(),
            d["advantages"].double().tolist(),
            d["mask"].int().tolist(),
            ref_logp=None if d["ref_logp"] is None else d["ref_logp"].double().tolist(),
            beta=kw["beta"],
            clip_low=kw["clip_low"],
            clip_high=kw["clip_high"],
            ratio_level=kw["ratio_level"],
            aggregation=kw["aggregation"],
            max_completion_length=kw["max_completion_length"],
            kl_kind=kw["kl_kind"],
        )
        assert float(d["loss"]) == pytest.approx(expected, rel=1e-5, abs=1e-7)
        # the advantages: the preset's estimator, scale and eps applied to the step's rewards
        adv = torch.load(path.with_name(f"step-{step:06d}-advantages.pt"), weights_only=False)
        want = ref.advantages(
            adv["rewards"].double().tolist(), 4, preset["estimator"], preset["scale"], preset["eps"]
        )
        assert adv["advantages"].double().tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert d["advantages"].tolist() == adv["advantages"][d["rows"]].tolist()


@pytest.mark.parametrize("estimator,scale", [("grpo", "batch"), ("rloo", "none"), ("dr_grpo", "none")])
def test_explicit_advantage_options_reach_the_trainer(tmp_path, tiny_dir, estimator, scale):
    sets = {"algo.estimator": estimator, "algo.scale": scale, "algo.eps": 0.5, "train.max_steps": 1}
    GRPOTrainer(make(tmp_path, tiny_dir, **sets), rewards=[varied]).train()
    adv = torch.load(tmp_path / "run" / "tensors" / "step-000001-advantages.pt", weights_only=False)
    want = ref.advantages(adv["rewards"].double().tolist(), 4, estimator, scale, 0.5)
    assert adv["advantages"].double().tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert any(abs(x) > 1e-3 for x in want)


def test_rloo_puts_k1_kl_into_the_reward(tmp_path, tiny_dir):
    """One group, a constant reward and a reference moved away from the policy: every advantage then
    comes from the KL folded into the reward, and equals the float64 hand computation
    A_i = r~_i - mean_{j != i} r~_j with r~_i = 1 - beta * sum_t (old_logp - ref_logp)."""
    sets = {"algorithm": "rloo", "train.max_steps": 1, "algo.beta": 0.5, "train.prompts_per_step": 1}
    trainer = GRPOTrainer(
        make(tmp_path, tiny_dir, **sets), rewards=[lambda prompts, completions, **_: [1.0] * 4]
    )
    with torch.no_grad():
        for p in trainer.ref_model.parameters():
            p.mul_(1.5)
    trainer.train()
    d = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    assert d["loss_spec"]["beta"] == 0.0 and d["loss_spec"]["kl_kind"] == "k1"
    assert d["advantages"].shape[0] == 4  # the whole group is the dumped micro-batch
    old, ref_lp, mask = d["old_logp"].double(), d["ref_logp"].double(), d["mask"]
    shaped = [
        1.0 - 0.5 * float(torch.where(m, o - r, 0.0).sum()) for o, r, m in zip(old, ref_lp, mask, strict=True)
    ]
    expected = [x - (sum(shaped) - x) / 3 for x in shaped]
    assert max(abs(e) for e in expected) > 1e-3  # the KL term really moves the advantages
    assert d["advantages"].double().tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["kl"] is not None and rows[0]["kl"] != 0.0  # reported, though not in the loss


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path, tiny_dir):
    def mostly_tied(prompts, completions, **_):  # informative only when a completion starts with a digit
        return [1.0 if c[:1].isdigit() else 0.0 for c in completions]

    cfg = make(
        tmp_path,
        tiny_dir,
        **{
            "algorithm": "dapo",
            "algo.overlong_penalty": False,
            "algo.dynamic_sampling_max_batches": 6,
            "train.max_steps": 2,
        },
    )
    GRPOTrainer(cfg, rewards=[mostly_tied]).train()
    rows = read_metrics(tmp_path / "run")
    assert all(r["generation_batches"] >= 1 for r in rows)
    for r in rows:
        if r["generation_batches"] < 6:  # filled before the cap: every kept group carries signal
            assert r["zero_std_fraction"] == 0.0
    assert any(r["generation_batches"] > 1 for r in rows)


def test_overlong_penalty_formula_and_dapo_wiring(tmp_path, tiny_dir):
    # L_max = 10, L_cache = 4: free up to 6 tokens, then a linear ramp to -1 at 10, -1 beyond
    assert [overlong_penalty(n, 10, 4) for n in (1, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="0 < cache_len < max_len"):
        overlong_penalty(3, 4, 4)
    cfg = make(
        tmp_path, tiny_dir, **{"algorithm": "dapo", "algo.dynamic_sampling": False, "train.max_steps": 1}
    )
    GRPOTrainer(cfg, rewards=[varied]).train()
    (row,) = read_metrics(tmp_path / "run")
    assert "reward_overlong_mean" in row and row["reward_overlong_mean"] <= 0.0


def test_mask_truncated_completions_gives_them_no_loss(tmp_path, tiny_dir):
    cfg = make(
        tmp_path,
        tiny_dir,
        **{
            "algo.mask_truncated_completions": True,
            "rollout.max_new_tokens": 2,
            "train.max_steps": 1,
            "algo.beta": 0.0,
        },
    )
    GRPOTrainer(cfg, rewards=[varied]).train()
    d = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    (row,) = read_metrics(tmp_path / "run")
    assert row["truncated_fraction"] > 0.5
    kept_rows = int(d["mask"].any(dim=1).sum())
    assert kept_rows == round((1 - row["truncated_fraction"]) * 12)


def test_steps_per_generation_and_mu_count_optimizer_steps(tmp_path, tiny_dir):
    cfg = make(
        tmp_path,
        tiny_dir,
        **{"train.steps_per_generation": 3, "train.mu": 2, "train.max_steps": 2, "algo.beta": 0.1},
    )
    trainer = GRPOTrainer(cfg, rewards=[varied])
    trainer.train()
    state = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
    assert int(state["step"]) == 2 * 2 * 3
    d = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    assert d["counts"]["num_sequences"] == 4  # one of 3 parts: 1 group of 4 completions
    assert float(d["old_logp"].sub(d["logp"]).abs().max()) == 0.0  # first step of the first part: ratio 1


def test_reference_sync_copies_the_policy(tmp_path, tiny_dir):
    cfg = make(tmp_path, tiny_dir, **{"algo.beta": 0.1, "algo.ref_sync_every": 2, "train.max_steps": 2})
    trainer = GRPOTrainer(cfg, rewards=[varied])
    initial = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    for p_ref, p in zip(trainer.ref_model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(p_ref, p)
    assert any(not torch.equal(p0, p) for p0, p in zip(initial, trainer.model.parameters(), strict=True))


def test_entropy_top_q_trains_on_the_high_entropy_tokens(tmp_path, tiny_dir):
    cfg = make(tmp_path, tiny_dir, **{"algo.entropy_top_q": 0.25, "train.max_steps": 1, "algo.beta": 0.0})
    GRPOTrainer(cfg, rewards=[varied]).train()
    d = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    frac = float(d["pg_mask"].sum()) / float(d["mask"].sum())
    assert 0.2 <= frac <= 0.35
    assert bool((d["pg_mask"] <= d["mask"]).all())


def test_normalize_then_sum_uses_decoupled_advantages(tmp_path, tiny_dir):
    cfg = make(tmp_path, tiny_dir, **{"algo.reward_combination": "normalize_then_sum", "train.max_steps": 1})
    trainer = GRPOTrainer(
        cfg, rewards=[WeightedReward("varied", varied, 1.0), WeightedReward("parity", parity, 0.5)]
    )
    a = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 1.0, 0.0])
    b = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    scores = Scores(a + 0.5 * b, {"varied": a, "parity": b}, None, 0)
    got = trainer._advantages(a + 0.5 * b, scores)
    torch.testing.assert_close(got, decoupled_advantages(torch.stack([a, b]), [1.0, 0.5], 4))
    assert not torch.allclose(got, group_advantages(a + 0.5 * b, 4))
    trainer.train()  # and it runs end to end


@pytest.mark.parametrize(
    "override,message",
    [
        ("algo.surrogate=ppo", "algo.surrogate: 'ppo' is not allowed"),
        ("algo.delta=0.5", "algo.delta: must be > 1"),
        ("algo.entropy_top_q=0", "algo.entropy_top_q: must be in (0, 1]"),
        ("algo.ref_sync_every=5", "needs a reference model, but algo.beta is 0"),
        ("algo.kl_placement=both", "algo.kl_placement: 'both' is not allowed"),
        ("algo.reward_combination=max", "algo.reward_combination: 'max' is not allowed"),
        ("algo.overlong_cache_len=32", "algo.overlong_cache_len: must be in [1, rollout.max_new_tokens=32)"),
        ("train.steps_per_generation=0", "train.steps_per_generation: must be >= 1"),
    ],
)
def test_new_options_are_validated(override, message):
    from grpokit.config import ConfigError

    extra = ["algo.beta=0"] if "ref_sync" in override else []
    with pytest.raises(ConfigError) as e:
        load_config(None, [override, *extra])
    assert message in str(e.value)
