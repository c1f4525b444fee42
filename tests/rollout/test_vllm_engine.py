"""The vLLM engine: start-up errors where it cannot run, its output layout, the sampled tokens'
log-probs it records (against a CPU stand-in for vLLM's offline API: tests/rollout/fake_vllm.py),
and (on a GPU with vLLM) the same contract as the built-in sampler, with throughput measured
against it."""

from __future__ import annotations

import copy
import importlib.util
import json
import time

import pytest
import torch

import grpokit.rollout.vllm_engine as vllm_engine
from grpokit.config import ConfigError, load_config
from grpokit.errors import MissingFileError
from grpokit.models.loading import (
    base_model_path,
    load_model,
    lora_merge_reason,
    merged_state_dict,
    resolve_model_path,
)
from grpokit.rollout.sampler import SamplingParams, encode_prompts, sample
from grpokit.rollout.vllm_engine import (
    VLLMEngine,
    has_processed_logprobs,
    rollout_from_token_lists,
    sampler_logprobs_reason,
)
from tests.rollout.fake_vllm import FakeLLM, install_fake_vllm_module
from tests.rollout.test_decode import build, lora_model

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


@pytest.mark.parametrize(
    ("version", "processed"),
    [("0.8.5", False), ("0.10.1.1", False), ("0.10.2", True), ("0.10.2rc2", True), ("0.11.0", True),
     ("1.0", True), ("12.3.4+cu128", True), (None, False), ("dev", False)],
)  # fmt: skip
def test_processed_logprobs_arrive_with_vllm_0_10_2(version, processed):
    assert has_processed_logprobs(version) is processed


def test_raw_logprobs_are_the_sampling_distribution_only_at_temperature_1_untruncated():
    plain = SamplingParams(max_new_tokens=4, temperature=1.0)
    assert sampler_logprobs_reason(plain, processed=False) is None
    for params in (
        SamplingParams(max_new_tokens=4, temperature=0.7),
        SamplingParams(max_new_tokens=4, top_k=5),
        SamplingParams(max_new_tokens=4, top_p=0.9),
    ):
        assert sampler_logprobs_reason(params, processed=True) is None
        why = sampler_logprobs_reason(params, processed=False)
        assert "before temperature and top-k / top-p" in why and "0.10.2" in why


def engine_over(model, tok, monkeypatch, processed=True, **fake) -> VLLMEngine:
    install_fake_vllm_module(monkeypatch)
    llm = FakeLLM(model, tok, **fake)
    engine = VLLMEngine(
        "unused", tok, dtype="float32", max_new_tokens=8, gpu_memory_utilization=0.1, sleep=False,
        seed=0, llm=llm, processed_logprobs=processed,
    )  # fmt: skip
    engine.load_weights(model.state_dict().items())
    return engine


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_vllm_rollouts_record_each_sampled_tokens_logprob(peaky, monkeypatch, temperature, top_k):
    # the fake answers with the built-in sampler's tokens and log-probs, one prompt per request:
    # the engine must put them row for row into the rollout, with the sampler's padding and dtype
    model, tok = peaky
    engine = engine_over(model, tok, monkeypatch, decoy=True)
    params = SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k)
    prompts = ["12+34=", "7+8=", "100+1="]
    r = engine.sample(prompts, 4, params, seed=5, first_prompt_index=10, policy_version=7)
    asked = engine.llm.requests[-1]
    assert [q.logprobs for q in asked] == [0, 0, 0]
    assert [q.top_k for q in asked] == [top_k if top_k else -1] * 3
    assert r.sampler_logp.dtype == torch.float32 and r.sampler_logp.shape == r.completion_ids.shape
    assert r.policy_version.tolist() == [7] * 12
    m = r.completion_mask
    assert bool((r.sampler_logp[~m] == 0).all()) and bool((r.sampler_logp[m] < 0).all())
    for i, (prompt, q) in enumerate(zip(prompts, asked, strict=True)):
        ours = SamplingParams(8, temperature, 1.0, top_k)
        want = sample(model, tok, [prompt], 4, ours, torch.Generator().manual_seed(q.seed))
        rows = slice(4 * i, 4 * i + 4)
        assert r.completion_token_lists()[rows] == want.completion_token_lists()
        T = want.completion_ids.shape[1]
        assert torch.equal(r.sampler_logp[rows, :T], want.sampler_logp)  # the sampled id's, not the decoy's


def test_without_processed_logprobs_only_plain_sampling_records_them(peaky, monkeypatch):
    model, tok = peaky
    engine = engine_over(model, tok, monkeypatch, processed=False)
    hot = engine.sample(["12+34="], 2, SamplingParams(max_new_tokens=4, temperature=0.7), seed=1)
    assert engine.llm.requests[-1][0].logprobs is None and hot.sampler_logp is None
    assert "before temperature" in engine.logprobs_reason(SamplingParams(max_new_tokens=4, temperature=0.7))
    plain = engine.sample(["12+34="], 2, SamplingParams(max_new_tokens=4), seed=1)
    assert engine.llm.requests[-1][0].logprobs == 0 and plain.sampler_logp is not None


