"""Micro-batching: planning, collation, and exact gradient accumulation on a real (tiny) model."""

from __future__ import annotations

import pytest
import torch

from grpokit.algo import LossSpec, group_advantages
from grpokit.models.loading import SharingCosts
from grpokit.rollout.sampler import SamplingParams, sample
from grpokit.train.batch import (
    TrainBatch,
    accumulate_policy_gradient,
    batch_logprobs,
    collate,
    completion_logprobs,
    plan_micro_batches,
)

AGGS = ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]


def test_plan_covers_rows_once_and_respects_caps():
    lengths = [5, 9, 1, 9, 4, 7, 7, 2, 3]
    plan = plan_micro_batches(lengths, max_rows=3, max_tokens=20)
    assert sorted(i for mb in plan for i in mb) == list(range(9))
    for mb in plan:
        assert len(mb) <= 3
        assert len(mb) == 1 or max(lengths[i] for i in mb) * len(mb) <= 20
        assert [lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)
    assert plan[0] == [1, 3]  # the two 9s: a third row would make 27 padded tokens
    assert plan_micro_batches([50, 1], max_rows=4, max_tokens=10) == [[0], [1]]  # oversize row alone


@pytest.fixture()
def batch64(tiny):
    """A sampled, scored batch on the tiny model in float64 (so accumulation is exact to 1e-12)."""
    model, tok = tiny
    model = model.double()
    rollout = sample(
        model,
        tok,
        ["12+34=", "5=", "(1+2)*3="],
        4,
        SamplingParams(max_new_tokens=7, temperature=1.5),
        torch.Generator().manual_seed(3),
    )
    rewards = torch.tensor([float(len(c) % 3) for c in rollout.completions])
    return model, tok, TrainBatch.from_rollout(rollout, group_advantages(rewards, 4))


def test_collate_layout_and_logprobs_match_unpadded_forward(batch64):
    model, tok, batch = batch64
    mb = collate(batch, [0, 5, 9], tok.pad_token_id, torch.device("cpu"))
    logp, _ = completion_logprobs(model, mb, temperature=0.7)
    for j, r in enumerate([0, 5, 9]):
        n = int(batch.completion_mask[r].sum())
        ids = torch.cat([batch.prompt_ids[r], batch.completion_ids[r, :n]])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(batch.prompt_ids[r]) - 1 : -1]
        want = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.completion_ids[r, :n, None]).squeeze(-1)
        torch.testing.assert_close(logp[j, :n].detach(), want, rtol=1e-9, atol=1e-9)


def _grads(model, batch, plan, **kw):
    model.zero_grad(set_to_none=True)
    stats = accumulate_policy_gradient(model, batch, plan, 0, temperature=1.0, **kw)
    return [p.grad.clone() for p in model.parameters()], stats


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_accumulated_gradient_equals_full_batch_gradient(batch64, aggregation, ratio_level):
    model, _, batch = batch64
    B = batch.num_rows
    lengths = batch.total_lengths()
    old = batch_logprobs(model, batch, [list(range(B))], 0, 1.0) - 0.05  # ratios != 1
    ref = old + 0.1
    kw = dict(
        loss=LossSpec(
            beta=0.1,
            clip_low=0.2,
            clip_high=0.28,
            ratio_level=ratio_level,
            aggregation=aggregation,
            max_completion_length=7,
        ),
        old_logp=old,
        ref_logp=ref,
    )
    full, full_stats = _grads(model, batch, [list(range(B))], **kw)
    for max_rows, max_tokens in [(1, None), (3, None), (5, 40)]:
        plan = plan_micro_batches(lengths, max_rows, max_tokens)
        assert len(plan) > 1
        acc, stats = _grads(model, batch, plan, **kw)
        assert stats.loss == pytest.approx(full_stats.loss, rel=1e-10)
        for a, f in zip(acc, full, strict=True):
            torch.testing.assert_close(a, f, rtol=1e-9, atol=1e-12)


