"""Checkpoints: exact resume, crashes mid-run and mid-save, corruption, SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grpokit.config import load_config
from grpokit.errors import CheckpointError
from grpokit.train.checkpoint import find_checkpoint, list_checkpoints, verify
from grpokit.train.trainer import GRPOTrainer
from tests.helpers import TIME_KEYS


def sets(tiny_dir, out, **extra):
    base = {
        "model.name_or_path": str(tiny_dir),
        "train.output_dir": str(out),
        "train.quiet": True,
        "train.prompts_per_step": 3,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 5,
        "train.eval_max_prompts": 8,
        "algo.beta": 0.05,
        "train.lr": 3e-3,
        "train.max_steps": 6,
        "train.save_every": 2,
        "rollout.temperature": 1.3,
    }
    base.update(extra)
    return [f"{k}={json.dumps(v)}" for k, v in base.items()]


def length_reward(prompts, completions, **_):
    return [float(len(c) % 3) for c in completions]


def metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]


def run(tiny_dir, out, resume=None, rewards=(length_reward,), **extra):
    cfg = load_config(None, sets(tiny_dir, out, **extra))
    return GRPOTrainer(cfg, rewards=list(rewards)).train(resume=resume)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("ref") / "run"
    run(tiny_dir, out)
    return out


def test_stop_and_resume_equals_uninterrupted(tmp_path, tiny_dir, reference_run):
    out = tmp_path / "run"
    run(tiny_dir, out, **{"train.max_steps": 4})
    assert [p.name for p in list_checkpoints(out)] == ["step-000002", "step-000004"]
    run(tiny_dir, out, resume=out)  # max_steps back to 6
    assert metrics(out) == metrics(reference_run)
    assert (out / "samples.jsonl").read_text() == (reference_run / "samples.jsonl").read_text()
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def test_crash_after_checkpoint_resumes_without_duplicate_steps(tmp_path, tiny_dir, reference_run):
    out = tmp_path / "run"
    calls = {"n": 0}

    def crashes_on_step_6(prompts, completions, **kw):
        calls["n"] += 1
        if calls["n"] == 7:  # call 1 is the held-out evaluation before training; call 7 is step 6
            raise RuntimeError("simulated crash")
        return length_reward(prompts, completions, **kw)

    crashes_on_step_6.__name__ = "length_reward"  # same metric keys as the reference run
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tiny_dir, out, rewards=(crashes_on_step_6,), **{"train.save_every": 3})
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5]  # steps 4, 5 ran past the checkpoint
    run(tiny_dir, out, resume="auto", **{"train.save_every": 3})
    assert metrics(out) == metrics(reference_run)  # 4 and 5 re-run, each step logged once


def test_corrupt_checkpoint_is_refused_and_auto_falls_back(tmp_path, tiny_dir, reference_run):
    out = tmp_path / "run"
    run(tiny_dir, out, **{"train.max_steps": 4})
    weights = out / "checkpoints" / "step-000004" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"model.safetensors does not match its checksum.*--resume auto"
    ):
        find_checkpoint(out)
    warnings = []
    assert find_checkpoint(out, fallback=True, warn=warnings.append).name == "step-000002"
    assert "corrupt" in warnings[0]
    res = subprocess.run(
        [sys.executable, "-m", "grpokit", "train", "--resume", str(out)], capture_output=True, text=True
    )
    assert res.returncode == 2 and "does not match its checksum" in res.stderr
    run(tiny_dir, out, resume="auto")  # from step 2
    assert metrics(out) == metrics(reference_run)


def test_partial_checkpoint_is_refused(tmp_path, tiny_dir):
    out = tmp_path / "run"
    run(tiny_dir, out, **{"train.max_steps": 2})
    ckpt = out / "checkpoints" / "step-000002"
    verify(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        verify(ckpt)
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        run(tiny_dir, out, resume=out)


def _spawn(tiny_dir, out, env_extra=None, **extra):
    argv = [sys.executable, "-m", "grpokit", "train"]
    for s in sets(
        tiny_dir, out, **{"rewards": [{"name": "tests.train.test_checkpoint:length_reward"}], **extra}
    ):
        argv += ["--set", s]
    env = {**os.environ, **(env_extra or {})}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path, tiny_dir, reference_run):
    out = tmp_path / "run"
    proc = _spawn(tiny_dir, out, env_extra={"GRPOKIT_TEST_PAUSE_IN_SAVE": "4:60"})
    marker = out / "checkpoints" / "PAUSED_IN_SAVE"
    _wait_for(marker.exists)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(p.name.startswith(".tmp-step-000004") for p in (out / "checkpoints").iterdir())  # half-written
    assert find_checkpoint(out).name == "step-000002"  # the previous one verifies and is used
    marker.unlink()
    run(tiny_dir, out, resume="auto")
    assert metrics(out) == metrics(reference_run)
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())


def test_sigint_finishes_the_step_saves_and_says_how_to_resume(tmp_path, tiny_dir, reference_run):
    out = tmp_path / "run"
    proc = _spawn(tiny_dir, out, **{"train.save_every": 0})
    _wait_for(
        lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT
    assert "SIGINT received" in err and f"grpokit train --resume {out}" in err
    (ckpt,) = list_checkpoints(out)  # saved although save_every = 0
    steps = [r["step"] for r in metrics(out)]
    assert ckpt.name == f"step-{steps[-1]:06d}" and steps == list(range(1, len(steps) + 1))
    res = subprocess.run(
        [sys.executable, "-m", "grpokit", "train", "--resume", str(out), "--set", "train.save_every=2"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert res.returncode == 0, res.stderr
    assert metrics(out) == metrics(reference_run)