def test_a_missing_or_non_finite_logprob_is_an_error_not_a_zero(peaky, monkeypatch):
    model, tok = peaky
    params = SamplingParams(max_new_tokens=4)
    for damage, message in (
        (lambda c: setattr(c, "logprobs", None), "returned none log-probs for the"),
        (lambda c: c.logprobs.pop(), "log-probs for the"),
        (lambda c: c.logprobs[0].clear(), "no finite log-prob"),
        (lambda c: setattr(c.logprobs[0][c.token_ids[0]], "logprob", float("nan")), "no finite log-prob"),
    ):
        engine = engine_over(model, tok, monkeypatch)
        generate = engine.llm.generate

        def broken(requests, params, use_tqdm=False, generate=generate, damage=damage):
            outputs = generate(requests, params, use_tqdm)
            damage(outputs[0].outputs[1])
            return outputs

        engine.llm.generate = broken
        with pytest.raises(RuntimeError, match=message):
            engine.sample(["12+34="], 2, params, seed=1)


def test_engine_token_and_logprob_lists_must_line_up(tiny):
    _, tok = tiny
    prompt_ids, prompt_mask = encode_prompts(tok, ["1+1="])
    tokens, truncated = [[[5, 6], [7]]], [[False, False]]
    with pytest.raises(ValueError, match="one log-prob per completion token"):
        rollout_from_token_lists(tok, prompt_ids, prompt_mask, tokens, truncated, 2, [[[-0.1], [-0.2]]])


def test_rollout_correction_with_vllm_needs_its_processed_logprobs(monkeypatch):
    monkeypatch.setattr(vllm_engine, "check_available", lambda: None)  # as if vLLM and a GPU were here
    sets = ["rollout.engine=vllm", "algo.rollout_correction=token_truncated"]
    monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: "0.9.2")
    with pytest.raises(ConfigError, match=r"vLLM \(0\.9\.2\) reports log-probs before temperature") as e:
        load_config("demo", [*sets, "rollout.temperature=0.7"])
    assert "pip install 'vllm>=0.10.2'" in str(e.value) and "rollout_correction: null" in str(e.value)
    assert load_config("demo", [*sets, "rollout.temperature=1.0", "rollout.top_k=0", "rollout.top_p=1.0"])
    monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: "0.11.0")
    assert load_config("demo", [*sets, "rollout.temperature=0.7", "rollout.top_k=20"])


def test_lora_adapters_are_merged_into_the_pushed_weights_aside():
    model, _ = lora_model("qwen2")  # adapters on all seven projections, B not 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pushed = merged_state_dict(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge, in place on a copy
    assert pushed.keys() == want.keys()  # the base model's names: what vLLM's load_weights takes
    for key, value in want.items():
        torch.testing.assert_close(pushed[key], value, rtol=0, atol=1e-6)
    # an independent float64 reference for one layer: W + (alpha / r) B A
    q = model.base_model.model.model.layers[1].self_attn.q_proj
    A, B = q.lora_A["default"].weight.double(), q.lora_B["default"].weight.double()
    reference = q.base_layer.weight.double() + (8 / 4) * B @ A
    got = pushed["model.layers.1.self_attn.q_proj.weight"].double()
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)
    assert not torch.allclose(reference, q.base_layer.weight.double(), atol=1e-3)  # the adapter matters
    # the trainer's model is neither merged nor changed, and weights without an adapter are not copied
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(getattr(m, "merged", False) for m in model.modules())
    embed = model.base_model.model.model.embed_tokens.weight
    assert pushed["model.embed_tokens.weight"].data_ptr() == embed.data_ptr()
    with model.disable_adapter():  # adapters off: the base weights themselves
        off = merged_state_dict(model)
    assert torch.equal(off["model.layers.1.self_attn.q_proj.weight"], q.base_layer.weight)


def test_adapters_that_do_not_merge_by_addition_are_refused_with_the_reason():
    peft = pytest.importorskip("peft")
    plain, _ = build("llama")
    assert lora_merge_reason(plain) is None
    assert merged_state_dict(plain).keys() == plain.state_dict().keys()
    dora, _ = lora_model(use_dora=True)
    assert "not vanilla LoRA" in lora_merge_reason(dora)
    with pytest.raises(ValueError, match="cannot merge this model's adapters"):
        merged_state_dict(dora)
    merged, _ = lora_model()
    merged.merge_adapter()
    assert "merged" in lora_merge_reason(merged)
    saved = peft.get_peft_model(
        build("llama")[0], peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    assert "modules_to_save" in lora_merge_reason(saved)


def test_lora_runs_are_accepted_and_an_adapter_directory_starts_vllm_from_its_base(
    tmp_path, tiny_dir, monkeypatch
):
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(vllm_engine, "check_available", lambda: None)  # as if vLLM and a GPU were here
    assert load_config("demo", ["rollout.engine=vllm", "model.lora={r: 4}"]).model.lora.r == 4
    model, _ = load_model(str(tiny_dir))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    assert base_model_path(tmp_path / "adapter") == tiny_dir  # vLLM cannot load an adapter directory
    assert base_model_path(tiny_dir) == tiny_dir
    started = []
    monkeypatch.setattr(
        vllm_engine, "_start_llm", lambda model_dir, dtype, *a: started.append((model_dir, dtype))
    )
    adapter_dir = json.dumps(str(tmp_path / "adapter"))
    cfg = load_config(None, ["rollout.engine=vllm", f"model.name_or_path={adapter_dir}"])
    vllm_engine.engine_from_config(cfg, None)
    # under autocast vLLM computes in the autocast dtype, as the policy does
    mixed = load_config(None, ["rollout.engine=vllm", "model.autocast=bfloat16"])
    vllm_engine.engine_from_config(mixed, None)
    assert started == [(str(tiny_dir), "float32"), (str(resolve_model_path("tiny")), "bfloat16")]
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "adapter_config.json").write_text("{}")
    with pytest.raises(MissingFileError, match="names no base_model_name_or_path"):
        base_model_path(tmp_path / "orphan")


