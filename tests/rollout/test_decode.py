"""grpokit's own decode path samples what the Hugging Face forward samples, for every family it serves."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import NamedTuple

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grpokit.models.loading import keep_head_float32, mixed_precision
from grpokit.models.tiny import char_tokenizer
from grpokit.rollout.decode import (
    HFDecoder,
    Lora,
    OwnDecoder,
    Packed,
    decoder_for,
    onednn_linear_available,
    own_decoder_reason,
)
from grpokit.rollout.sampler import SamplingParams, encode_prompts, sample

PROMPTS = ["12+34=", "5=", "7*8-1=", "sort:9381="]  # different lengths: left padding differs per row
SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, initializer_range=0.3,
)  # fmt: skip


def build(family: str, **extra):
    tok = char_tokenizer()
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(
        {"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4, "llama-rope": 5, "llama-dynamic": 6}[family]
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, **ids, attention_bias=True, **extra))
    elif family == "llama-rope":  # a scaled rope: the rotary embedding comes from the model's own module
        rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
        model = LlamaForCausalLM(LlamaConfig(**SMALL, **ids, rope_parameters=rope, **extra))
    elif family == "llama-dynamic":  # a rope asked per step (it rescales with the sequence so far)
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
        model = LlamaForCausalLM(LlamaConfig(**SMALL, **ids, rope_parameters=rope, **extra))
    elif family == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, **ids, **extra))
    elif family == "qwen3":  # per-head q/k RMSNorm
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, **ids, **extra))
    else:  # a sliding window wider than any sequence here
        model = MistralForCausalLM(MistralConfig(**SMALL, **ids, sliding_window=100, **extra))
    return model.eval(), tok


FAMILIES = ["llama", "llama-rope", "llama-dynamic", "qwen2", "qwen3", "mistral"]


class Slack(NamedTuple):
    f32: float  # the factor on a float32 comparison's tolerance
    bf16: float  # on a bfloat16 autocast one's


@pytest.fixture(params=["whole", "shared"])
def slack(request, monkeypatch) -> Slack:
    """Prompt passes keep G copies of the prompts' keys ("whole") or one per prompt ("shared";
    SHARE_BYTES 0 here, by default only caches past 2 MiB a layer). Returns the factors on the
    tolerances against the HF path: the shared path's split softmax rounds the outputs of its two
    halves apart before merging them, another rounding than HF's one attention call (up to 1.1x the
    whole path's float32 tolerance and 2.5x its bfloat16 one in these tests; exact in float64:
    test_a_shared_prompt_gives_the_hf_logits_in_float64)."""
    shared = request.param == "shared"
    monkeypatch.setattr("grpokit.rollout.decode.SHARE_BYTES", 0 if shared else 2**62)
    return Slack(2.0, 3.0) if shared else Slack(1.0, 1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_served_family_takes_the_own_path(family):
    model, _ = build(family)
    assert own_decoder_reason(model, capacity=90) is None
    assert isinstance(decoder_for(model, "auto", 90), OwnDecoder)
    assert isinstance(decoder_for(model, "hf", 90), HFDecoder)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_steps_give_hf_logits(family, slack):
    model, tok = build(family)
    ids, mask = encode_prompts(tok, PROMPTS)
    with torch.no_grad():
        follow_hf(OwnDecoder(model), HFDecoder(model), ids, mask, steps=6, atol=1e-5 * slack.f32)


def follow_hf(own, hf, ids, mask, steps: int, atol: float) -> None:
    """Prefill G = 3 rows per prompt on both decoders, then ``steps`` greedy steps on HF's tokens,
    rows leaving the batch half-way: the logits agree to ``atol`` at every step (float32)."""
    own_logits, own_state = own.prefill(ids, mask, 3, ids.shape[1] + steps)
    hf_logits, hf_state = hf.prefill(ids, mask, 3, ids.shape[1] + steps)
    for t in range(steps + 1):
        assert own_logits.dtype == torch.float32
        torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=atol)
        if t == steps:
            return
        nxt = hf_logits.argmax(-1)
        if t == steps // 2:  # rows leave the batch mid-way
            keep = torch.tensor([0, 2, 3, 5, 7, 8, 11])
            own.select(own_state, keep)
            hf.select(hf_state, keep)
            nxt = nxt[keep]
        own_logits, hf_logits = own.step(nxt, own_state), hf.step(nxt, hf_state)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_prompt_gives_the_hf_logits_in_float64(family, monkeypatch):
    """Each prompt's keys held once, its rows' queries attending to them together and merged with
    each row's own tokens by log-sum-exps, is the softmax over the whole row: in float64 the logits
    are HF's to 1e-10 through steps, rows leaving (all of two prompts' rows among them: those
    prompts' keys are dropped) and a right-padded chunk."""
    monkeypatch.setattr("grpokit.rollout.decode.SHARE_BYTES", 0)
    model, tok = build(family)
    model = model.double()
    ids, mask = encode_prompts(tok, PROMPTS)
    P, L, G, new = len(PROMPTS), ids.shape[1], 3, 10
    own, hf = OwnDecoder(model), HFDecoder(model)
    with torch.no_grad():
        own_logits, state = own.prefill(ids, mask, G, L + new)
        hf_logits, hf_state = hf.prefill(ids, mask, G, L + new)
        prefix = state.prefix
        assert prefix is not None and prefix.slots is None and prefix.bias is not None  # padded prompts
        assert prefix.keys[0].shape == (P, own.K, L, own.D)
        assert state.keys[0].shape == (P * G, own.K, new, own.D)  # the rows' own cache: new positions only

        def step(keep=None, chunk=None):
            nonlocal own_logits, hf_logits
            torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=1e-10)
            nxt = hf_logits.argmax(-1)
            if keep is not None:
                keep = torch.tensor(keep)
                own.select(state, keep), hf.select(hf_state, keep)
                nxt = nxt[keep]
            if chunk is None:
                own_logits, hf_logits = own.step(nxt, state), hf.step(nxt, hf_state)
            else:
                real_bw = torch.arange(3)[None] < torch.tensor(chunk)[:, None]
                ids_bw = torch.stack([nxt, torch.full_like(nxt, 5), torch.full_like(nxt, 6)], dim=1)
                own_logits, hf_logits = own.feed(ids_bw, real_bw, state), hf.feed(ids_bw, real_bw, hf_state)

        step(), step()
        step(keep=[0, 2, 3, 5, 8, 10, 11])  # every prompt keeps a row: the same prefix, rows in slots
        assert state.prefix.keys[0].shape[0] == P and state.prefix.slots.tolist() == [0, 2, 3, 5, 8, 10, 11]
        step(keep=[0, 1, 5, 6])  # the rows of prompts 0 and 3 (slots 0, 2 and 10, 11)
        assert state.prefix.keys[0].shape[0] == 2 and state.prefix.slots.tolist() == [0, 2, 4, 5]
        step(chunk=[3, 1, 2, 3])
        step(keep=[2, 3])  # prompt 3's rows alone: one prompt, slots 1 and 2 of its G
        assert state.prefix.keys[0].shape[0] == 1 and state.prefix.slots.tolist() == [1, 2]
        step()
        torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=1e-10)


