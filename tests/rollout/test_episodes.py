"""Multi-turn episodes are token-exact: the stream is the chat template of the final conversation, the
model's tokens are the sampled ones with the sampler's log-probs equal to a plain forward of the whole
stream (the KV cache kept across turns, chunks padded inside), environment tokens are masked, and the
limits hold."""

from __future__ import annotations

import pytest
import torch

from grpokit.envs import Environment, StepResult
from grpokit.envs.render import PlainFormat, TemplateFormat
from grpokit.rollout.decode import OwnDecoder
from grpokit.rollout.episodes import sample_episodes
from grpokit.rollout.sampler import SamplingParams
from tests.envs.chatml import nudged_model

ROWS = [{"prompt": "12*34="}, {"prompt": "hello there"}, {"prompt": "7"}]


class Echo(Environment):
    """Answers every turn with a tool message (its turn number and the length of the model's text)."""

    stop = ("q",)

    def __init__(self) -> None:
        self.n = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, completion: str) -> StepResult:
        self.n += 1
        return StepResult([{"role": "tool", "content": f"r{self.n} {len(completion)}"}], reward=0.5)


def episodes(model, tok, rows=ROWS, G=4, seed=0, max_turns=3, budget=200, max_new=12, decode="auto", **kw):
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, decode=decode)
    return sample_episodes(
        model, tok, rows, Echo, G, params,
        torch.Generator().manual_seed(seed), max_turns=max_turns, max_episode_tokens=budget, **kw,
    )  # fmt: skip


def stream_ids(rollout, b: int) -> list[int]:
    p = rollout.prompt_ids[b // rollout.group_size][rollout.prompt_mask[b // rollout.group_size]]
    return p.tolist() + rollout.completion_ids[b][rollout.completion_mask[b]].tolist()


def test_the_stream_is_the_chat_template_of_the_final_conversation(chatml):
    model, tok = chatml
    r = episodes(model, tok)
    fmt = TemplateFormat(tok)
    endings = set()
    for b, e in enumerate(r.episodes):
        ids = stream_ids(r, b)
        full = fmt.render(e.messages)
        text = tok.decode(ids, skip_special_tokens=False)
        assert full.startswith(text), (full, text)
        # after the model's last token the template only closes the turn: "\n" after its own
        # <|im_end|>, or the whole closing when a stop string ended the turn
        rest = full[len(text) :]
        assert rest == ("\n" if ids[-1] == tok.eos_token_id else "<|im_end|>\n"), rest
        endings.add(rest)
        # the character tokenizer is canonical: the ids are the template's own tokenization too
        assert tok(full, add_special_tokens=False)["input_ids"][: len(ids)] == ids
        assert e.num_turns == sum(m["role"] == "assistant" for m in e.messages) >= 1
    assert endings == {"\n", "<|im_end|>\n"}  # both kinds of turn end occurred
    assert any(e.num_turns > 1 for e in r.episodes)


def test_plain_format_stream_is_the_concatenated_conversation(chatml):
    _model, _ = chatml
    from grpokit.models.tiny import char_tokenizer

    tok = char_tokenizer()
    plain = nudged_model(tok, {"<eos>": 4.0, "q": 3.0})
    r = episodes(plain, tok, fmt=PlainFormat(tok))
    for b, e in enumerate(r.episodes):
        ids = stream_ids(r, b)
        text = tok.decode(ids, skip_special_tokens=False)
        # the plain format writes no turn markers; a model turn's EOS stays in the stream (trained on)
        assert text.replace("<eos>", "") == PlainFormat().render(e.messages)
        assert tok(text.replace("<eos>", ""))["input_ids"] == [i for i in ids if i != tok.eos_token_id]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_environment_tokens_are_masked_and_model_tokens_carry_the_sampler_logprobs(chatml, dtype):
    # float64: the same function of the same tokens and positions, to the float32 the rollout stores;
    # float32: the rounding of a cached step per token vs one forward (up to 3.6e-5 on AVX-512)
    model, tok = chatml
    model = model if dtype == torch.float32 else nudged_model(tok, {"<|im_end|>": 4.0, "q": 3.0}).double()
    tol = 1e-6 if dtype == torch.float64 else 5e-5
    r = episodes(model, tok)
    checked = 0
    for b, e in enumerate(r.episodes):
        mask = r.model_mask[b][r.completion_mask[b]].tolist()
        assert sum(mask) == sum(t.num_tokens for t in e.turns if t.trained)
        assert len(mask) - sum(mask) == sum(t.num_tokens for t in e.turns if not t.trained)
        pos = 0
        for t in e.turns:  # the mask follows the turns
            assert mask[pos : pos + t.num_tokens] == [t.trained] * t.num_tokens
            pos += t.num_tokens
        assert bool((r.sampler_logp[b][~r.model_mask[b]] == 0).all())
        # the whole stream in one plain forward: the same log-probs as the sampler's cached, chunked decode
        ids = torch.tensor(stream_ids(r, b))
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].to(dtype), dim=-1)
        L = len(ids) - int(r.completion_mask[b].sum())
        for t in range(int(r.completion_mask[b].sum())):
            if r.model_mask[b, t]:
                assert abs(float(logp[L + t - 1, ids[L + t]]) - float(r.sampler_logp[b, t])) < tol
                checked += 1
    assert checked > 50
    assert r.trained_mask.sum() < r.completion_mask.sum()  # there were environment tokens


