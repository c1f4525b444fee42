"""Training on multi-turn episodes (the calculator task with its tool, on the shipped tiny-calculator
model): the trainer's log-probs of the model's tokens equal the sampler's across turns, environment
tokens get no gradient and count in no length or loss, the episode metrics and samples are logged,
and resume equals an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch

import grpokit.train.batch as batch_module
from grpokit.config import load_config
from grpokit.data.tasks import TaskSource
from grpokit.models.loading import load_model
from grpokit.rollout.episodes import episodes_from_config, sample_episodes
from grpokit.rollout.sampler import SamplingParams
from grpokit.train.batch import TrainBatch, batch_logprobs, plan_micro_batches
from grpokit.train.trainer import GRPOTrainer
from tests.helpers import TIME_KEYS


def varied(prompts, completions, conversation, **_):
    """Spread inside every group: from the final answer's digits and the number of turns."""
    return [float((sum(map(ord, c)) + len(m)) % 5) for c, m in zip(completions, conversation, strict=True)]


def calculator_sets(out, **extra):
    base = {
        "model.name_or_path": "tiny-calculator",
        "data.task": "calculator",
        "train.output_dir": str(out),
        "train.quiet": True,
        "train.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 40,
        "rollout.max_turns": 3,
        "train.eval_max_prompts": 8,
        "train.max_steps": 4,
        "train.save_every": 2,
        "train.lr": 1e-3,
        "train.log_samples": 4,
    }
    base.update(extra)
    return [f"{k}={json.dumps(v)}" for k, v in base.items()]


def calculator_rollout(dtype):
    model, tok = load_model("tiny-calculator")
    model = model.to(dtype)
    cfg = load_config(None, calculator_sets("/tmp/unused"))
    spec = episodes_from_config(cfg, tok, "calculator")
    rows = [TaskSource("calculator").row(i) for i in range(6)]
    rollout = sample_episodes(
        model, tok, rows, spec.make_env, 4, SamplingParams(max_new_tokens=40, temperature=1.0),
        torch.Generator().manual_seed(0), max_turns=3, max_episode_tokens=120,
    )  # fmt: skip
    assert sum(e.num_tool_calls for e in rollout.episodes) >= 3  # the test needs multi-turn episodes
    return model, tok, rollout


@pytest.fixture(scope="module")
def calc():
    return calculator_rollout(torch.float32)


@pytest.fixture(scope="module")
def calc64():
    return calculator_rollout(torch.float64)