def test_prompts_are_shared_when_their_keys_take_enough_memory(monkeypatch):
    """By default (SHARE_BYTES) short prompts keep G copies; one row per prompt never shares."""
    model, tok = build("llama")
    ids, mask = encode_prompts(tok, PROMPTS)
    own = OwnDecoder(model)
    with torch.no_grad():
        assert own.prefill(ids, mask, 4, ids.shape[1] + 2)[1].prefix is None  # 23 KiB a layer here
        # 4 prompts x 4 rows x 2 kv heads x L x 8 dims x (keys, values) x 4 bytes
        monkeypatch.setattr("grpokit.rollout.decode.SHARE_BYTES", 4 * 4 * 2 * ids.shape[1] * 8 * 2 * 4)
        assert own.prefill(ids, mask, 4, ids.shape[1] + 2)[1].prefix is not None
        assert own.prefill(ids, mask, 3, ids.shape[1] + 2)[1].prefix is None  # 3/4 of it
        monkeypatch.setattr("grpokit.rollout.decode.SHARE_BYTES", 0)
        assert own.prefill(ids, mask, 1, ids.shape[1] + 2)[1].prefix is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_without_padding_steps_skip_the_mask_and_give_the_same_logits(family, slack):
    """Prompts of one length leave no key masked: a step's attention runs without the bias, with the
    values it gives with the all-zero bias, until a chunk's padding masks a slot."""
    model, tok = build(family)
    ids, mask = encode_prompts(tok, ["12+34=", "7*8-1=", "sort:9"])
    assert bool(mask.all())
    own, hf = OwnDecoder(model), HFDecoder(model)
    with torch.no_grad():
        _, state = own.prefill(ids, mask, 2, ids.shape[1] + 8)
        hf_logits, hf_state = hf.prefill(ids, mask, 2, ids.shape[1] + 8)
        _, biased = own.prefill(ids, mask, 2, ids.shape[1] + 8)
        biased.padded = True  # the same cache, attention given the (all-zero) bias
        assert not state.padded
        for _ in range(3):
            nxt = hf_logits.argmax(-1)
            logits = own.step(nxt, state).clone()
            assert torch.equal(logits, own.step(nxt, biased))
            hf_logits = hf.step(nxt, hf_state)
            torch.testing.assert_close(logits, hf_logits, rtol=0, atol=1e-5 * slack.f32)
        real_bw = torch.tensor([[True, True]] * 5 + [[True, False]])
        chunk = torch.stack([hf_logits.argmax(-1), torch.full((6,), 5)], dim=1)
        logits, hf_logits = own.feed(chunk, real_bw, state), hf.feed(chunk, real_bw, hf_state)
        assert state.padded  # the last row's padding slot is masked from now on
        nxt = hf_logits.argmax(-1)
        own_logits, hf_logits = own.step(nxt, state), hf.step(nxt, hf_state)
        torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=1e-5 * slack.f32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=0),
        SamplingParams(max_new_tokens=24, temperature=1.0),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=10, top_p=0.9),
    ],
    ids=["greedy", "sampled", "top-k-top-p"],
)
def test_own_path_samples_the_hf_tokens(family, params, slack):
    model, tok = build(family)
    runs = {
        mode: sample(model, tok, PROMPTS, 4, replace(params, decode=mode), torch.Generator().manual_seed(7))
        for mode in ("hf", "auto")
    }  # fmt: skip
    hf, own = runs["hf"], runs["auto"]
    assert torch.equal(own.completion_ids, hf.completion_ids)
    assert torch.equal(own.completion_mask, hf.completion_mask)
    assert torch.equal(own.truncated, hf.truncated)
    torch.testing.assert_close(own.sampler_logp, hf.sampler_logp, rtol=0, atol=1e-5 * slack.f32)
    if params.temperature > 0:  # rows finished at different steps (EOS): the batch was compacted
        lengths = own.completion_mask.sum(1)
        assert int(lengths.min()) < int(lengths.max())


