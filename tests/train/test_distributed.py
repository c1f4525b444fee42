"""torchrun data parallelism on CPU (2 processes, gloo): DDP equals one process, FSDP trains and resumes.

Each torchrun launch costs about 7 s (two interpreters importing torch and transformers), so the
launches are shared by module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.config import ConfigError, load_config
from grpokit.train import trainer as trainer_module
from grpokit.train.distributed import Dist
from grpokit.train.evaluate import combine_evaluations
from tests.helpers import TIME_KEYS

# the shipped tiny model on the demo's sort task; 4 micro-batches per rank (gradient accumulation
# with the sync deferred to the last), a reference model, mu = 2 (pi_old != pi_theta), prompts
# shared (train.share_prompts, the default) in one process and under torchrun alike
COMMON = [
    "train.prompts_per_step=8",
    "train.micro_batch_size=4",
    "train.mu=2",
    "train.eval_max_prompts=20",
    "train.max_steps=3",
    "train.quiet=true",
    "logging.report=false",
]


def launch(
    out: Path, *args: str, nproc: int = 2, resume: Path | None = None, config: str = "demo"
) -> subprocess.CompletedProcess:
    """``grpokit train --config CONFIG`` under torchrun (nproc >= 2) or in one plain process."""
    head = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
    head = head if nproc > 1 else [sys.executable]
    cmd = [*head, "-m", "grpokit", "train"]
    cmd += ["--resume", str(resume)] if resume else ["--config", config, "--output-dir", str(out)]
    for a in [] if resume else [*COMMON, *args]:
        cmd += ["--set", a]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and nproc > 1 and "ddress already in use" in proc.stderr:
        # torchrun's free-port pick can race another process for the port (pytorch/pytorch#126510):
        # the launch, not grpokit, failed; one more launch, any other failure still fails the test
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def resumed_copy(run: Path, dest: Path, step: int) -> Path:
    """A copy of ``run`` as a crash right after the checkpoint of ``step`` would have left it."""
    shutil.copytree(run, dest)
    for ckpt in (dest / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    shutil.rmtree(dest / "final")
    (dest / "summary.json").unlink()
    return dest


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    launch(out, "train.save_every=1", nproc=1)
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    proc = launch(out, "train.save_every=1", "distributed.strategy=ddp")
    assert proc.stdout.count("done: 3 steps") == 1  # rank 0 alone reports
    return out


def test_ddp_first_step_equals_one_process(single, ddp):
    before = weights(Path(__file__).parents[2] / "src/grpokit/models/tiny_model")
    one = weights(single / "checkpoints/step-000001/model")
    two = weights(ddp / "checkpoints/step-000001/model")
    assert one.keys() == two.keys()
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    assert moved > 5e-4  # 2 Adam steps of lr 3e-4 (mu = 2): the step really changed the weights...
    for k in one:  # ...and two ranks changed them as one process did, to float32 round-off
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=2e-6, msg=k)


def test_ddp_run_matches_one_process_and_writes_once(single, ddp):
    a, b = metrics(single), metrics(ddp)
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        # the same completions and rewards: the sampler draws each row's uniforms from one global block
        for key in ("reward_mean", "reward_std", "accuracy", "completion_length_mean", "zero_std_fraction"):
            assert x[key] == y[key], key
        # the ranks lay their micro-batches out as one process does, prompts computed once
        assert y["prompt_shared_fraction"] == x["prompt_shared_fraction"] > 0.5
        for key in ("loss", "kl", "grad_norm", "entropy", "clip_fraction", "advantage_abs_mean"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), key
        # each rank's recomputed pi_old equals its sampler's log-probs (float32), as in one process
        assert y["logprob_mismatch"] < 1e-5 and y["logprob_ratio_outside"] == 0
    s1, s2 = (json.loads((r / "summary.json").read_text()) for r in (single, ddp))
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    assert s2["accuracy_before"] == s1["accuracy_before"]
    assert s2["eval_examples_before"] == s1["eval_examples_before"]
    # rank 0 alone writes: one line per step, samples from the whole batch
    samples = [json.loads(x) for x in (ddp / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 4


def test_fsdp_run_matches_one_process_on_the_fused_head_and_own_sampler(single, tmp_path):
    # FSDP2 leaves the root unit (embeddings, norm, head) whole after the forward, so the loss
    # projects hidden states block by block as in one process, and the sampler decodes on its own
    # path with the shards gathered: neither falls back, and the run is the single process's
    out = tmp_path / "run"
    proc = launch(out, "train.save_every=1", "distributed.strategy=fsdp")
    assert "full logits" not in proc.stdout and "Hugging Face forward" not in proc.stdout, proc.stdout
    for x, y in zip(metrics(single), metrics(out), strict=True):
        for key in ("reward_mean", "accuracy", "completion_length_mean", "zero_std_fraction"):
            assert y[key] == x[key], key
        for key in ("loss", "kl", "grad_norm", "entropy", "clip_fraction"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), key
        assert y["logprob_mismatch"] < 1e-5


def test_ddp_resume_equals_uninterrupted(ddp, tmp_path):
    run = resumed_copy(ddp, tmp_path / "run", step=2)
    launch(run, resume=run)
    assert metrics(run) == metrics(ddp)


def test_ddp_episodes_with_tools_equal_one_process(tmp_path):
    """The calculator demo's episodes (tool calls answered in each rank's own worker pool): two ranks
    sample the same episodes as one process and take the same update."""
    args = (
        "train.prompts_per_step=4",
        "rollout.group_size=4",
        "train.max_steps=2",
        "train.eval_max_prompts=8",
    )
    one, two = tmp_path / "one", tmp_path / "two"
    launch(one, *args, nproc=1, config="demo-calculator")
    launch(two, *args, "distributed.strategy=ddp", config="demo-calculator")
    a, b = metrics(one), metrics(two)
    assert [m["step"] for m in b] == [1, 2]
    assert sum(m["tool_calls_mean"] for m in a) > 0  # the episodes really called the tool
    for x, y in zip(a, b, strict=True):
        for key in (
            "reward_mean",
            "completion_length_mean",
            "turns_mean",
            "tool_calls_mean",
            "env_tokens_mean",
        ):
            assert x[key] == y[key], key
        for key in ("loss", "kl", "grad_norm", "entropy"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), key
    s1, s2 = (json.loads((r / "summary.json").read_text()) for r in (one, two))
    assert s2["eval_examples_before"] == s1["eval_examples_before"]


def test_torchrun_demo_runs_on_cpu_and_prints_once(tmp_path):
    # the acceptance line: torchrun --nproc-per-node 2 -m grpokit demo --steps 2
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "grpokit", "demo", "--steps", "2", "--quiet", "--output-dir", str(out)]
    cmd += ["--set", "train.eval_max_prompts=20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("held-out accuracy") == 1  # rank 0 alone prints the table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert summary["accuracy_before"] is not None and (out / "report.html").is_file()


LORA = ("model.lora={r: 4}", "train.save_every=2")


@pytest.fixture(scope="module")
def ddp_lora(tmp_path_factory):
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("ddp_lora") / "run"
    launch(out, *LORA)
    return out


def test_ddp_trains_lora_adapters_against_the_adapter_off_reference(ddp_lora):
    m = metrics(ddp_lora)
    assert [x["step"] for x in m] == [1, 2, 3] and m[0]["kl"] > 0  # the adapters moved off the base
    assert (ddp_lora / "final/adapter_model.safetensors").is_file()


def test_fsdp_lora_equals_ddp_lora_and_resumes_exactly(ddp_lora, tmp_path):
    # the policy's adapters sharded with the base it trains on, the reference that base with the
    # adapters off: the same run as DDP, and a resume from its sharded checkpoint the same run again
    out = tmp_path / "run"
    proc = launch(out, *LORA, "distributed.strategy=fsdp")
    assert "full logits" not in proc.stdout and "Hugging Face forward" not in proc.stdout, proc.stdout
    a, b = metrics(ddp_lora), metrics(out)
    for x, y in zip(a, b, strict=True):
        for key in ("reward_mean", "accuracy", "completion_length_mean"):
            assert y[key] == x[key], key
        for key in ("loss", "kl", "grad_norm", "entropy"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), key
        assert y["logprob_mismatch"] < 1e-5
    one, two = (load_file(r / "final/adapter_model.safetensors") for r in (ddp_lora, out))
    assert one.keys() == two.keys() and len(one) > 0
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=2e-6, msg=k)
    run = resumed_copy(out, tmp_path / "resumed", step=2)
    launch(run, resume=run)
    assert metrics(run) == metrics(out)
    again = load_file(run / "final/adapter_model.safetensors")
    assert all(torch.equal(again[k], two[k]) for k in two)


# the weights a colocated vLLM engine loads, under FSDP: every shard gathered whole and the LoRA
# delta merged in, as one process computes them from the unsharded model
MERGE_SHARDED = """
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from grpokit.models.loading import merged_state_dict
from grpokit.train.distributed import exit_process, init_distributed, shard, shutdown
d = init_distributed("fsdp")
for lora in (False, True):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p)  # B = 0 at init: a delta of zero would prove nothing
    want = {k: v.detach().clone() for k, v in merged_state_dict(model).items()}
    shard(model)
    got = merged_state_dict(model)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k, v in got.items():
        assert type(v) is torch.Tensor, (k, type(v))
        torch.testing.assert_close(v, want[k], rtol=0, atol=1e-6, msg=k)
    print(f"rank {d.rank} lora={lora}: {len(got)} whole tensors equal", flush=True)