def test_first_inner_epoch_ratio_is_one(batch64):
    model, _, batch = batch64
    plan = plan_micro_batches(batch.total_lengths(), 4)
    old = batch_logprobs(model, batch, plan, 0, 1.0)
    _, stats = _grads(model, batch, plan, loss=LossSpec(), old_logp=old)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-12) and stats.ratio_max == pytest.approx(
        1.0, abs=1e-12
    )
    assert stats.clip_fraction == 0.0


@pytest.mark.parametrize("aggregation", AGGS)
def test_log_probs_from_hidden_states_equal_the_logits_path(batch64, aggregation):
    # the same loss and the same gradients (every parameter, the tied head included) in float64
    # whether the head projects full logits or hidden_token_logprobs projects block by block
    from grpokit.models.loading import fused_head_reason

    model, _, batch = batch64
    assert fused_head_reason(model) is None
    B = batch.num_rows
    old = batch_logprobs(model, batch, [list(range(B))], 0, 0.8) - 0.05
    fused_old = batch_logprobs(model, batch, [list(range(B))], 0, 0.8, fused_head=True) - 0.05
    mask = batch.completion_mask
    assert (~mask).any() and torch.allclose(fused_old[mask], old[mask], atol=1e-12)
    assert (fused_old[~mask] == -0.05).all()  # padding is not projected: log-prob 0
    kw = dict(loss=LossSpec(aggregation=aggregation, max_completion_length=7), old_logp=old, temperature=0.8)
    plan = plan_micro_batches(batch.total_lengths(), 3)
    grads, stats = [], []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        stats.append(accumulate_policy_gradient(model, batch, plan, 0, fused_head=fused, **kw))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert stats[1].loss == pytest.approx(stats[0].loss, rel=1e-10) and stats[1].entropy == pytest.approx(
        stats[0].entropy, rel=1e-10
    )
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert "forward" not in model.get_output_embeddings().__dict__  # the head is restored


FUSED_LOSSES = [
    dict(aggregation="seq_mean_token_mean"),
    dict(aggregation="token_mean", beta=0.1, kl_kind="k1"),
    dict(aggregation="seq_mean_token_sum_norm", beta=0.1, kl_kind="k2", max_completion_length=7),
    dict(aggregation="bnpo", beta=0.1, kl_kind="k3"),
    dict(surrogate="clip", clip_high=0.28, delta=1.5, beta=0.05),
    dict(surrogate="cispo", cispo_max_ratio=1.02),
    dict(surrogate="sapo"),
]


@pytest.mark.parametrize("spec", FUSED_LOSSES, ids=lambda d: "-".join(f"{v}" for v in d.values()))
@pytest.mark.parametrize("off_policy", [False, True])
def test_loss_gradient_in_the_head_blocks_equals_the_logits_path(batch64, spec, off_policy, monkeypatch):
    # a token-separable loss takes the head's gradients inside the forward blocks (no block is
    # recomputed in backward): every parameter's gradient equals the full-logits path in float64,
    # with pi_old given (ratios != 1, clips active) or the pass's own, IS weights, several micro-batches
    import grpokit.algo.logprobs as lp

    model, _, batch = batch64
    B, T = batch.completion_ids.shape
    g = torch.Generator().manual_seed(5)
    old = None
    if off_policy:  # ratios spread around 1, beyond both clip bounds
        old = batch_logprobs(model, batch, [list(range(B))], 0, 0.8)
        old = old + 0.3 * torch.randn(old.shape, generator=g, dtype=old.dtype)
    kw = dict(
        loss=LossSpec(**spec), old_logp=old, ref_logp=None if old is None else old + 0.1, temperature=0.8,
        is_weights=torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5 if off_policy else None,
    )  # fmt: skip
    if LossSpec(**spec).beta > 0 and old is None:
        kw["ref_logp"] = batch_logprobs(model, batch, [list(range(B))], 0, 0.8) + 0.1
    plan = plan_micro_batches(batch.total_lengths(), 5)
    assert len(plan) > 1
    model.zero_grad(set_to_none=True)
    want_stats = accumulate_policy_gradient(model, batch, plan, 0, fused_head=False, **kw)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(lp, "_recompute_grads", None)  # the fused path must not recompute
    stats = accumulate_policy_gradient(model, batch, plan, 0, fused_head=True, **kw)
    assert stats.loss == pytest.approx(want_stats.loss, rel=1e-10)
    assert stats.clip_fraction == want_stats.clip_fraction
    if off_policy and spec.get("surrogate", "clip") == "clip":
        assert stats.clip_fraction > 0  # the clip is exercised
    for a, b in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["sequence_ratio", "entropy_top_q"])
