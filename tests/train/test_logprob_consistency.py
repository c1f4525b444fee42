"""The sampler's per-token log-probs equal the trainer's recomputation (float32, any micro-batch
split, padded or packed), top-k / top-p log-probs are the renormalised ones and serve as pi_old
(under a rollout correction the trainer's recomputation does, the weights carrying the truncation),
and the trainer's always-on mismatch metrics and rollout corrections see exactly what the sampler
recorded, the built-in one's or the vLLM engine's (over a CPU stand-in for vLLM)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpokit.config import load_config
from grpokit.models.loading import SharingCosts
from grpokit.rollout.sampler import SamplingParams, sample
from grpokit.train.batch import TrainBatch, batch_logprobs, plan_micro_batches
from grpokit.train.trainer import GRPOTrainer
from tests.algo import reference as ref
from tests.helpers import varied

PROMPTS = ["12+34=", "7+8=", "100+1=", "5="]


def rollout_of(model, tok, params, seed=0):
    return sample(model, tok, PROMPTS, 4, params, torch.Generator().manual_seed(seed), policy_version=3)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("max_rows", "max_tokens"), [(1, None), (3, None), (16, None), (5, 40)])
def test_sampler_logprobs_equal_the_trainers_recomputation(peaky, temperature, max_rows, max_tokens, layout):
    # the sampler (grpokit's own decode path) vs the trainer's HF forward over padded rows, packed
    # rows, or each prompt once with its rows after it (the costs make sharing always pay)
    model, tok = peaky
    rollout = rollout_of(model, tok, SamplingParams(max_new_tokens=8, temperature=temperature))
    batch = TrainBatch.from_rollout(rollout, torch.zeros(rollout.num_rows))
    plan = plan_micro_batches(batch.total_lengths(), max_rows, max_tokens)
    share = SharingCosts(1.0, 0.0) if layout == "shared" else None
    recomputed = batch_logprobs(model, batch, plan, 0, temperature, packed=layout == "packed", share=share)
    m = rollout.completion_mask
    assert recomputed.dtype == torch.float32 and rollout.sampler_logp.dtype == torch.float32
    assert (recomputed[m] - rollout.sampler_logp[m]).abs().max() < 1e-5
    assert bool((rollout.sampler_logp[~m] == 0).all()) and rollout.policy_version.tolist() == [3] * 16


def renormalised_logprob(
    logits: list[float], token: int, temperature: float, top_k: int, top_p: float
) -> float:
    """Plain-Python reference: softmax(logits / T), keep the top_k largest, then the smallest prefix
    (by probability) whose mass reaches top_p, renormalise, and read the token's log-prob."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k:
        order = order[:top_k]
    mx = max(z[i] for i in order)
    p = {i: math.exp(z[i] - mx) for i in order}
    total = sum(p.values())
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i] / total
    assert token in kept, "the sampler drew a token the filter removes"
    return math.log(p[token] / sum(p[i] for i in kept))


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.6), (8, 0.8)])
def test_top_k_top_p_logprobs_are_the_renormalised_ones(peaky, top_k, top_p):
    model, tok = peaky
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=top_k, top_p=top_p)
    rollout = rollout_of(model, tok, params, seed=1)
    prompt_ids = rollout.prompt_ids.repeat_interleave(4, dim=0)
    prompt_mask = rollout.prompt_mask.repeat_interleave(4, dim=0)
    checked = 0
    for b in range(rollout.num_rows):
        ids = torch.cat(
            [prompt_ids[b][prompt_mask[b]], rollout.completion_ids[b][rollout.completion_mask[b]]]
        )
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].double()
        L = int(prompt_mask[b].sum())
        for t in range(int(rollout.completion_mask[b].sum())):
            want = renormalised_logprob(logits[L - 1 + t].tolist(), int(ids[L + t]), 0.9, top_k, top_p)
            assert abs(float(rollout.sampler_logp[b, t]) - want) < 1e-5
            checked += 1
    assert checked > 40