@pytest.mark.parametrize("decode", ["auto", "hf"])
def test_sampling_leaves_ordinary_tensors_on_the_model_and_in_the_rollout(decode):
    """The sampler runs under inference mode. HF's dynamic rope registers a new ``inv_freq`` once
    the sequence outgrows ``max_position_embeddings``; that buffer, and every tensor of the rollout,
    must be an ordinary tensor afterwards, usable under autograd and updatable in place."""
    tok = char_tokenizer()
    torch.manual_seed(6)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
    config = LlamaConfig(
        **{**SMALL, "max_position_embeddings": 8}, rope_parameters=rope, vocab_size=len(tok),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    before = model.model.rotary_emb.inv_freq
    params = SamplingParams(max_new_tokens=12, temperature=1.0, decode=decode)
    r = sample(model, tok, PROMPTS, 2, params, torch.Generator().manual_seed(0))
    assert model.model.rotary_emb.inv_freq is not before  # the rope did rescale while sampling
    assert not any(b.is_inference() for b in model.buffers())
    model.model.rotary_emb.inv_freq.mul_(1.0)  # in place, outside inference mode (DDP's broadcast)
    fields = [r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated]
    assert not any(t.is_inference() for t in [*fields, r.sampler_logp, r.policy_version])
    ids = torch.cat([r.prompt_ids.repeat_interleave(2, dim=0), r.completion_ids], dim=1)
    logits = model(input_ids=ids).logits[:, -r.completion_ids.shape[1] - 1 : -1]
    new_logp = logits.log_softmax(-1).gather(-1, r.completion_ids[..., None]).squeeze(-1)
    (torch.exp(new_logp - r.sampler_logp) * r.completion_mask).sum().backward()  # pi_old in a ratio


def test_the_shipped_model_samples_the_same_on_both_paths():
    from grpokit.models.loading import load_model

    model, tok = load_model("tiny")
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    prompts = ["sort:381927=", "sort:55=", "sort:918273="]
    hf = sample(model, tok, prompts, 16, replace(params, decode="hf"), torch.Generator().manual_seed(3))
    own = sample(model, tok, prompts, 16, params, torch.Generator().manual_seed(3))
    assert own.completions == hf.completions
    torch.testing.assert_close(own.sampler_logp, hf.sampler_logp, rtol=0, atol=1e-5)


def test_under_bfloat16_autocast_the_own_path_follows_hf(slack):
    # same operations in the same dtypes (RMSNorm in float32, float32 head); SDPA's bfloat16
    # accumulation may differ between its decode layouts, so compare logits to bfloat16 precision
    model, tok = build("qwen2")
    keep_head_float32(model)
    ids, mask = encode_prompts(tok, PROMPTS)
    with torch.no_grad(), mixed_precision("cpu", "bfloat16"):
        own, hf = OwnDecoder(model), HFDecoder(model)  # made under autocast, as sample() does
        own_logits, own_state = own.prefill(ids, mask, 2, ids.shape[1] + 4)
        hf_logits, hf_state = hf.prefill(ids, mask, 2, ids.shape[1] + 4)
        assert own_logits.dtype == hf_logits.dtype == torch.float32
        # the layers' weights cast once, the cache in the dtype attention computes in
        assert own.layers[0].qkv[0][0].dtype == own_state.keys[0].dtype == torch.bfloat16
        for _ in range(4):
            torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=0.05 * slack.bf16)
            nxt = hf_logits.argmax(-1)
            own_logits, hf_logits = own.step(nxt, own_state), hf.step(nxt, hf_state)
        torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=0.05 * slack.bf16)


needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear in this torch")


@needs_onednn
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_projections_packed_for_onednn_give_hf_logits_and_tokens(family, precision, monkeypatch, slack):
    """With every projection and the head packed for oneDNN (PACK_NUMEL 0 here; by default only
    weights of 2^17 entries or more), logits follow HF's to float32 rounding (bfloat16's under
    autocast) and the sampler draws HF's tokens."""
    monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    model, tok = build(family)
    torch.manual_seed(0)
    with torch.no_grad():  # HF starts biases at 0, which would hide a bias the packed path dropped
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.3)
    keep_head_float32(model)
    ids, mask = encode_prompts(tok, PROMPTS)
    bf16 = precision == "bfloat16"
    ctx, atol = (mixed_precision("cpu", "bfloat16"), 0.05) if bf16 else (contextlib.nullcontext(), 1e-5)
    if bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 oneDNN kernels")
    with torch.no_grad(), ctx:
        own, hf = OwnDecoder(model), HFDecoder(model)
        layer = own.layers[0]
        for linear in (*layer.qkv, layer.o, *layer.gate_up, layer.down):
            assert isinstance(linear, Packed) and linear.dtype == (torch.bfloat16 if bf16 else torch.float32)
        follow_hf(own, hf, ids, mask, steps=5, atol=atol * (slack.bf16 if bf16 else slack.f32))
        assert isinstance(own._head, Packed) and own._head.dtype == torch.float32  # the head stays float32
    if bf16:
        return
    sample_as_hf(model, tok, SamplingParams(max_new_tokens=24, temperature=1.0), 1e-5 * slack.f32)