def test_losses_that_are_not_token_separable_recompute_the_head_in_backward(batch64, case, monkeypatch):
    # GSPO's ratio couples a completion's tokens and the entropy mask needs every entropy first:
    # the head's gradient then comes from the backward's recompute, one per micro-batch
    import grpokit.algo.logprobs as lp

    model, _, batch = batch64
    B = batch.num_rows
    old = batch_logprobs(model, batch, [list(range(B))], 0, 1.0) - 0.05
    kw = dict(loss=LossSpec(ratio_level="sequence" if case == "sequence_ratio" else "token"), old_logp=old,
              temperature=1.0, entropy_top_q=0.5 if case == "entropy_top_q" else None)  # fmt: skip
    plan = plan_micro_batches(batch.total_lengths(), 5)
    model.zero_grad(set_to_none=True)
    accumulate_policy_gradient(model, batch, plan, 0, fused_head=False, **kw)
    want = [p.grad.clone() for p in model.parameters()]
    calls, real = [], lp._recompute_grads
    monkeypatch.setattr(lp, "_recompute_grads", lambda *a: calls.append(1) or real(*a))
    model.zero_grad(set_to_none=True)
    accumulate_policy_gradient(model, batch, plan, 0, fused_head=True, **kw)
    assert len(calls) == len(plan)
    for a, b in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_models_outside_the_whitelist_keep_the_logits_path():
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpokit.models.loading import fused_head_reason

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16))
    assert "model_type 'gpt2' is not one of" in fused_head_reason(gpt2)


@pytest.fixture()
def uneven64(batch64):
    """batch64 with completions cut to uneven lengths (1-7 tokens): short rows share a bin."""
    model, tok, batch = batch64
    keep = torch.tensor([7, 1, 2, 6, 1, 7, 3, 1, 7, 2, 5, 1])[:, None]
    mask = batch.completion_mask & (torch.arange(batch.completion_ids.shape[1]) < keep)
    return model, tok, TrainBatch(batch.prompt_ids, batch.completion_ids, mask, batch.advantages)


def test_packed_layout_holds_every_sequence_once_without_padding(uneven64):
    _, tok, batch = uneven64
    rows = [0, 5, 9, 2, 7]
    mb = collate(batch, rows, tok.pad_token_id, torch.device("cpu"), packed=True)
    lengths = [len(batch.prompt_ids[r]) + int(batch.context_mask[r].sum()) for r in rows]
    N = max(lengths)
    assert mb.attention_mask is None and mb.input_ids.shape[1] == N
    assert mb.input_ids.shape[0] < len(rows)  # some bins hold several sequences
    starts = (mb.position_ids == 0).sum()
    assert int(starts) >= len(rows)  # every sequence restarts its positions (tails count too)
    flat_ids = mb.input_ids.flatten()
    for j, r in enumerate(rows):
        n = int(batch.context_mask[r].sum())
        # the position that predicts completion token t holds the token before it
        before = torch.cat([batch.prompt_ids[r][-1:], batch.completion_ids[r, : n - 1]])
        assert torch.equal(flat_ids[mb.gather[j, :n]], before)