def config(tmp_path, tiny_dir, name, **sets):
    base = {
        "model.name_or_path": str(tiny_dir),
        "train.output_dir": str(tmp_path / name),
        "train.quiet": True,
        "train.max_steps": 2,
        "train.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "train.eval_max_prompts": 4,
        "rollout.temperature": 1.2,
        "train.dump_tensors": True,
        "algo.beta": 0.0,
    }
    base.update(sets)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in base.items()])


def metrics(tmp_path, name):
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "sets",
    [{}, {"train.mu": 2}, {"train.steps_per_generation": 2}, {"train.packing": True, "train.mu": 2}],
)
def test_float32_runs_show_no_mismatch(tmp_path, tiny_dir, sets):
    trainer = GRPOTrainer(config(tmp_path, tiny_dir, "run", **sets), rewards=[varied])
    assert trainer.learner.packed == bool(sets.get("train.packing"))
    trainer.train()
    for row in metrics(tmp_path, "run"):
        if not row["optimizer_step_skipped"] or sets:  # a skipped mu=1 step recomputes nothing
            assert row["logprob_mismatch"] < 1e-5 and row["logprob_ratio_outside"] == 0.0


def perturbed_sampler(monkeypatch, shift: float, every: int = 3):
    """The sampler's recorded log-probs off by ``shift`` on every ``every``-th token (another
    engine's precision); returns the rollouts it produced."""
    import grpokit.rollout.episodes as episodes_module

    produced = []

    def fake(*args, **kwargs):
        rollout = sample(*args, **kwargs)
        bump = torch.zeros_like(rollout.sampler_logp)
        bump.view(-1)[::every] = shift
        rollout.sampler_logp = torch.where(rollout.completion_mask, rollout.sampler_logp + bump, 0.0)
        if rollout.group_size > 1:  # training, not the greedy evaluations (G = 1)
            produced.append(rollout)
        return rollout

    monkeypatch.setattr(episodes_module, "sample", fake)  # what the trainer's rollout_rows calls
    return produced


def test_the_metric_sees_a_perturbed_sampler(tmp_path, tiny_dir, monkeypatch):
    produced = perturbed_sampler(monkeypatch, 0.2)
    GRPOTrainer(config(tmp_path, tiny_dir, "run", **{"train.mu": 2}), rewards=[varied]).train()
    for rollout, row in zip(produced, metrics(tmp_path, "run"), strict=True):
        m = rollout.completion_mask
        bumped = (torch.arange(m.numel()) % 3 == 0).view(m.shape)
        share = float(bumped[m].double().mean())
        assert 0 < share < 1
        # |old - (sampler + 0.2)| = 0.2 on the bumped tokens (exp(-0.2) = 0.82 is outside [0.9, 1.1])
        assert row["logprob_mismatch"] == pytest.approx(0.2 * share, abs=1e-5)
        assert row["logprob_ratio_outside"] == pytest.approx(share, abs=1e-9)


