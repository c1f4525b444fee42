"""pass@k / maj@k against brute force, and the eval / export commands end to end."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.train.evaluate import majority_correct, pass_at_k


@pytest.mark.parametrize("n,c", [(8, 0), (8, 1), (8, 3), (8, 8), (5, 2), (1, 1)])
def test_pass_at_k_is_the_probability_that_a_random_k_subset_holds_a_correct_one(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    with pytest.raises(ValueError, match=r"1 <= k <= n"):
        pass_at_k(n, c, n + 1)


def test_majority_vote_and_its_tie_rule():
    assert majority_correct(["12", "13", "12"], [True, False, True])
    assert not majority_correct(["13", "12", "13"], [False, True, False])
    assert majority_correct(["12", "13"], [True, False])  # a tie goes to the first answer seen


def test_eval_command_writes_json(tmp_path):
    out = tmp_path / "ev.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "eval",
            "--model",
            "tiny",
            "--task",
            "sort",
            "--limit",
            "24",
            "--n",
            "4",
            "--k",
            "1",
            "4",
            "--max-new-tokens",
            "10",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 24
    p = result["sampled"]["pass@k"]
    assert 0 <= p["1"] <= p["4"] <= 1
    assert 0 <= result["greedy"]["pass@1"] <= 1 and set(result["sampled"]["maj@k"]) == {"1", "4"}
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "eval",
            "--model",
            "tiny",
            "--task",
            "sort",
            "--n",
            "2",
            "--k",
            "4",
            "--limit",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "every k must be in [1, n=2]" in bad.stderr


def test_export_gives_a_plain_hf_model_with_the_trained_weights(tmp_path, tiny_dir):
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "grpokit",
        "train",
        "--quiet",
        "--output-dir",
        str(run),
        "--set",
        f"model.name_or_path={tiny_dir}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.save_every=1",
        "--set",
        "train.prompts_per_step=2",
        "--set",
        "rollout.group_size=2",
        "--set",
        "train.eval_max_prompts=4",
        "--set",
        "algo.beta=0.1",
        "--set",
        "train.lr=0.01",
    ]
    assert subprocess.run(argv, capture_output=True).returncode == 0
    for extra, src in (
        ([], run / "final"),
        (["--checkpoint", "step-000001"], run / "checkpoints/step-000001/model"),
    ):
        out = tmp_path / f"export{len(extra)}"
        res = subprocess.run(
            [sys.executable, "-m", "grpokit", "export", str(run), "--out", str(out), *extra],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        exported, source = (
            AutoModelForCausalLM.from_pretrained(out),
            AutoModelForCausalLM.from_pretrained(src),
        )
        ids = torch.tensor([[5, 6, 7, 8]])
        torch.testing.assert_close(
            exported(input_ids=ids).logits, source(input_ids=ids).logits, rtol=0, atol=0
        )
    again = subprocess.run(
        [sys.executable, "-m", "grpokit", "export", str(run), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.fixture()
def built(monkeypatch):
    """The (decode, reorder) of every decoder the sampler builds, in order."""
    import grpokit.rollout.sampler as sampler

    calls, real = [], sampler.decoder_for

    def recording(model, decode, capacity, reorder=True, share=True):
        calls.append((decode, reorder, share))
        return real(model, decode, capacity, reorder, share)

    monkeypatch.setattr(sampler, "decoder_for", recording)
    return calls


@pytest.mark.parametrize("evaluator", ["greedy", "sampled"])
def test_evaluations_pass_the_decode_options_to_the_sampler(peaky, built, evaluator):
    """``decode`` / ``reorder_weights`` / ``share_prompts`` reach the decoder each evaluation builds,
    and the HF forward scores what the own path scores."""
    from grpokit.config import RewardSpec
    from grpokit.data.tasks import TaskSource
    from grpokit.rewards.registry import build_rewards
    from grpokit.train.evaluate import evaluate, evaluate_sampled

    model, tok = peaky
    held = TaskSource("sort", split="eval", eval_size=6)
    rows = [held.row(i) for i in range(len(held))]
    prompts = [r["prompt"] for r in rows]
    rewards = build_rewards([RewardSpec(name="task_verifier")], task="sort")

    def run(**options):
        if evaluator == "greedy":
            return evaluate(model, tok, rows, prompts, rewards, max_new_tokens=8, **options)
        return evaluate_sampled(
            model, tok, rows, prompts, rewards, n=4, ks=[1, 4], temperature=1.0, max_new_tokens=8, **options
        )

    own = run()
    hf = run(decode="hf", reorder_weights=False, share_prompts=False)
    assert built == [("auto", True, True), ("hf", False, False)]
    assert hf == own


def test_eval_command_passes_decode_and_no_reorder_weights(built, capsys):
    from grpokit.cli import main

    args = ["eval", "--model", "tiny", "--task", "sort", "--limit", "3", "--n", "2", "--k", "1", "2"]
    extra = ["--decode", "hf", "--no-reorder-weights", "--no-share-prompts"]
    assert main([*args, "--max-new-tokens", "4", *extra]) == 0
    assert built == [("hf", False, False)] * 2  # the greedy pass, then the sampled one
    assert json.loads(capsys.readouterr().out)["num_prompts"] == 3
    built.clear()
    assert main([*args, "--max-new-tokens", "4"]) == 0
    assert built == [("auto", True, True)] * 2