def _assert_layout_equals_padded(model, batch, aggregation, fused_head, **layout):
    """float64, every parameter: ``layout`` (``packed=True`` or ``share=...``) gives the padded
    plan's log-probs, loss, metrics and gradient, with the whole batch in one micro-batch and split."""
    B = batch.num_rows
    old = batch_logprobs(model, batch, [list(range(B))], 0, 0.9) - 0.05
    layout_old = batch_logprobs(model, batch, [list(range(B))], 0, 0.9, **layout) - 0.05
    mask = batch.completion_mask
    torch.testing.assert_close(layout_old[mask], old[mask], rtol=0, atol=1e-12)
    kw = dict(
        loss=LossSpec(beta=0.1, aggregation=aggregation, max_completion_length=7),
        old_logp=old, ref_logp=old + 0.1, temperature=0.9, fused_head=fused_head,
    )  # fmt: skip
    results = []
    for options, plan in [({}, [list(range(B))]), (layout, plan_micro_batches(batch.total_lengths(), 5)),
                          (layout, [list(range(B))])]:  # fmt: skip
        model.zero_grad(set_to_none=True)
        stats = accumulate_policy_gradient(model, batch, plan, 0, **options, **kw)
        results.append((stats, [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), *others = results
    # every row trained once; the padded plan shares nothing, the one-micro-batch layout all or none
    assert [stats.rows for stats, _ in results] == [B, B, B]
    assert (want.shared_rows, results[2][0].shared_rows) == (0, B if "share" in layout else 0)
    for stats, grads in others:
        assert stats.loss == pytest.approx(want.loss, rel=1e-10)
        assert stats.kl == pytest.approx(want.kl, rel=1e-10)
        assert stats.entropy == pytest.approx(want.entropy, rel=1e-6)  # a float32 metric
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("fused_head", [False, True])
def test_packed_gradients_equal_padded_gradients(uneven64, aggregation, fused_head):
    # the packed micro-batches (sequences end to end, position ids restarting, the model's
    # packed-sequence mask) give the padded plan's loss, metrics and gradient
    from grpokit.models.loading import packing_reason

    model, _, batch = uneven64
    assert packing_reason(model) is None
    _assert_layout_equals_padded(model, batch, aggregation, fused_head, packed=True)


def test_packing_needs_a_family_whose_mask_builder_detects_packed_sequences():
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpokit.models.loading import packing_reason

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2))
    assert "not one of" in packing_reason(gpt2)


ALWAYS_SHARE = SharingCosts(1.0, 0.0)  # (per-token, per-pair) costs under which sharing always pays


def test_shared_layout_holds_each_prompt_once(uneven64):
    from grpokit.train.batch import collate_shared

    _, tok, batch = uneven64
    rows = [0, 5, 9, 2, 7, 3]  # rows 0-3 share one prompt, 5 and 7 another, 9 a third
    mb = collate_shared(batch, rows, tok.pad_token_id, torch.device("cpu"))
    assert mb.input_ids.shape[0] == 3 and mb.attention_mask.shape == (3, 1, 0, 0)  # no kernel takes it
    flat_ids, flat_pos = mb.input_ids.flatten(), mb.position_ids.flatten()
    layout, S = mb.layout, mb.input_ids.shape[1]
    for j, r in enumerate(rows):
        n, P = int(batch.context_mask[r].sum()), len(batch.prompt_ids[r])
        before = torch.cat([batch.prompt_ids[r][-1:], batch.completion_ids[r, : n - 1]])
        assert torch.equal(flat_ids[mb.gather[j, :n]], before)  # the position that predicts token t
        assert flat_pos[mb.gather[j, :n]].tolist() == list(range(P - 1, P - 1 + n))  # as if alone
        # row j's completion tokens are its layout row; token t sees the prompt and its first t + 1
        assert torch.equal(flat_ids[layout.row_index[j, :n]], batch.completion_ids[r, :n])
        for t in range(n):
            seen = layout.key_index[j][layout.row_mask[j, 0, t]]
            context = torch.cat([batch.prompt_ids[r], batch.completion_ids[r, : t + 1]])
            assert torch.equal(flat_ids[seen], context)
        g = int(mb.gather[j, 0]) // S
        # the prompt's own tokens attend causally within it, once per group
        prompt = layout.prompt_index[g][: len(batch.prompt_ids[r])]
        assert torch.equal(flat_ids[prompt], batch.prompt_ids[r])
    # every position's output comes from exactly one computed query (padding: the zero row)
    computed = torch.cat([layout.prompt_index.flatten(), layout.row_index.flatten()])
    zero = len(computed)
    real = layout.inverse != zero
    assert torch.equal(computed[layout.inverse[real]], torch.arange(len(flat_ids))[real])
    assert int(real.sum()) == sum(len(batch.prompt_ids[rows[m[0]]]) for m in [[0, 3, 5], [1, 4], [2]]) + int(
        batch.context_mask[rows].sum()
    )