@pytest.mark.parametrize("mode", ["token_truncated", "sequence_masked"])
def test_rollout_correction_weights_reach_the_loss(tmp_path, tiny_dir, monkeypatch, mode):
    produced = perturbed_sampler(monkeypatch, -0.5, every=4)  # sampler lower: rho = e^0.5 = 1.65 there
    cfg = config(
        tmp_path, tiny_dir, "run", **{"algo.rollout_correction": mode, "algo.rollout_correction_cap": 1.5}
    )
    GRPOTrainer(cfg, rewards=[varied]).train()
    dump = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    rows, rollout = dump["rows"], produced[0]
    mask = dump["mask"]
    T = mask.shape[1]
    want = ref.correction_weights(
        dump["old_logp"].double().tolist(),
        rollout.sampler_logp[rows, :T].double().tolist(),
        mask.int().tolist(),
        mode,
        1.5,
    )
    assert torch.allclose(dump["is_weights"].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert "is_weight_mean" in metrics(tmp_path, "run")[0]


def recorded_sampler(monkeypatch) -> list:
    """The training rollouts the sampler produces, in order (not the greedy evaluations, G = 1)."""
    import grpokit.rollout.episodes as episodes_module

    produced = []

    def recording(*args, **kwargs):
        rollout = sample(*args, **kwargs)
        if rollout.group_size > 1:
            produced.append(rollout)
        return rollout

    monkeypatch.setattr(episodes_module, "sample", recording)  # what the trainer's rollout_rows calls
    return produced


def spread(prompts, completions, **_):  # differs between completions of the same length
    return [float(sum(map(ord, c)) % 5) for c in completions]


def test_with_top_k_the_sampler_logprobs_are_pi_old(tmp_path, tiny_dir, monkeypatch):
    produced = recorded_sampler(monkeypatch)
    cfg = config(tmp_path, tiny_dir, "run", **{"rollout.top_k": 3, "train.max_steps": 2})
    GRPOTrainer(cfg, rewards=[spread]).train()
    trained = [r for r in metrics(tmp_path, "run") if not r["optimizer_step_skipped"]]
    assert trained
    step = trained[0]["step"]
    dump = torch.load(tmp_path / "run" / "tensors" / f"step-{step:06d}.pt", weights_only=False)
    T = dump["mask"].shape[1]
    assert torch.equal(dump["old_logp"], produced[step - 1].sampler_logp[dump["rows"], :T])
    # the renormalised pi_old is above the full softmax's: on-policy ratios sit below 1, and the
    # mismatch metric (the full recomputation vs the sampler) shows the truncation
    assert trained[0]["ratio_mean"] < 1.0 and trained[0]["logprob_mismatch"] > 1e-3


@pytest.mark.parametrize("mode", ["token_truncated", "sequence_masked"])
def test_with_top_k_a_correction_takes_the_trainers_pi_old(tmp_path, tiny_dir, monkeypatch, mode):
    # the correction's weight pi_old / pi_sampler already carries the truncation: the ratio is then
    # pi_theta / pi_old (decoupled PPO), not pi_theta / pi_sampler, which would count it twice
    produced = recorded_sampler(monkeypatch)
    sets = {"rollout.top_k": 3, "algo.rollout_correction": mode, "algo.rollout_correction_cap": 1e6}
    GRPOTrainer(config(tmp_path, tiny_dir, "run", **sets), rewards=[spread]).train()
    row = metrics(tmp_path, "run")[0]
    assert not row["optimizer_step_skipped"]
    dump = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    mask, T = dump["mask"], dump["mask"].shape[1]
    sampler_logp = produced[0].sampler_logp[dump["rows"], :T]
    old = dump["old_logp"].double()
    assert float((sampler_logp.double() - old)[mask].min()) > -1e-6  # renormalised >= full softmax
    assert float((sampler_logp.double() - old)[mask].max()) > 1e-3  # and the truncation shows
    want = ref.correction_weights(
        old.tolist(), sampler_logp.double().tolist(), mask.int().tolist(), mode, 1e6
    )
    assert torch.allclose(dump["is_weights"].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    # one optimizer step on freshly sampled rows: pi_theta = pi_old, every ratio is 1
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and row["is_weight_mean"] < 1.0


def vllm_trainer(monkeypatch, cfg, engine_model=None, **fake) -> GRPOTrainer:
    """A trainer whose rollouts come from the vLLM engine over a CPU stand-in for vLLM
    (tests/rollout/fake_vllm.py): its own copy of the model (or of ``engine_model``: a LoRA run's
    plain base, as vLLM loads it), kept current by the weight push."""
    from grpokit.rollout.vllm_engine import VLLMEngine
    from tests.rollout.fake_vllm import FakeLLM, install_fake_vllm_module

    install_fake_vllm_module(monkeypatch)
    trainer = GRPOTrainer(cfg, rewards=[varied])
    r = cfg.rollout
    trainer.engine = VLLMEngine(
        "unused", trainer.tokenizer, dtype="float32", max_new_tokens=r.max_new_tokens,
        gpu_memory_utilization=0.1, sleep=False, seed=0,
        llm=FakeLLM(engine_model or trainer.model, trainer.tokenizer, **fake), processed_logprobs=True,
    )  # fmt: skip
    return trainer


@pytest.mark.parametrize("sets", [{}, {"algo.rollout_correction": "token_truncated", "train.mu": 2}])
def test_vllm_rollouts_feed_the_mismatch_metric_and_the_correction(tmp_path, tiny_dir, monkeypatch, sets):
    trainer = vllm_trainer(monkeypatch, config(tmp_path, tiny_dir, "run", **{"train.max_steps": 3, **sets}))
    trainer.train()
    # before each of the 3 samplings the engine gets the weights of the last update: a stale copy
    # would show as a mismatch on steps 2 and 3, whose pi_old the updates have moved
    assert trainer.engine.llm.pushes == 3
    rows = metrics(tmp_path, "run")
    assert len(rows) == 3
    for row in rows:
        if not row["optimizer_step_skipped"] or sets:  # a skipped mu=1 step recomputes nothing
            assert row["logprob_mismatch"] < 1e-5 and row["logprob_ratio_outside"] == 0.0
    if sets:
        assert all(row["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) for row in rows)


def test_lora_runs_sample_on_vllm_with_the_adapters_merged_into_every_push(tmp_path, tiny_dir, monkeypatch):
    pytest.importorskip("peft")
    from grpokit.models.loading import load_model

    sets = {"model.lora": {"r": 4, "alpha": 8}, "train.max_steps": 3, "train.lr": 0.05}
    base, _ = load_model(str(tiny_dir))  # vLLM holds plain weights under the base model's names
    trainer = vllm_trainer(monkeypatch, config(tmp_path, tiny_dir, "run", **sets), engine_model=base)
    trainer.train()
    assert trainer.engine.llm.pushes == 3  # a strict load_state_dict: every name is the base's
    rows = metrics(tmp_path, "run")
    assert [r["optimizer_step_skipped"] for r in rows] == [False] * 3
    # pushes 2 and 3 carry adapters the updates moved: vLLM samples the adapted policy, so the
    # trainer's recomputed log-probs equal vLLM's; an unmerged push would show here as a mismatch
    assert all(r["logprob_mismatch"] < 1e-5 and r["logprob_ratio_outside"] == 0.0 for r in rows)
    served = trainer.engine.llm.model.model.layers[0].self_attn.q_proj.weight
    assert (served - base.model.layers[0].self_attn.q_proj.weight).abs().max() > 1e-3


def test_a_vllm_mismatch_is_measured_and_corrected(tmp_path, tiny_dir, monkeypatch):
    # vLLM's reported log-probs off by -0.5 on every 4th token (its bf16 kernels, say): the metric
    # shows exactly that, and the correction weights the loss by pi_old / pi_vllm, capped at 1.5
    cfg = config(
        tmp_path, tiny_dir, "run",
        **{"algo.rollout_correction": "token_truncated", "algo.rollout_correction_cap": 1.5},
    )  # fmt: skip
    trainer = vllm_trainer(monkeypatch, cfg, shift=-0.5, every=4)
    produced, engine_sample = [], trainer.engine.sample

    def recording(*args, **kwargs):
        produced.append(engine_sample(*args, **kwargs))
        return produced[-1]

    trainer.engine.sample = recording
    trainer.train()
    rollout, row = produced[0], metrics(tmp_path, "run")[0]
    m = rollout.completion_mask
    order = m.flatten().long().cumsum(0).view(m.shape) - 1  # the fake counts tokens row after row
    shifted = (order % 4 == 0) & m
    share = float(shifted[m].double().mean())
    assert 0.15 < share < 0.4
    assert row["logprob_mismatch"] == pytest.approx(0.5 * share, abs=1e-5)
    assert row["logprob_ratio_outside"] == pytest.approx(share, abs=1e-9)
    dump = torch.load(tmp_path / "run" / "tensors" / "step-000001.pt", weights_only=False)
    mask, T = dump["mask"], dump["mask"].shape[1]
    want = torch.where(shifted[dump["rows"], :T], min(math.exp(0.5), 1.5), 1.0) * mask
    assert torch.allclose(dump["is_weights"].double(), want.double(), atol=1e-4)
    assert bool((dump["is_weights"][mask] != 1).any())