def sample_as_hf(model, tok, params: SamplingParams, atol: float = 1e-5):
    """The HF and the own path's rollouts of the same seed: the same tokens, log-probs to ``atol``."""
    runs = {
        mode: sample(model, tok, PROMPTS, 4, replace(params, decode=mode), torch.Generator().manual_seed(7))
        for mode in ("hf", "auto")
    }  # fmt: skip
    assert torch.equal(runs["auto"].completion_ids, runs["hf"].completion_ids)
    torch.testing.assert_close(runs["auto"].sampler_logp, runs["hf"].sampler_logp, rtol=0, atol=atol)
    return runs


def packed(own: OwnDecoder) -> list[bool]:
    """Whether each of the own decoder's layer projections (a LoRA layer's base) is packed for oneDNN."""
    projections = [x for y in own.layers for x in (*y.qkv, y.o, *y.gate_up, y.down)]
    return [isinstance(x.base if isinstance(x, Lora) else x, Packed) for x in projections]


@needs_onednn
def test_only_large_projections_on_a_cpu_are_packed(monkeypatch):
    from grpokit.models.loading import load_model

    tiny, _ = load_model("tiny")  # 8,192 .. 24,576-entry weights: F.linear's fewer microseconds win
    assert not any(packed(OwnDecoder(tiny)))
    tok = char_tokenizer()
    config = {**SMALL, "hidden_size": 384, "intermediate_size": 384, "head_dim": 96}
    wide = LlamaForCausalLM(LlamaConfig(**config, vocab_size=len(tok))).eval()  # 147,456-entry o / down
    assert all(packed(OwnDecoder(wide)))
    monkeypatch.setattr("grpokit.rollout.decode.FUSE_BYTES", 0)  # as past it: fused only when packed
    assert [len(x.qkv) for x in OwnDecoder(wide).layers] == [1, 1] and all(packed(OwnDecoder(wide)))
    assert [len(x.qkv) for x in OwnDecoder(wide, reorder=False).layers] == [3, 3]
    lora, _ = lora_model("llama")  # LoRA's bases as plain layers: small, so F.linear's
    assert not any(packed(OwnDecoder(lora)))
    monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    assert all(packed(OwnDecoder(lora))) and not any(packed(OwnDecoder(lora, reorder=False)))


@pytest.mark.parametrize("case", ["own", "own-unfused-frozen", "own-packed", "own-lora", "hf"])
def test_under_autocast_a_sampler_call_casts_each_weight_once(case, monkeypatch):
    """Autocast keeps its casts of the weights for the rest of its context, but not under inference
    mode, and never for tensors that are not trainable leaves (the own path's fused copies, frozen
    weights): then every linear casts its weight again at every step (two fifths of a bfloat16
    SmolLM2 call). Under LoRA the frozen base weights are cast once per call (the HF path with
    peft's modules casts them at every step: 140 casts for this model's 43 linears)."""
    model, tok = lora_model("qwen2") if case == "own-lora" else build("qwen2")
    keep_head_float32(model)  # as the trainer does under autocast: the head is never cast
    decode = "hf" if case == "hf" else "auto"
    if case == "own-unfused-frozen":
        monkeypatch.setattr("grpokit.rollout.decode.FUSE_BYTES", 0)
        model.requires_grad_(False)
    if case == "own-packed":  # packed copies are made in bfloat16 once per call
        monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    weight_shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    weight_shapes |= {(64, 32), (128, 32)}  # the own path's fused q/k/v and gate/up
    params = SamplingParams(max_new_tokens=8, temperature=0, decode=decode)  # 3 rows per prompt: 12
    with torch.profiler.profile(record_shapes=True) as prof, mixed_precision("cpu", "bfloat16"):
        r = sample(model, tok, PROMPTS, 3, params)
    assert int(r.completion_mask.sum(1).max()) == 8  # 8 steps (greedy: no row ends early here)
    casts = [
        e for e in prof.events()
        if e.name == "aten::_to_copy" and e.input_shapes and tuple(e.input_shapes[0]) in weight_shapes
    ]  # fmt: skip
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert 0 < len(casts) <= linears