def rms_norm_in_its_dtype(self, x):
    """An HF RMSNorm's forward in the input's dtype (HF's computes in float32 even for float64)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


@pytest.fixture()
def float64_norms(monkeypatch):
    """HF's LlamaRMSNorm computes in float32 even for a float64 model; sharing sums a prompt's
    gradient over its rows inside the model, padding outside, so float32 rounding (~1e-7) would
    hide a real difference. In float64 throughout, the two must agree to 1e-9."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_its_dtype)


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("fused_head", [False, True])
def test_shared_prompt_gradients_equal_padded_gradients(uneven64, aggregation, fused_head, float64_norms):
    # one sequence per prompt (attending by layout) gives the padded plan's log-probs, loss, metrics and
    # gradient, whether a micro-batch holds whole groups or splits them
    model, _, batch = uneven64
    _assert_layout_equals_padded(model, batch, aggregation, fused_head, share=ALWAYS_SHARE)


def test_sharing_pays_unless_nothing_is_shared_or_uneven_groups_pad_more_than_it_saves():
    from grpokit.train.batch import sharing_pays

    def rows_of(prompt_len, completion_len, prompts=(0,) * 8):
        G = len(prompts)
        comp = torch.ones(G, completion_len, dtype=torch.long)
        mask = torch.ones(G, completion_len, dtype=torch.bool)
        return TrainBatch([torch.arange(prompt_len) + p for p in prompts], comp, mask, torch.zeros(G))

    costs = SharingCosts(2 * 105e6, 4 * 576 * 30)  # SmolLM2-135M: per token, per attended pair
    assert sharing_pays(rows_of(100, 96), list(range(8)), costs)  # its recipe
    # long completions too: each row attends to its prompt and itself, not to the other rows
    assert sharing_pays(rows_of(100, 4096), list(range(8)), costs)
    assert not sharing_pays(rows_of(100, 96, prompts=(0,)), [0], costs)  # nothing to share
    # one prompt's 4 rows set the sequence length that the other 4 prompts' single rows pad to
    assert not sharing_pays(rows_of(100, 4096, prompts=(0, 0, 0, 0, 1, 2, 3, 4)), list(range(8)), costs)


def test_prompt_sharing_needs_sdpa_and_knows_the_sliding_window(tiny):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from grpokit.models.loading import prompt_sharing_costs, prompt_sharing_reason

    model, _ = tiny
    assert prompt_sharing_reason(model) is None
    token_cost, pair_cost, window = prompt_sharing_costs(model)
    c = model.config
    assert token_cost == 2 * sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    assert pair_cost == 4 * c.hidden_size * c.num_hidden_layers and window is None
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=50)  # fmt: skip
    eager = MistralForCausalLM(MistralConfig(**small, sliding_window=None, attn_implementation="eager"))
    assert "not 'sdpa'" in prompt_sharing_reason(eager)
    sliding = MistralForCausalLM(MistralConfig(**small, sliding_window=16))
    assert prompt_sharing_reason(sliding) is None and prompt_sharing_costs(sliding).window == 16
    assert (
        prompt_sharing_costs(MistralForCausalLM(MistralConfig(**small, sliding_window=None))).window is None
    )
    off = Qwen2ForCausalLM(Qwen2Config(**small, sliding_window=16, use_sliding_window=False))
    assert prompt_sharing_costs(off).window is None  # Qwen2's default: the window is not used


