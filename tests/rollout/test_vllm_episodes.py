"""Multi-turn episodes on the vLLM engine (against the CPU stand-in for vLLM's offline API): the same
episodes as the built-in sampler where both are deterministic (greedy), every turn's request is the
episode's stream so far as ids, the model's tokens carry vLLM's log-probs, which equal a plain
forward of the whole stream, and an episode does not depend on the sharding."""

from __future__ import annotations

import pytest
import torch

from grpokit.rollout.episodes import sample_episodes
from grpokit.rollout.sampler import SamplingParams
from tests.rollout.test_episodes import ROWS, Echo, stream_ids
from tests.rollout.test_vllm_engine import engine_over


def on_engine(engine, rows=ROWS, G=4, seed=3, temperature=1.0, max_turns=3, budget=200, max_new=12, **kw):
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
    return engine.sample_episodes(
        rows, Echo, G, params, seed, max_turns=max_turns, max_episode_tokens=budget, **kw
    )


@pytest.mark.parametrize(
    ("limits", "reached"),
    [(dict(max_turns=3, budget=200, max_new=12), "max_turns"),
     (dict(max_turns=5, budget=60, max_new=12), "budget"),
     (dict(max_turns=4, budget=200, max_new=3), "turn_length")],
    ids=["turns", "budget", "turn_length"],
)  # fmt: skip
def test_greedy_episodes_equal_the_built_in_samplers(chatml, monkeypatch, limits, reached):
    # greedy decoding is deterministic on both engines, so every recorded field must agree
    model, tok = chatml
    engine = engine_over(model, tok, monkeypatch)
    theirs = on_engine(engine, G=2, temperature=0.0, **limits)
    ours = sample_episodes(
        model, tok, ROWS, Echo, 2, SamplingParams(max_new_tokens=limits["max_new"], temperature=0.0),
        max_turns=limits["max_turns"], max_episode_tokens=limits["budget"],
    )  # fmt: skip
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "model_mask", "truncated"):
        assert torch.equal(getattr(theirs, name), getattr(ours, name)), name
    assert theirs.completions == ours.completions
    assert [e.as_dict() for e in theirs.episodes] == [e.as_dict() for e in ours.episodes]
    assert [e.messages for e in theirs.episodes] == [e.messages for e in ours.episodes]
    m = ours.model_mask
    torch.testing.assert_close(theirs.sampler_logp[m], ours.sampler_logp[m], rtol=0, atol=5e-5)
    assert bool((theirs.sampler_logp[~m] == 0).all())
    stops = {e.stop for e in ours.episodes}
    assert reached in stops, stops  # the limit this case is about was reached


def test_each_turn_sends_the_stream_so_far_as_ids(chatml, monkeypatch):
    model, tok = chatml
    engine = engine_over(model, tok, monkeypatch)
    sent = []
    generate = engine.llm.generate

    def recording(requests, params, use_tqdm=False):
        sent.append([list(r["prompt_token_ids"]) for r in requests])
        return generate(requests, params, use_tqdm)

    engine.llm.generate = recording
    r = on_engine(engine)
    assert any(e.num_turns > 1 for e in r.episodes) and r.trained_mask.sum() < r.completion_mask.sum()
    # turn k of an episode is requested with the prompt plus everything before that turn; the turns
    # of the running episodes go out together, in row order
    for b, e in enumerate(r.episodes):
        stream, pos, k = stream_ids(r, b), len(stream_ids(r, b)) - int(r.completion_mask[b].sum()), 0
        for t in e.turns:
            if t.trained:
                running = [x for x in range(len(r.episodes)) if r.episodes[x].num_turns > k]
                assert sent[k][running.index(b)] == stream[:pos]
                k += 1
            pos += t.num_tokens
    assert len(sent) == max(e.num_turns for e in r.episodes)


def test_model_tokens_carry_vllms_logprobs_equal_to_a_plain_forward(chatml, monkeypatch):
    model, tok = chatml
    r = on_engine(engine_over(model, tok, monkeypatch))
    checked = 0
    for b in range(r.num_rows):
        ids = torch.tensor(stream_ids(r, b))
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0], dim=-1)
        L = len(ids) - int(r.completion_mask[b].sum())
        for t in range(int(r.completion_mask[b].sum())):
            if r.model_mask[b, t]:
                assert abs(float(logp[L + t - 1, ids[L + t]]) - float(r.sampler_logp[b, t])) < 5e-5
                checked += 1
            else:
                assert float(r.sampler_logp[b, t]) == 0.0
    assert checked > 50


def test_an_episode_depends_on_its_seed_and_global_index_only(chatml, monkeypatch):
    model, tok = chatml
    engine = engine_over(model, tok, monkeypatch)
    whole = on_engine(engine)
    again = on_engine(engine)
    assert torch.equal(whole.completion_ids, again.completion_ids)
    assert len({tuple(ids.tolist()) for ids in whole.completion_ids[:4]}) > 1  # a group's G episodes differ
    tail = on_engine(engine, rows=ROWS[1:], first_prompt_index=1)  # another rank's share
    T = tail.completion_ids.shape[1]
    assert torch.equal(tail.completion_ids, whole.completion_ids[4:, :T])
    assert not bool(whole.completion_mask[4:, T:].any())
    other = on_engine(engine, seed=4)
    assert not torch.equal(other.completion_ids, whole.completion_ids)


def test_without_processed_logprobs_hot_episodes_carry_none(chatml, monkeypatch):
    model, tok = chatml
    engine = engine_over(model, tok, monkeypatch)
    engine.processed_logprobs = False  # an older vLLM: only T = 1 untruncated records them
    hot = on_engine(engine, temperature=0.7)
    assert hot.sampler_logp is None and engine.llm.requests[-1][0].logprobs is None
    assert on_engine(engine, temperature=1.0).sampler_logp is not None