@pytest.mark.parametrize(
    "case",
    [
        "own-frozen", pytest.param("own-packed", marks=needs_onednn), "own-lora",
        pytest.param("own-lora-packed", marks=needs_onednn), "own", "own-hooked-head", "hf",
    ],
)  # fmt: skip
def test_under_autocast_steps_run_in_inference_mode_when_no_weight_is_left_to_autocast(case, monkeypatch):
    """Autocast keeps its casts of the weights only outside inference mode. A decoder that casts
    no weight itself (every projection its own copy, packed or cast once, LoRA's adapters cast once
    too, and a float32 head) runs its steps in inference mode; one that leaves trainable weights to
    autocast (the own path's unfused small projections, a head called as a module, the HF path)
    keeps no_grad. Inference mode changes no value, leaves ordinary tensors in the rollout, and a
    training pass in the same autocast context afterwards can cast and save the weights."""
    import grpokit.rollout.decode as decode_module

    model, tok = lora_model("qwen2") if "lora" in case else build("qwen2")
    keep_head_float32(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if case == "own-frozen":  # every weight cast once per call (frozen weights are not autocast's)
        model.requires_grad_(False)
    if case in ("own-packed", "own-lora-packed"):  # packed copies in bfloat16, the rest trainable
        monkeypatch.setattr(decode_module, "PACK_NUMEL", 0)
    if case == "own-hooked-head":
        model.requires_grad_(False)
        model.lm_head.register_forward_hook(lambda module, args, out: out)  # the module must be called
    decoder_type = HFDecoder if case == "hf" else OwnDecoder
    real_step, modes = decoder_type.step, []

    def step(self, *args):
        modes.append(torch.is_inference_mode_enabled())
        return real_step(self, *args)

    monkeypatch.setattr(decoder_type, "step", step)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, decode="hf" if case == "hf" else "auto")
    with mixed_precision("cpu", "bfloat16"):
        r = sample(model, tok, PROMPTS, 2, params, torch.Generator().manual_seed(0))
        inference = case in ("own-frozen", "own-packed", "own-lora", "own-lora-packed")
        assert modes and set(modes) == {inference}
        fields = [r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated]
        assert not any(t.is_inference() for t in [*fields, r.sampler_logp, r.policy_version])
        for p in trainable:  # the policy's trainable weights (LoRA: the adapters)
            p.requires_grad_(True)
        ids = torch.cat([r.prompt_ids.repeat_interleave(2, dim=0), r.completion_ids], dim=1)
        logits = model(input_ids=ids).logits[:, -r.completion_ids.shape[1] - 1 : -1]
        new_logp = logits.float().log_softmax(-1).gather(-1, r.completion_ids[..., None]).squeeze(-1)
        (torch.exp(new_logp - r.sampler_logp) * r.completion_mask).sum().backward()
        assert all(p.grad is not None for p in trainable)
        model.zero_grad(set_to_none=True)
        if inference:  # the same values under no_grad: a decoder made to say it casts
            monkeypatch.setattr(decode_module, "_autocast_casts", lambda linear, dtype: True)
            modes.clear()
            again = sample(model, tok, PROMPTS, 2, params, torch.Generator().manual_seed(0))
            assert modes and not any(modes)
            assert torch.equal(again.completion_ids, r.completion_ids)
            assert torch.equal(again.sampler_logp, r.sampler_logp)


def test_models_the_own_path_cannot_serve_say_why():
    tok = char_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    assert "not one of" in own_decoder_reason(gpt2)
    assert isinstance(decoder_for(gpt2, "auto", 10), HFDecoder)
    narrow, _ = build("mistral")
    narrow.config.sliding_window = 16
    assert "sliding-window" in own_decoder_reason(narrow, capacity=40)
    assert own_decoder_reason(narrow, capacity=16) is None
    gelu, _ = build("llama", hidden_act="gelu")
    assert "silu" in own_decoder_reason(gelu)
    with pytest.raises(ValueError, match="'auto' or 'hf'"):
        decoder_for(gelu, "fast", 10)


def lora_model(family: str = "llama", **config):
    """``family``'s test model under peft LoRA on all seven projections, with adapters that change
    the outputs (peft starts B at 0, which would hide a wrong LoRA term)."""
    peft = pytest.importorskip("peft")
    model, tok = build(family)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **config))
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return lora.eval(), tok


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_new_tokens=24, temperature=0), SamplingParams(max_new_tokens=24, temperature=1.0)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_onednn)], ids=["plain", "packed"])
def test_lora_models_take_the_own_path_and_sample_the_hf_tokens(family, params, pack, monkeypatch, slack):
    # the own path runs peft's vanilla LoRA term itself: x W^T + b + s * (x A^T) B^T
    if pack:
        monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    model, tok = lora_model(family)
    assert own_decoder_reason(model, 90) is None and isinstance(decoder_for(model, "auto", 90), OwnDecoder)
    runs = sample_as_hf(model, tok, params, 1e-5 * slack.f32)
    with model.disable_adapter():  # the adapters matter: without them the tokens differ
        base = sample(model, tok, PROMPTS, 4, replace(params, decode="hf"), torch.Generator().manual_seed(7))
    assert not torch.equal(base.completion_ids, runs["hf"].completion_ids)


def greedy_steps(own, hf, ids, mask, atol: float, dtype: torch.dtype | None = None) -> None:
    """Prefill 2 rows per prompt on both decoders, then 4 greedy steps on HF's tokens: the logits
    agree to ``atol`` (compared in float32) at each, and are in ``dtype`` on both when it is given."""
    own_logits, own_state = own.prefill(ids, mask, 2, ids.shape[1] + 4)
    hf_logits, hf_state = hf.prefill(ids, mask, 2, ids.shape[1] + 4)
    for _ in range(4):
        if dtype is not None:
            assert own_logits.dtype == hf_logits.dtype == dtype
        torch.testing.assert_close(own_logits.float(), hf_logits.float(), rtol=0, atol=atol)
        nxt = hf_logits.argmax(-1)
        own_logits, hf_logits = own.step(nxt, own_state), hf.step(nxt, hf_state)


