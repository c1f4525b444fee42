"""The vLLM engine: start-up errors where it cannot run, its output layout, and (on a GPU with vLLM)
the same contract as the built-in sampler, with throughput measured against it."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.rollout.sampler import SamplingParams, encode_prompts, sample
from grpokit.rollout.vllm_engine import rollout_from_token_lists

HAS_VLLM_GPU = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.mark.skipif(HAS_VLLM_GPU, reason="vLLM and a GPU are present: the engine can start")
def test_selecting_vllm_where_it_cannot_run_fails_at_start_up_with_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config("demo", ["rollout.engine=vllm"])
    msg = str(e.value)
    assert "rollout.engine=vllm" in msg and "rollout.engine=builtin" in msg
    assert ("pip install 'grpokit[vllm]'" in msg) or ("CUDA GPU" in msg)


def test_vllm_options_are_validated():
    with pytest.raises(ConfigError, match=r"rollout\.vllm_gpu_memory_utilization"):
        load_config("demo", ["rollout.vllm_gpu_memory_utilization=1.5"])


def test_engine_output_takes_the_built_in_samplers_layout(tiny):
    # what an engine returned for 2 prompts x G = 2: one row ends in EOS, one hits the length limit
    _, tok = tiny
    eos = tok.eos_token_id
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    prompt_ids, prompt_mask = encode_prompts(tok, ["1+1=", "12+3="])
    tokens = [[[*ids("2"), eos], ids("11")], [[*ids("15"), eos], ids("1")]]
    truncated = [[False, True], [False, True]]
    r = rollout_from_token_lists(tok, prompt_ids, prompt_mask, tokens, truncated, 2)
    assert r.num_rows == 4 and r.group_size == 2
    assert r.completions == ["2", "11", "15", "1"]  # EOS not in the text, as the sampler decodes
    assert r.completion_mask.sum(dim=1).tolist() == [2, 2, 3, 1]  # EOS is a completion token
    assert r.truncated.tolist() == [False, True, False, True]
    assert (r.completion_ids[3, 1:] == tok.pad_token_id).all()  # right-padded with the pad id
    assert r.completion_token_lists() == [t for group in tokens for t in group]
    with pytest.raises(ValueError, match="needs 2 completions"):
        rollout_from_token_lists(tok, prompt_ids, prompt_mask, [tokens[0], tokens[1][:1]], truncated, 2)


def test_refused_with_lora():
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=r"does not support model\.lora"):
        load_config("demo", ["rollout.engine=vllm", "model.lora={r: 4}"])


@pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs the vllm package and a CUDA GPU (the vllm extra)")
def test_vllm_matches_the_contract_and_is_measured_against_the_builtin_sampler(tmp_path):
    from grpokit.models.loading import load_model, resolve_model_path
    from grpokit.rollout.vllm_engine import VLLMEngine

    model, tok = load_model("tiny", device="cuda")
    engine = VLLMEngine(
        str(resolve_model_path("tiny")),
        tok,
        dtype="float32",
        max_new_tokens=64,
        gpu_memory_utilization=0.2,
        sleep=True,
        seed=0,
    )
    engine.load_weights(model.state_dict().items())
    prompts = [f"sort:{n:06d}=" for n in range(100000, 100000 + 7919 * 64, 7919)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    greedy = SamplingParams(max_new_tokens=12, temperature=1e-6)
    ours = sample(model, tok, prompts[:8], 1, SamplingParams(max_new_tokens=12, temperature=0))
    theirs = engine.sample(prompts[:8], 1, greedy, seed=1)
    agree = sum(a == b for a, b in zip(ours.completions, theirs.completions, strict=True))
    assert agree >= 6, (ours.completions, theirs.completions)  # float32 kernels differ at near-ties

    r = engine.sample(prompts, 16, params, seed=3)
    lengths = r.completion_mask.sum(dim=1)
    assert r.num_rows == 64 * 16 and (lengths >= 1).all()
    assert (lengths[r.truncated] == 64).all()  # truncated rows are exactly the ones at the limit...
    short = (lengths < 64).nonzero().flatten()  # ...and the others end in EOS
    assert (r.completion_ids[short, lengths[short] - 1] == tok.eos_token_id).all()
    timings = {}
    for name, fn in (
        ("vllm", lambda: engine.sample(prompts, 16, params, seed=4)),
        (
            "builtin",
            lambda: sample(model, tok, prompts, 16, params, torch.Generator("cuda").manual_seed(0)),
        ),
    ):
        fn()  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        timings[name] = float(out.completion_mask.sum()) / (time.perf_counter() - t)
    (tmp_path / "vllm_throughput.json").write_text(json.dumps(timings))
    print("completion tokens/s:", timings)