shutdown(d)
exit_process(0)
"""


def test_merged_weights_of_a_sharded_model_equal_the_unsharded_ones(tmp_path):
    pytest.importorskip("peft")
    script = tmp_path / "merge_sharded.py"
    script.write_text(MERGE_SHARDED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("whole tensors equal") == 4


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "run"
    # DAPO exercises uneven work per rank: dynamic sampling draws extra batches until every rank's
    # quota is full, and track_kl shards a reference model too
    launch(out, "distributed.strategy=fsdp", "algorithm=dapo", "train.track_kl=true", "train.save_every=2")
    return out


def test_fsdp_three_steps_complete_and_resume_exactly(fsdp, tmp_path):
    m = metrics(fsdp)
    assert [x["step"] for x in m] == [1, 2, 3]
    assert all(x["kl"] is not None and x["generation_batches"] >= 1 for x in m)
    # the sampler decodes with the parameters unsharded, the loss's forward runs sharded: the same
    # log-probs to float32 round-off
    assert all(x["logprob_mismatch"] < 1e-5 and x["logprob_ratio_outside"] == 0 for x in m)
    ckpt = fsdp / "checkpoints/step-000002"
    assert (ckpt / "optimizer/.metadata").is_file()  # torch.distributed.checkpoint, sharded
    assert json.loads((fsdp / "summary.json").read_text())["world_size"] == 2
    final = weights(fsdp / "final")
    run = resumed_copy(fsdp, tmp_path / "run", step=2)
    launch(run, resume=run)
    assert metrics(run) == m
    for k, v in weights(run / "final").items():
        assert torch.equal(v, final[k]), k


def test_fsdp_checkpoint_refuses_a_single_process_resume(fsdp, tmp_path):
    run = resumed_copy(fsdp, tmp_path / "run", step=2)
    cmd = [sys.executable, "-m", "grpokit", "train", "--resume", str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "saved with FSDP" in proc.stderr + proc.stdout


# -- single-process pieces -------------------------------------------------------------------


def test_prompts_must_split_evenly_across_ranks(monkeypatch):
    monkeypatch.setattr(trainer_module, "init_distributed", lambda *a: Dist(rank=0, world_size=3))
    cfg = load_config("demo", ["train.prompts_per_step=8"])
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        trainer_module.GRPOTrainer(cfg)


def test_single_process_collectives_are_identities():
    d = Dist()
    assert not d.enabled and d.is_main
    assert d.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert d.sum([1.5, 2.0]) == [1.5, 2.0] and d.max(3.0) == 3.0 and d.broadcast("x") == "x"
    assert d.pad_plan([[0, 1], [2]]) == [[0, 1], [2]]


def test_evaluations_of_shards_combine_to_the_whole():
    # shard 1: 3 prompts, all verified, rewards 1, 0, 1; shard 2: 2 prompts, one unverified (None)
    parts = [
        {"reward_mean": 2 / 3, "accuracy": 2 / 3, "num_prompts": 3, "num_verified": 3, "examples": [1, 2, 3]},
        {"reward_mean": 0.5, "accuracy": 1.0, "num_prompts": 2, "num_verified": 1, "examples": [4, 5]},
    ]
    whole = combine_evaluations(parts)
    assert whole["reward_mean"] == pytest.approx(3 / 5)  # (2 + 1) / 5
    assert whole["accuracy"] == pytest.approx(3 / 4)  # (2 + 1) correct of 4 verified
    assert whole["examples"] == [1, 2, 3, 4, 5] and whole["num_prompts"] == 5


def test_distributed_config_is_validated():
    with pytest.raises(ConfigError, match=r"distributed\.strategy"):
        load_config("demo", ["distributed.strategy=zero3"])
    with pytest.raises(ConfigError, match=r"distributed\.backend"):
        load_config("demo", ["distributed.backend=mpi"])
    load_config("demo", ["distributed.strategy=fsdp", "model.lora={r: 4}"])  # trains (test above)


# a process whose gloo group outlives destroy_process_group (FSDP2 holds it) with a worker thread
# that comes back for the GIL after the main thread is done: a collective's completion callback
# that sleeps stands in for the worker releasing a collective's tensors late (pytorch#179291)
LATE_WORKER = """
import atexit, sys, tempfile, time, torch, torch.distributed as dist
from grpokit.train import distributed
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
distributed._group_started = True
kept = dist.group.WORLD
dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda fut: time.sleep(0.3))
time.sleep(0.05)
dist.destroy_process_group()
atexit.register(lambda: print("exit handler ran", flush=True))
sys.stdout.write("buffered, no newline")
distributed.exit_process(3)
"""


def test_exit_process_survives_a_late_gloo_worker_and_runs_exit_handlers():
    # left through sys.exit / interpreter finalization, this script aborts (-6) every time
    proc = subprocess.run([sys.executable, "-c", LATE_WORKER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout.startswith("buffered, no newline") and "exit handler ran" in proc.stdout


def test_the_command_line_exits_normally_without_a_process_group(monkeypatch, capsys):
    from grpokit import cli

    monkeypatch.setattr(sys, "argv", ["grpokit"])  # prints the help, returns 0
    with pytest.raises(SystemExit) as exit_:
        cli.entry()
    assert exit_.value.code == 0 and "usage: grpokit" in capsys.readouterr().out