def block_diagonal(B: torch.Tensor, blocks: list[tuple[int, int]]) -> bool:
    """Whether ``B``'s non-zeros are exactly the (rows, rank) blocks given, down its diagonal."""
    return torch.equal(B != 0, torch.block_diag(*(torch.ones(n, r, dtype=torch.bool) for n, r in blocks)))


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        pytest.param("packed", marks=needs_onednn),
        pytest.param("packed-scalings", marks=needs_onednn),
    ],
)
def test_lora_logits_follow_hf_step_by_step_and_under_autocast(case, monkeypatch, slack):
    """Packed (PACK_NUMEL 0 here), a layer's q/k/v and gate/up bases are one product each, and their
    adapters one stacked A and block-diagonal B (or, when their scalings differ, each adapter on its
    own columns); unpacked, each projection runs alone."""
    pack = case != "plain"
    model, tok = lora_model(
        "qwen2", **({"alpha_pattern": {"q_proj": 16}} if case == "packed-scalings" else {})
    )
    with torch.no_grad():  # (HF's zero biases would hide a dropped or misplaced bias)
        for name, p in model.named_parameters():
            if "base_layer.bias" in name:
                p.normal_(0, 0.3)
    if pack:
        monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    ids, mask = encode_prompts(tok, PROMPTS)
    for ctx, atol in (
        (contextlib.nullcontext(), 1e-5 * slack.f32),
        (mixed_precision("cpu", "bfloat16"), 0.05 * slack.bf16),
    ):
        with torch.no_grad(), ctx:
            own, hf = OwnDecoder(model), HFDecoder(model)
            layer = own.layers[0]
            assert [len(layer.qkv), len(layer.gate_up)] == ([1, 1] if pack else [3, 2])
            if case == "packed":  # (r = 4; q, k, v give 32, 16, 16 columns)
                ((A, B, _, start, stop),) = layer.qkv[0].adapters
                assert A.shape == (12, 32) and (start, stop) == (0, 64)
                assert block_diagonal(B, [(32, 4), (16, 4), (16, 4)])
            if case == "packed-scalings":
                assert [a[3:] for a in layer.qkv[0].adapters] == [(0, 32), (32, 48), (48, 64)]
                assert len(layer.gate_up[0].adapters) == 1  # gate and up share theirs: stacked
            assert all(packed(own)) == pack
            greedy_steps(own, hf, ids, mask, atol)


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_onednn)], ids=["plain", "packed"])
def test_lora_on_some_projections_over_bfloat16_weights_follows_hf(pack, monkeypatch, slack):
    """peft keeps LoRA adapters in float32 over bfloat16 weights and casts each sum back to the base
    output's dtype: the own path does too (it had kept the float32 sum, which the next plain
    projection refused). Packed (PACK_NUMEL 0 here), q/k/v and gate/up are one product each with
    LoRA on some of them."""
    peft = pytest.importorskip("peft")
    if pack:
        monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            pytest.skip("this CPU has no bfloat16 oneDNN kernels")
    model, tok = build("qwen2")
    targets = ["q_proj", "v_proj", "gate_proj"]
    model = peft.get_peft_model(model.to(torch.bfloat16), peft.LoraConfig(r=4, target_modules=targets)).eval()
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "bias" in name:  # (zeros would hide a dropped term)
                p.normal_(0, 0.3)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.lora_A["default"].weight.dtype == torch.float32
    own, hf = OwnDecoder(model), HFDecoder(model)
    layer = own.layers[0]
    if pack:
        assert [type(x) for x in (*layer.qkv, *layer.gate_up)] == [Lora, Lora]
        ((_, B, _, start, stop),) = layer.qkv[0].adapters
        assert (start, stop) == (0, 64) and block_diagonal(B, [(32, 4), (16, 0), (16, 4)])  # q, v; no k
        assert [a[3:] for a in layer.gate_up[0].adapters] == [(0, 64)]  # gate alone: its own columns
    else:
        assert [type(x) for x in layer.qkv] == [Lora, tuple, Lora] and len(layer.gate_up) == 2
    ids, mask = encode_prompts(tok, PROMPTS)
    with torch.no_grad():
        greedy_steps(own, hf, ids, mask, 0.05 * slack.bf16, dtype=torch.bfloat16)


def test_lora_variants_the_own_path_does_not_run_take_the_hf_path():
    dora, _ = lora_model(use_dora=True)
    assert "not vanilla LoRA" in own_decoder_reason(dora)
    assert isinstance(decoder_for(dora, "auto", 90), HFDecoder)
    merged, _ = lora_model()
    merged.merge_adapter()
    assert "merged" in own_decoder_reason(merged)
    peft = pytest.importorskip("peft")
    on_head = peft.get_peft_model(
        build("llama")[0], peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"])
    )
    assert "output head" in own_decoder_reason(on_head)


def test_the_cache_is_never_grown():
    model, tok = build("llama")
    ids, mask = encode_prompts(tok, PROMPTS)
    own = OwnDecoder(model)
    with torch.no_grad():
        logits, state = own.prefill(ids, mask, 2, ids.shape[1] + 3)
        buffers = [k.data_ptr() for k in state.keys]
        for _ in range(3):
            logits = own.step(logits.argmax(-1), state)
        assert [k.data_ptr() for k in state.keys] == buffers  # written in place
        with pytest.raises(ValueError, match="does not fit"):
            own.step(logits.argmax(-1), state)