def test_a_lora_model_vllm_cannot_take_is_refused_before_vllm_starts(tmp_path, tiny_dir, monkeypatch):
    peft = pytest.importorskip("peft")
    from grpokit.train.trainer import GRPOTrainer
    from tests.helpers import varied

    monkeypatch.setattr(vllm_engine, "check_available", lambda: None)
    monkeypatch.setattr(vllm_engine, "_start_llm", lambda *a: pytest.fail("vLLM started"))
    model, tok = load_model(str(tiny_dir))
    dora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    out = json.dumps(str(tmp_path / "run"))
    cfg = load_config("demo", ["rollout.engine=vllm", f"train.output_dir={out}"])
    with pytest.raises(ConfigError, match=r"not vanilla LoRA.*rollout\.engine=builtin"):
        GRPOTrainer(cfg, model=dora, tokenizer=tok, rewards=[varied])


@pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs the vllm package and a CUDA GPU (the vllm extra)")
def test_vllm_matches_the_contract_and_is_measured_against_the_builtin_sampler(tmp_path):
    from grpokit.models.loading import load_model, resolve_model_path
    from grpokit.train.batch import TrainBatch, batch_logprobs, plan_micro_batches

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
    # vLLM's reported log-probs against the trainer's float32 recomputation of the same tokens
    batch = TrainBatch.from_rollout(r, torch.zeros(r.num_rows))
    plan = plan_micro_batches(batch.total_lengths(), 64, None)
    recomputed = batch_logprobs(model, batch, plan, tok.pad_token_id, 1.0).cpu()
    m = r.completion_mask
    assert r.sampler_logp is not None and bool(torch.isfinite(r.sampler_logp[m]).all())
    assert float((recomputed[m] - r.sampler_logp[m]).abs().mean()) < 1e-3
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


@pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs the vllm package and a CUDA GPU (the vllm extra)")
def test_vllm_episodes_and_lora_pushes_on_a_gpu():
    # multi-turn calculator episodes on the real engine, then a LoRA model's merged push
    peft = pytest.importorskip("peft")
    from grpokit.data.tasks import TaskSource
    from grpokit.models.loading import resolve_model_path
    from grpokit.rollout.episodes import episodes_from_config
    from grpokit.train.batch import TrainBatch, batch_logprobs, plan_micro_batches

    model, tok = load_model("tiny-calculator", device="cuda")
    engine = VLLMEngine(
        str(resolve_model_path("tiny-calculator")), tok, dtype="float32", max_new_tokens=40,
        gpu_memory_utilization=0.2, sleep=False, seed=0,
    )  # fmt: skip
    engine.load_weights(model.state_dict().items())
    cfg = load_config(None, ["model.name_or_path=tiny-calculator", "data.task=calculator"])
    spec = episodes_from_config(cfg, tok, "calculator")
    rows = [TaskSource("calculator").row(i) for i in range(8)]
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    r = engine.sample_episodes(rows, spec.make_env, 4, params, 3, max_turns=3, max_episode_tokens=120)
    assert sum(e.num_tool_calls for e in r.episodes) >= 3
    batch = TrainBatch.from_rollout(r, torch.zeros(r.num_rows))
    plan = plan_micro_batches(batch.total_lengths(), 64, None)
    recomputed = batch_logprobs(model, batch, plan, tok.pad_token_id, 1.0).cpu()
    m = r.trained_mask
    assert float((recomputed[m] - r.sampler_logp[m]).abs().mean()) < 1e-3

    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    engine.load_weights(merged_state_dict(lora).items())
    prompts = [row["prompt"] for row in rows]
    theirs = engine.sample(prompts, 2, params, seed=5)
    tb = TrainBatch.from_rollout(theirs, torch.zeros(theirs.num_rows))
    plan = plan_micro_batches(tb.total_lengths(), 64, None)
    adapted = batch_logprobs(lora, tb, plan, tok.pad_token_id, 1.0).cpu()
    m = theirs.completion_mask
    assert float((adapted[m] - theirs.sampler_logp[m]).abs().mean()) < 1e-3  # vLLM samples the adapted policy