@pytest.mark.parametrize("below_longest", [0, 3])  # the window: the longest row, or 3 shorter
def test_sliding_window_models_share_the_micro_batches_inside_their_window(
    uneven64, monkeypatch, below_longest
):
    # the shared attention skips the sliding window's cut, which changes nothing while a row fits in the
    # window (float64: the padded plan exactly); a micro-batch with a longer row stays padded
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.models.mistral import modeling_mistral

    from grpokit.models.loading import prompt_sharing_costs, prompt_sharing_reason

    # float64 throughout, as float64_norms does for Llama
    monkeypatch.setattr(modeling_mistral.MistralRMSNorm, "forward", rms_norm_in_its_dtype)
    _, tok, batch = uneven64
    contexts = batch.context_mask.sum(dim=1).tolist()
    row_lengths = [len(p) + n for p, n in zip(batch.prompt_ids, contexts, strict=True)]
    window = max(row_lengths) - below_longest
    fits = below_longest == 0
    assert min(row_lengths) <= window - 3  # short rows fit even the smallest window
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window)  # fmt: skip
    model = MistralForCausalLM(config).double()
    assert prompt_sharing_reason(model) is None and prompt_sharing_costs(model).window == window
    always = SharingCosts(1.0, 0.0, window)
    B, cpu = batch.num_rows, torch.device("cpu")
    assert collate(batch, list(range(B)), 0, cpu, share=always).shared is fits
    if fits:
        _assert_layout_equals_padded(model, batch, "token_mean", True, share=always)
        return
    # the groups (prompts) with a row past the window in one micro-batch, the others in another
    past = {tuple(batch.prompt_ids[r].tolist()) for r in range(B) if row_lengths[r] > window}
    cut = [r for r in range(B) if tuple(batch.prompt_ids[r].tolist()) in past]
    plan = [[r for r in range(B) if r not in cut], cut]
    assert [collate(batch, mb, 0, cpu, share=always).shared for mb in plan] == [True, False]
    padded = batch_logprobs(model, batch, plan, 0, 0.9)
    mixed = batch_logprobs(model, batch, plan, 0, 0.9, share=always)
    mask = batch.completion_mask
    torch.testing.assert_close(mixed[mask], padded[mask], rtol=0, atol=1e-12)
    # sharing the groups past the window would be wrong
    assert collate(batch, cut, 0, cpu, share=SharingCosts(1.0, 0.0)).shared
    unguarded = batch_logprobs(model, batch, plan, 0, 0.9, share=SharingCosts(1.0, 0.0))
    assert (unguarded[mask] - padded[mask]).abs().max() > 1e-6


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_shared_prompt_gradients_equal_padded_gradients_on_qwen(uneven64, monkeypatch, family):
    # the other families' attention calls the shared attention too: Qwen2's q/k/v biases, Qwen3's
    # q/k norms before the rotary, 3 query heads per key head
    import importlib

    import transformers

    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    # float64 throughout, as float64_norms does for Llama
    monkeypatch.setattr(getattr(modeling, f"{name}RMSNorm"), "forward", rms_norm_in_its_dtype)
    _, tok, batch = uneven64
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model = getattr(transformers, f"{name}ForCausalLM")(config).double()
    if family == "qwen2":  # biases are zero at initialisation: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    _assert_layout_equals_padded(model, batch, "token_mean", True, share=SharingCosts(1.0, 0.0))


def test_group_plan_keeps_each_prompts_rows_together():
    from grpokit.train.batch import plan_groups, plan_optimizer_steps

    lengths = [5, 9, 1, 9, 4, 7, 7, 2, 3, 8, 8, 8]  # 4 groups of 3
    plan = plan_groups(lengths, 3, max_rows=6)
    assert sorted(i for mb in plan for i in mb) == list(range(12))
    assert all(len(mb) <= 6 for mb in plan)
    assert all(len({i // 3 for i in mb}) * 3 == len(mb) for mb in plan)  # whole groups only
    assert plan[0][:3] == [1, 0, 2]  # the group with the longest row first, its rows longest first
    small = plan_groups(lengths, 3, max_rows=2)  # a group larger than a micro-batch is cut
    assert all(len(mb) <= 2 for mb in small)
    for g in range(4):  # each group in ceil(3 / 2) = 2 micro-batches
        assert sum(any(i // 3 == g for i in mb) for mb in small) == 2
    capped = plan_groups(lengths, 3, max_rows=12, max_tokens=30)
    assert all(max(lengths[i] for i in mb) * len(mb) <= 30 or len(mb) <= 3 for mb in capped)
    steps = plan_optimizer_steps(lengths, 3, 2, 6, keep_groups=True)
    assert [sorted(i for mb in p for i in mb) for p in steps] == [list(range(6)), list(range(6, 12))]