def test_rows_leaving_move_to_the_front_of_the_same_buffers(slack):
    """``select`` keeps the chosen rows' filled slots, in the given order, in the buffers it had
    (no fresh allocation per drop), and a later step still gives the HF logits."""
    model, tok = build("llama")
    ids, mask = encode_prompts(tok, PROMPTS)
    own, hf = OwnDecoder(model), HFDecoder(model)
    with torch.no_grad():
        _, state = own.prefill(ids, mask, 3, ids.shape[1] + 6)
        hf_logits, hf_state = hf.prefill(ids, mask, 3, ids.shape[1] + 6)
        nxt = hf_logits.argmax(-1)
        own.step(nxt, state), hf.step(nxt, hf_state)
        n = state.length
        before = [t[:, :, :n].clone() for t in (*state.keys, *state.values)]
        bias, buffers = state.key_bias[:, :n].clone(), [k.data_ptr() for k in state.keys]
        keep = torch.tensor([1, 4, 5, 9, 11])
        own.select(state, keep)
        hf.select(hf_state, keep)
        for old, new in zip(before, (*state.keys, *state.values), strict=True):
            assert torch.equal(new[:, :, :n], old[keep])
        assert torch.equal(state.key_bias[:, :n], bias[keep]) and not state.key_bias[:, n:].any()
        assert [k.data_ptr() for k in state.keys] == buffers
        nxt = torch.tensor([5, 6, 7, 8, 9])
        own_logits, hf_logits = own.step(nxt, state), hf.step(nxt, hf_state)
        torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=1e-5 * slack.f32)


@pytest.mark.parametrize(
    "decode,reorder,share", [("auto", True, True), ("auto", False, False), ("hf", True, True)]
)
def test_the_trainer_samples_on_the_path_rollout_decode_names(
    tmp_path, tiny_dir, monkeypatch, decode, reorder, share
):
    import grpokit.rollout.sampler as sampler_module
    from grpokit.config import load_config
    from grpokit.train.trainer import GRPOTrainer
    from tests.helpers import varied

    used = []

    def spy(model, mode, capacity, reorder_weights, share_prompts):
        decoder = decoder_for(model, mode, capacity, reorder_weights, share_prompts)
        used.append((decoder.name, getattr(decoder, "reorder", None), getattr(decoder, "share", None)))
        return decoder

    monkeypatch.setattr(sampler_module, "decoder_for", spy)
    sets = {
        "model.name_or_path": str(tiny_dir), "train.output_dir": str(tmp_path / "run"),
        "train.quiet": True, "train.max_steps": 1, "train.prompts_per_step": 2, "rollout.group_size": 2,
        "rollout.max_new_tokens": 4, "train.eval_max_prompts": 2, "rollout.decode": decode,
        "rollout.reorder_weights": reorder, "rollout.share_prompts": share,
    }  # fmt: skip
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    GRPOTrainer(cfg, rewards=[varied]).train()
    # training and evaluation
    assert used and set(used) == ({("own", reorder, share)} if decode == "auto" else {("hf", None, None)})


@needs_onednn
def test_reorder_weights_false_packs_nothing(monkeypatch):
    monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    model, tok = build("qwen2")
    ids, mask = encode_prompts(tok, PROMPTS)
    own = OwnDecoder(model, reorder=False)
    assert not any(packed(own))
    with torch.no_grad():
        logits, state = own.prefill(ids, mask, 2, ids.shape[1] + 2)
        own.step(logits.argmax(-1), state)
    assert own._head is not None and not isinstance(own._head, Packed)
    p = SamplingParams(max_new_tokens=8, temperature=1.0)
    runs = [
        sample(model, tok, PROMPTS, 2, replace(p, reorder_weights=r), torch.Generator().manual_seed(1))
        for r in (True, False)
    ]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)


def test_share_prompts_false_keeps_g_copies_and_hfs_values(monkeypatch):
    monkeypatch.setattr("grpokit.rollout.decode.SHARE_BYTES", 0)
    model, tok = build("qwen2")
    ids, mask = encode_prompts(tok, PROMPTS)
    with torch.no_grad():
        assert OwnDecoder(model).prefill(ids, mask, 2, ids.shape[1] + 2)[1].prefix is not None
        assert OwnDecoder(model, share=False).prefill(ids, mask, 2, ids.shape[1] + 2)[1].prefix is None
    p = SamplingParams(max_new_tokens=12, temperature=1.0)
    runs = {
        mode: sample(model, tok, PROMPTS, 3, replace(p, **kw), torch.Generator().manual_seed(2))
        for mode, kw in (("hf", {"decode": "hf"}), ("whole", {"share_prompts": False}), ("shared", {}))
    }  # fmt: skip
    assert torch.equal(runs["whole"].sampler_logp, runs["hf"].sampler_logp)  # the same attention calls
    assert not torch.equal(runs["shared"].sampler_logp, runs["hf"].sampler_logp)  # another rounding
    assert torch.equal(runs["shared"].completion_ids, runs["hf"].completion_ids)


def test_the_trainer_says_once_why_a_model_takes_the_hf_path(tmp_path, capsys):
    from grpokit.config import load_config
    from grpokit.train.trainer import GRPOTrainer
    from tests.helpers import varied

    tok = char_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=64))
    sets = {"train.output_dir": str(tmp_path / "run"), "train.max_steps": 1, "train.quiet": True}
    GRPOTrainer(load_config(None, [f"{k}={v}" for k, v in sets.items()]), model=gpt2, tokenizer=tok,
                rewards=[varied])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("the sampler runs the model's Hugging Face forward: model_type 'gpt2'") == 1