@pytest.mark.parametrize("decode", ["auto", "hf"])
def test_the_cache_is_kept_across_turns(chatml, monkeypatch, decode):
    """After the prompt pass, no forward re-runs a prefix: each feeds one sampled token, plus an
    observation's tokens for rows whose environment just answered; on grpokit's own decode path
    (auto) and on the HF forward."""
    model, tok = chatml
    widths = []
    own_forward = OwnDecoder._forward

    def recording(self, ids, *args, **kw):
        widths.append(ids.shape[1])
        return own_forward(self, ids, *args, **kw)

    monkeypatch.setattr(OwnDecoder, "_forward", recording)
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        r = episodes(model, tok, decode=decode)
    finally:
        hook.remove()
    longest_observation = max(t.num_tokens for e in r.episodes for t in e.turns if not t.trained)
    assert widths[0] == r.prompt_ids.shape[1]  # the prompt pass, once for all groups
    assert max(widths[1:]) == longest_observation + 1
    fed = sum(widths[1:])
    assert fed < r.completion_mask.shape[1] * len(widths[1:])  # not the whole stream every step


def test_an_episode_does_not_depend_on_its_batch(chatml):
    model, tok = chatml
    whole = episodes(model, tok)
    G = 4
    part = episodes(model, tok, rows=ROWS[1:2], row_offset=G, num_rows_total=len(ROWS) * G)
    for j in range(G):
        assert stream_ids(part, j) == stream_ids(whole, G + j)
        assert part.episodes[j].messages == whole.episodes[G + j].messages


def test_max_turns_and_the_token_budget_hold(chatml):
    model, tok = chatml
    r = episodes(model, tok, max_turns=2, budget=200)
    assert max(e.num_turns for e in r.episodes) == 2
    assert {e.stop for e in r.episodes} <= {"max_turns", "turn_length"}
    assert all(e.stop == "turn_length" or e.num_turns == 2 for e in r.episodes)
    assert bool(r.truncated.all())  # Echo never ends an episode: each was cut by a limit
    for e in r.episodes:  # every ended turn was stepped (and rewarded); the last one's answer is not kept
        if e.stop == "max_turns":
            assert e.reward == 0.5 * e.num_turns
            assert sum(m["role"] == "tool" for m in e.messages) == e.num_turns - 1
    for budget in (5, 17, 40):
        r = episodes(model, tok, max_turns=10, budget=budget)
        assert int(r.completion_mask.sum(dim=1).max()) <= budget
        assert any(e.stop == "budget" for e in r.episodes)


def test_an_environment_that_ends_the_episode(chatml):
    model, tok = chatml

    class Once(Echo):
        def step(self, completion):
            return StepResult(None, reward=1.0)

    r = sample_episodes(
        model, tok, ROWS, Once, 2, SamplingParams(max_new_tokens=12), torch.Generator().manual_seed(0),
        max_turns=5, max_episode_tokens=100,
    )  # fmt: skip
    for b, e in enumerate(r.episodes):
        assert e.num_turns == 1 and e.reward == 1.0
        assert (e.stop == "done") == (not bool(r.truncated[b]))
        assert r.completions[b] == e.final_text == e.messages[-1]["content"]
    assert r.model_mask[r.completion_mask].all()


def test_reset_must_not_differ_within_a_row(chatml):
    model, tok = chatml

    class Random(Echo):
        count = 0

        def reset(self, row):
            Random.count += 1
            return [{"role": "user", "content": f"{row['prompt']} {Random.count}"}]

    with pytest.raises(ValueError, match="different messages for the same row"):
        sample_episodes(model, tok, ROWS, Random, 2, SamplingParams(max_new_tokens=4),
                        max_turns=2, max_episode_tokens=20)  # fmt: skip


class Keeps(Echo):
    """Makes a tensor in each step, as an environment with a neural judge would, and keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def step(self, completion: str) -> StepResult:
        self.made.append(torch.tensor([float(len(completion))]))
        return super().step(completion)


def test_episodes_give_ordinary_tensors_and_run_environments_outside_inference_mode(chatml):
    model, tok = chatml
    envs: list[Keeps] = []

    def make() -> Keeps:
        envs.append(Keeps())
        return envs[-1]

    r = sample_episodes(
        model, tok, ROWS, make, 2, SamplingParams(max_new_tokens=12, temperature=1.0),
        torch.Generator().manual_seed(0), max_turns=3, max_episode_tokens=200,
    )  # fmt: skip
    made = [t for env in envs for t in env.made]
    assert made and not any(t.is_inference() for t in made)
    fields = [r.prompt_ids, r.completion_ids, r.completion_mask, r.sampler_logp, r.model_mask]
    assert not any(t.is_inference() for t in fields)
    assert not any(b.is_inference() for b in model.buffers())
