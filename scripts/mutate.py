"""Mutation check: break the code on purpose and confirm that the tests meant to catch it fail.

Each mutant below is a named, exact text replacement in one source file and the tests that must
kill it. For each selected mutant the script copies the tracked files of the checkout into a
temporary directory, applies the replacement there (the checkout is never touched), and runs the
named tests against the copy (``PYTHONPATH=<copy>/src``, checked by importing grpokit from it).

    python scripts/mutate.py              # every mutant
    python scripts/mutate.py --list       # names, files, tests
    python scripts/mutate.py NAME [NAME]  # some of them

A mutant is *killed* when its tests fail and *survives* when they pass; the script exits 1 if any
survives, and 2 if a mutant no longer applies (its original text is not found exactly once: the
code moved, so update the mutant with it). A new claim in a test ("X is tested") comes with the
mutant its test kills: add it here (DEVELOPERS.md, "Mutation check").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the root


MUTANTS = [
    Mutant(
        "tests leaked into the sandbox",
        "src/grpokit/rewards/code.py",
        'files = {"solution.py": code, "harness.py": HARNESS, ',
        'files = {"tests.txt": "\\n".join(f"assert {c} == {e!r}" for c, e in cases), '
        '"solution.py": code, "harness.py": HARNESS, ',
        ("tests/rewards/test_code.py::test_reading_every_visible_file_finds_no_expected_value",),
    ),
    Mutant(
        "sandbox binds the whole host root",
        "src/grpokit/rewards/sandbox.py",
        '"--new-session", *system_binds(argv[0]),',
        '"--new-session", "--ro-bind", "/", "/",',
        ("tests/rewards/test_code.py::test_model_code_sees_no_checkout_data_or_home",),
    ),
    Mutant(
        "KL in the reward dropped (rloo)",
        "src/grpokit/train/update.py",
        "return kl_shaped_rewards(total_B, old_logp, ref_logp, batch.completion_mask, a.beta, a.kl)",
        "return total_B",
        ("tests/train/test_algorithms.py::test_rloo_puts_k1_kl_into_the_reward",),
    ),
    Mutant(
        "advantage options ignored (always GRPO's)",
        "src/grpokit/train/trainer.py",
        "adv_B = group_advantages(total_B, G, estimator=a.estimator, scale=a.scale, eps=a.eps)",
        "adv_B = group_advantages(total_B, G)",
        ("tests/train/test_algorithms.py",),
    ),
    Mutant(
        "gradient checkpointing never engaged by the trainer",
        "src/grpokit/train/update.py",
        "self.train_module.train(cfg.model.gradient_checkpointing)",
        "self.train_module.train(False)",
        ("tests/train/test_lora.py::test_the_trainer_engages_gradient_checkpointing",),
    ),
    Mutant(
        "gradient checkpointing not enabled by load_model",
        "src/grpokit/models/loading.py",
        "    if gradient_checkpointing:\n",
        "    if False:\n",
        ("tests/train/test_lora.py::test_gradient_checkpointing_gives_the_same_gradients_and_recomputes",),
    ),
    Mutant(
        "sample logging draws from the training generator",
        "src/grpokit/train/trainer.py",
        "return metrics, sample_rows(t.seed, self.step, t.log_samples, prompts_B, rollout, scores, adv_B)",
        "torch.rand(t.log_samples, generator=self.generator)\n        "
        "return metrics, sample_rows(t.seed, self.step, t.log_samples, prompts_B, rollout, scores, adv_B)",
        ("tests/train/test_trainer.py::test_log_samples_does_not_change_training",),
    ),
    Mutant(
        "report shows no accuracy",
        "src/grpokit/report.py",
        '("held-out accuracy after", _fmt(summary.get("accuracy_after"), ".1%")),',
        '("held-out accuracy after", "n/a"),',
        ("tests/test_demo.py::test_short_demo_end_to_end",),
    ),
    Mutant(
        "max_prompt_length ignored for a built-in task",
        "src/grpokit/data/datasets.py",
        "train = FilteredSource(train, lambda r: length(r) <= limit)",
        "pass",
        ("tests/data/test_datasets.py::test_max_prompt_length_filters_a_built_in_task_like_a_dataset",),
    ),
    Mutant(
        "a step without loss tokens counted in the metrics",
        "src/grpokit/train/batch.py",
        "sum(getattr(s, key) * s.num_tokens for s in steps if s.num_tokens) / tokens",
        "sum(getattr(s, key) * s.num_tokens for s in steps) / tokens",
        ("tests/train/test_trainer.py::test_update_stats_combine_weights_by_tokens_and_skips_empty_steps",),
    ),
    Mutant(
        "kl_high on one step's KL",
        "src/grpokit/diagnostics/hacking.py",
        "mean = sum(values) / len(values)",
        "mean = values[-1]",
        ("tests/diagnostics/test_hacking_monitor.py::test_single_kl_spikes_raise_nothing",),
    ),
    Mutant(
        "config choices hard-coded, not the algo tables",
        "src/grpokit/config.py",
        '_check_choice("algo.surrogate", a.surrogate, tuple(SURROGATES))',
        '_check_choice("algo.surrogate", a.surrogate, ("clip", "cispo", "sapo"))',
        ("tests/test_config.py::test_algo_choices_are_the_algo_tables",),
    ),
    Mutant(
        "every ValueError shown as one line",
        "src/grpokit/cli.py",
        "except UserError as e:",
        "except (UserError, ValueError) as e:",
        ("tests/test_cli.py::test_user_errors_are_one_line_and_library_bugs_keep_their_traceback",),
    ),
    Mutant(
        "sampler log-probs not renormalised after top-k / top-p",
        "src/grpokit/rollout/sampler.py",
        "return index_b, torch.log_softmax(z_bV, dim=-1)",
        "return index_b, torch.log_softmax(logits_bV.float() / params.temperature, dim=-1)",
        ("tests/train/test_logprob_consistency.py::test_top_k_top_p_logprobs_are_the_renormalised_ones",),
    ),
    Mutant(
        "rollout correction weights not applied in the loss",
        "src/grpokit/algo/losses.py",
        "surrogate_BT = surrogate_BT * torch.where(mask_BT, is_weights.detach().to(logp.dtype), zeros_BT)",
        "pass",
        ("tests/algo/test_correction.py::test_weights_scale_the_policy_gradient_term_in_the_loss",),
    ),
    Mutant(
        "top-k pi_old is the full recomputation",
        "src/grpokit/train/update.py",
        "behaviour = sampler if truncated and sampler is not None else old_logp",
        "behaviour = old_logp",
        ("tests/train/test_logprob_consistency.py::test_with_top_k_the_sampler_logprobs_are_pi_old",),
    ),
    Mutant(
        "data/ imports rewards/ again (a circle)",
        "src/grpokit/data/tasks.py",
        "from grpokit.data.answers import extract_answer, is_hedged",
        "from grpokit.rewards.math import extract_answer, is_hedged",
        ("tests/test_layout.py::test_no_circles_between_rooms",),
    ),
    Mutant(
        "environment tokens trained (loss on the tool results)",
        "src/grpokit/train/batch.py",
        "mask = rollout.trained_mask if loss_mask is None else loss_mask",
        "mask = rollout.completion_mask if loss_mask is None else loss_mask",
        ("tests/train/test_env_training.py::test_environment_tokens_get_no_gradient",),
    ),
    Mutant(
        "observation ids recorded as model tokens",
        "src/grpokit/rollout/episodes.py",
        "r.add(delta, False, [0.0] * len(delta))",
        "r.add(delta, True, [0.0] * len(delta))",
        (
            "tests/rollout/test_episodes.py::"
            "test_environment_tokens_are_masked_and_model_tokens_carry_the_sampler_logprobs",
        ),
    ),
    Mutant(
        "episode positions count the padding inside observation chunks",
        "src/grpokit/rollout/episodes.py",
        "pos_bw = attn_bL.sum(dim=1, keepdim=True) + torch.arange(w, device=device)[None]",
        "pos_bw = attn_bL.shape[1] + torch.arange(w, device=device)[None].expand(len(feeds), w)",
        (
            "tests/rollout/test_episodes.py::"
            "test_environment_tokens_are_masked_and_model_tokens_carry_the_sampler_logprobs",
        ),
    ),
    Mutant(
        "max_turns ignored",
        "src/grpokit/rollout/episodes.py",
        "if r.num_turns == max_turns:",
        "if r.num_turns == max_turns + 100:",
        ("tests/rollout/test_episodes.py::test_max_turns_and_the_token_budget_hold",),
    ),
    Mutant(
        "packed positions not restarting per sequence (sequences attend to each other)",
        "src/grpokit/train/batch.py",
        "positions[k, at : at + n] = torch.arange(n)",
        "positions[k, at : at + n] = torch.arange(at, at + n)",
        ("tests/train/test_batch.py::test_packed_gradients_equal_padded_gradients",),
    ),
    Mutant(
        "own decode path writing the new key one slot late",
        "src/grpokit/rollout/decode.py",
        "keys[i][:, :, start : start + Q] = k",
        "keys[i][:, :, start + 1 : start + Q + 1] = k[:, :, : keys[i].shape[2] - start - 1]",
        ("tests/rollout/test_decode.py::test_prefill_and_steps_give_hf_logits",),
    ),
]


def copy_checkout(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise LookupError(
            f"mutant {mutant.name!r}: its original text occurs {text.count(mutant.old)} times in "
            f"{mutant.path} (must be once); the code moved -- update the mutant"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def run(mutant: Mutant, python: str) -> tuple[str, float]:
    """'killed' | 'survived' | 'error: ...', and the seconds its tests took."""
    with tempfile.TemporaryDirectory(prefix="grpokit-mutant-") as tmp:
        root = Path(tmp)
        copy_checkout(root)
        apply(mutant, root)
        env = {**os.environ, "PYTHONPATH": str(root / "src") + os.pathsep + str(root)}
        where = subprocess.run(
            [python, "-c", "import grpokit, sys; sys.stdout.write(grpokit.__file__)"],
            cwd=root, env=env, capture_output=True, text=True,
        ).stdout  # fmt: skip
        if not where.startswith(str(root)):
            return f"error: grpokit imported from {where or '?'}, not the mutated copy", 0.0
        t0 = time.monotonic()
        res = subprocess.run(
            [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
            cwd=root, env=env, capture_output=True, text=True,
        )  # fmt: skip
        seconds = time.monotonic() - t0
        if res.returncode == 1:
            return "killed", seconds
        if res.returncode == 0:
            return "survived", seconds
        return f"error: pytest exited {res.returncode}: {res.stdout[-400:]}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--python", default=sys.executable, help="interpreter with grpokit's dependencies")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; --list shows them")
    chosen = [by_name[n] for n in args.names] or MUTANTS
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.path}\n    " + "\n    ".join(m.tests))
        return 0
    for m in chosen:  # every mutant must still apply before any is run
        apply_check = (REPO / m.path).read_text().count(m.old)
        if apply_check != 1:
            print(f"mutant {m.name!r} does not apply: its text occurs {apply_check} times in {m.path}")
            return 2
    outcomes = []
    for m in chosen:
        outcome, seconds = run(m, args.python)
        outcomes.append(outcome)
        print(f"{outcome:8s}  {seconds:6.1f} s  {m.name}", flush=True)
    survived = sum(o == "survived" for o in outcomes)
    errors = sum(o.startswith("error") for o in outcomes)
    print(f"{len(chosen) - survived - errors} killed, {survived} survived, {errors} errors")
    return 1 if survived else (2 if errors else 0)


if __name__ == "__main__":
    sys.exit(main())