@pytest.mark.parametrize("shape", [(64, 1, 64), (3, 7, 576), (5, 1, 4, 128), (2, 3, 33)])
def test_rms_norm_is_hfs_bit_for_bit(shape):
    """The float32 one-operator path and the autocast path both equal HF's LlamaRMSNorm exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from grpokit.rollout.decode import _rms_norm

    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=g) * 3
    hf = LlamaRMSNorm(shape[-1], eps=1e-6)
    hf.weight.data = torch.randn(shape[-1], generator=g)
    with torch.no_grad():
        assert torch.equal(_rms_norm(x, hf.weight, 1e-6), hf(x))
        xb = x.bfloat16()
        assert torch.equal(_rms_norm(xb, hf.weight.bfloat16(), 1e-6), hf.bfloat16()(xb))


def test_a_hook_on_the_head_is_honoured():
    """The own path's float32 head writes into a reused buffer, unless the head has a hook (or a
    replaced forward): then the module is called, so the hook still shapes what is sampled."""
    model, tok = build("qwen2")
    ids, mask = encode_prompts(tok, PROMPTS)
    own = OwnDecoder(model)
    with torch.no_grad():
        plain, state = own.prefill(ids, mask, 2, ids.shape[1] + 3)
        first = own.step(plain.argmax(-1), state)
        assert own._logits_buf is not None and first.data_ptr() == own._logits_buf.data_ptr()
        handle = model.get_output_embeddings().register_forward_hook(
            lambda m, i, out: out.index_fill(-1, torch.tensor([5]), 1e4)
        )
        try:
            hooked = own.step(first.argmax(-1), state)
        finally:
            handle.remove()
    assert bool((hooked.argmax(-1) == 5).all()) and hooked.data_ptr() != own._logits_buf.data_ptr()


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_of_pending_tokens_give_the_hf_logits_and_the_cache_grows(family, slack):
    # multi-turn episodes feed each row a chunk (its sampled token, then an observation), right-
    # padded; the padding takes cache slots the capacity did not count, so the own cache must grow
    model, tok = build(family)
    ids, mask = encode_prompts(tok, PROMPTS)
    b, most_real = len(PROMPTS) * 2, 1 + 4 + 1 + 1  # the most real tokens a row gets (row 0)
    chunks = [  # (width, real tokens per row), fed in turn; a select of rows between the 2nd and 3rd
        (1, [1] * b), (4, [4, 1, 2, 1, 1, 4, 1, 1]), (1, [1] * b), (3, [1, 3, 1, 3, 1, 1]),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        own, hf = OwnDecoder(model), HFDecoder(model)
        capacity = ids.shape[1] + most_real  # every position, not the padding's slots (1 + 4 + 1 + 3)
        own_logits, own_state = own.prefill(ids, mask, 2, capacity)
        hf_logits, hf_state = hf.prefill(ids, mask, 2, capacity)
        slots = own_state.key_bias.shape[1]
        for n, (w, real) in enumerate(chunks):
            if n == 3:  # two rows leave the batch
                keep = torch.tensor([0, 2, 3, 4, 6, 7])
                own.select(own_state, keep)
                hf.select(hf_state, keep)
                own_logits, hf_logits = own_logits[keep], hf_logits[keep]
            torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=2e-5 * slack.f32)
            first = own_logits.argmax(-1)  # each row's sampled token, then random observation ids
            chunk = torch.randint(3, len(tok), (len(real), w), generator=gen)
            chunk[:, 0] = first
            real_bw = torch.arange(w)[None] < torch.tensor(real)[:, None]
            chunk[~real_bw] = tok.pad_token_id
            own_logits, hf_logits = own.feed(chunk, real_bw, own_state), hf.feed(chunk, real_bw, hf_state)
        torch.testing.assert_close(own_logits, hf_logits, rtol=0, atol=2e-5 * slack.f32)
        assert own_state.key_bias.shape[1] > slots  # the padding outgrew the capacity given up front
        assert int(own_state.positions.max()) <= capacity  # the rotary table's rows suffice


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "lora", pytest.param("lora-packed", marks=needs_onednn)]
)
def test_episodes_sample_the_hf_tokens_on_the_own_path(family, monkeypatch, slack):
    from grpokit.rollout.episodes import sample_episodes
    from tests.rollout.test_episodes import ROWS, Echo

    if family == "lora-packed":  # chunks through packed, fused bases and stacked adapters
        monkeypatch.setattr("grpokit.rollout.decode.PACK_NUMEL", 0)
    model, tok = lora_model("qwen2") if family.startswith("lora") else build(family)
    assert own_decoder_reason(model, 200) is None

    def episodes(mode: str):
        params = SamplingParams(max_new_tokens=10, temperature=1.0, decode=mode)
        generator = torch.Generator().manual_seed(3)
        return sample_episodes(
            model, tok, ROWS, Echo, 4, params, generator, max_turns=3, max_episode_tokens=60
        )

    runs = {mode: episodes(mode) for mode in ("auto", "hf")}
    auto, hf = runs["auto"], runs["hf"]
    assert torch.equal(auto.completion_ids, hf.completion_ids) and torch.equal(auto.model_mask, hf.model_mask)
    torch.testing.assert_close(auto.sampler_logp, hf.sampler_logp, rtol=0, atol=2e-5 * slack.f32)
    assert [e.as_dict() for e in auto.episodes] == [e.as_dict() for e in hf.episodes]
    assert any(e.num_turns > 1 for e in auto.episodes)  # observations were fed as chunks