@pytest.mark.parametrize(("max_rows", "max_tokens"), [(1, None), (5, None), (24, None), (4, 150)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_trainer_logprobs_of_model_tokens_equal_the_samplers_across_turns(
    request, dtype, max_rows, max_tokens
):
    # float64: the two computations are the same function of the same tokens and positions (to the
    # float32 the rollout stores log-probs in); float32 bounds the rounding of their different
    # orders (a cached step per token vs one forward of the stream): up to 1.9e-5 on AVX-512
    model, _, rollout = request.getfixturevalue("calc64" if dtype == torch.float64 else "calc")
    batch = TrainBatch.from_rollout(rollout, torch.zeros(rollout.num_rows))
    assert torch.equal(batch.completion_mask, rollout.model_mask & rollout.completion_mask)
    plan = plan_micro_batches(batch.total_lengths(), max_rows, max_tokens)
    recomputed = batch_logprobs(model, batch, plan, 0, 1.0)
    m = rollout.trained_mask
    diff = (recomputed[m] - rollout.sampler_logp[m].to(dtype)).abs()
    assert diff.max() < (1e-6 if dtype == torch.float64 else 5e-5)
    multi = [b for b, e in enumerate(rollout.episodes) if e.num_turns > 1]
    after_tool = torch.zeros_like(m)
    for b in multi:  # the model's turns after a tool result are among the compared tokens
        first_env = int((~rollout.model_mask[b]).nonzero()[0])
        after_tool[b, first_env:] = m[b, first_env:]
    assert int(after_tool.sum()) > 10


def test_environment_tokens_get_no_gradient(tmp_path, monkeypatch):
    seen = []
    original = batch_module.completion_logprobs

    def recording(model, mb, *args, **kw):
        logp, entropy = original(model, mb, *args, **kw)
        if logp.requires_grad:
            logp.retain_grad()
            seen.append((logp, mb))
        return logp, entropy

    monkeypatch.setattr(batch_module, "completion_logprobs", recording)
    # the padded layout, whose [b, L + T'] attention mask says which tokens are in the context
    sets = {"train.max_steps": 1, "algo.beta": 0.1, "train.share_prompts": False}
    cfg = load_config(None, calculator_sets(tmp_path / "run", **sets))
    GRPOTrainer(cfg, rewards=[varied]).train()  # a reward with spread: non-zero advantages
    checked_env = checked_model = 0
    for logp, mb in seen:
        in_context = mb.attention_mask[:, mb.prompt_width :].bool()
        env = in_context & ~mb.completion_mask
        assert bool((logp.grad[env] == 0).all())  # no loss or KL term on what the environment wrote
        checked_env += int(env.sum())
        checked_model += int((logp.grad[mb.completion_mask] != 0).sum())
    assert checked_env > 20 and checked_model > 20


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("calc") / "run"
    GRPOTrainer(load_config(None, calculator_sets(out))).train()
    return out


def test_episode_metrics_and_samples(reference_run):
    rows = [json.loads(x) for x in (reference_run / "metrics.jsonl").read_text().splitlines()]
    for key in ("turns_mean", "tool_calls_mean", "tool_call_fraction", "tool_errors", "env_tokens_mean"):
        assert all(key in r for r in rows), key
    assert any(r["tool_calls_mean"] > 0 for r in rows) and all(r["turns_mean"] >= 1 for r in rows)
    samples = [json.loads(x) for x in (reference_run / "samples.jsonl").read_text().splitlines()]
    with_tool = [s for s in samples if s["tool_calls"]]
    assert with_tool, "no logged episode called the tool"
    for s in with_tool:
        roles = [(t["role"], t["trained"]) for t in s["turns"]]
        assert roles[:3] == [("assistant", True), ("tool", False), ("assistant", True)]
        assert s["turns"][1]["text"].startswith("<result>") and s["completion"] == s["turns"][-1]["text"]
    # lengths count the model's tokens only
    assert all(r["completion_length_max"] <= 2 * 40 for r in rows)
    summary = json.loads((reference_run / "summary.json").read_text())
    assert summary["accuracy_before"] is not None
    assert "transcript" in summary["eval_examples_after"][0]


def test_resume_equals_uninterrupted_with_an_environment(tmp_path, reference_run):
    out = tmp_path / "run"
    GRPOTrainer(load_config(None, calculator_sets(out, **{"train.max_steps": 2}))).train()
    GRPOTrainer(load_config(None, calculator_sets(out))).train(resume=out)

    def strip(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]

    assert strip(out) == strip(reference_run)
    assert (out / "samples.jsonl").read_text() == (reference_run / "samples.jsonl").read_text()


def test_episodes_train_on_the_vllm_engine(tmp_path, monkeypatch):
    # the calculator's tool episodes sampled by the vLLM engine (over the CPU stand-in for vLLM):
    # the trainer's log-probs of the model's tokens equal vLLM's across turns, and the episode
    # metrics and samples are those of a multi-turn run
    import grpokit.rollout.vllm_engine as vllm_engine
    from grpokit.rollout.vllm_engine import VLLMEngine
    from tests.rollout.fake_vllm import FakeLLM, install_fake_vllm_module

    monkeypatch.setattr(vllm_engine, "check_available", lambda: None)  # as if vLLM and a GPU were here
    on_vllm = load_config(None, calculator_sets(tmp_path / "accepted", **{"rollout.engine": "vllm"}))
    assert on_vllm.rollout.engine == "vllm" and on_vllm.data.task == "calculator"
    install_fake_vllm_module(monkeypatch)
    sets = {"train.max_steps": 3, "train.save_every": 0, "algo.beta": 0.1}
    trainer = GRPOTrainer(load_config(None, calculator_sets(tmp_path / "run", **sets)), rewards=[varied])
    trainer.engine = VLLMEngine(
        "unused", trainer.tokenizer, dtype="float32", max_new_tokens=40, gpu_memory_utilization=0.1,
        sleep=False, seed=0, llm=FakeLLM(trainer.model, trainer.tokenizer), processed_logprobs=True,
    )  # fmt: skip
    trainer.train()
    assert trainer.engine.llm.pushes == 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and any(r["tool_calls_mean"] > 0 for r in rows)
    assert all(r["logprob_mismatch"] < 5e-5 and r["logprob_ratio_outside"] == 0.0 for r in rows)
    assert all(r["env_tokens_mean"] > 0 for r in rows)
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any(s["tool_calls"] and s["turns"][1]["text"].startswith("<result>") for s in samples)


def test_env_config_is_checked_at_start_up(tmp_path):
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.env=tools needs rollout\.tools"):
        load_config(None, calculator_sets(tmp_path, **{"rollout.env": "tools"}))
    with pytest.raises(ConfigError, match=r"rollout\.env='abacus'"):
        load_config(None, calculator_sets(tmp_path, **{"rollout.env": "abacus"}))
    with pytest.raises(ConfigError, match=r"rollout\.tool_format"):
        load_config(None, calculator_sets(tmp_path, **{"rollout.tool_format": "xml"}))


def test_the_hacking_monitor_watches_episodes(tmp_path, monkeypatch):
    """The monitor sees each episode's final message (not the tool results) and the step's metrics, and
    alerts in an environment run as in any other (a KL threshold set low enough to be crossed)."""
    from grpokit.diagnostics.hacking import HackingMonitor

    seen = []
    observe = HackingMonitor.observe

    def spy(self, step, metrics, completions=None):
        seen.append(list(completions or []))
        return observe(self, step, metrics, completions)

    monkeypatch.setattr(HackingMonitor, "observe", spy)
    sets = {"train.max_steps": 3, "train.log_samples": 16, "monitor.window": 2, "monitor.kl_max": 1e-9}
    out = tmp_path / "run"
    summary = GRPOTrainer(load_config(None, calculator_sets(out, **sets))).train()
    assert len(seen) == 3 and all(len(c) == 16 for c in seen)
    assert not any("<result>" in c for texts in seen for c in texts)  # tool output is not the model's
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in samples if s["step"] == 3] == seen[-1]
    assert [a["kind"] for a in summary["alerts"]] == ["kl_high"]
