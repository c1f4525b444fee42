"""Multi-turn episodes: G episodes per row with an environment answering each model turn, token-exact.

What it does: every completion is an episode with its own environment (``envs.Environment``). The
first messages (``reset``) are rendered and encoded once per group and run through the model once;
then all episodes decode together, one token per step, each stopping on its own. When a row's
turn ends (EOS, a stop string such as a tool call's ``</call>``), its text goes to the
environment; the observation it returns is rendered (``envs.render.observation_text``), encoded
once and appended to that row's stream **as ids**, and fed through the model on the next step
together with the other rows' single tokens: the KV cache of the episode is kept across turns
(rows whose chunk is shorter are padded inside the chunk, and the padding is masked out of every
later attention). Positions count real tokens only, so the trainer's contiguous re-computation
sees exactly the sampled context.

The stream after the prompt is recorded with ``Rollout.model_mask`` (True: the model wrote the
token, it gets a loss, a KL term and counts in the lengths; False: the environment inserted it)
and each model token's sampler log-prob. Nothing the model wrote is ever decoded and re-encoded.

Limits: ``params.max_new_tokens`` per model turn, ``max_turns`` model turns, and
``max_episode_tokens`` tokens after the prompt (model and environment tokens together; an
observation that does not fit ends the episode). An episode cut by any of them is ``truncated``.

Randomness: the k-th model token of global row i uses uniform ``u[k, i]`` of one block drawn up
front, as in ``sampler.sample``: a row's episode does not depend on which rows share its batch
(data parallelism samples the same episodes as one process).

``start_episodes``, ``end_turn`` and ``episode_rollout`` are the environment side and the records,
shared with the vLLM engine's episodes (``VLLMEngine.sample_episodes``), which generate each turn
with vLLM instead of this module's cached decode.

What it deliberately does not do: score episodes (rewards do, with the conversation as a column),
or run environments in parallel across rows (tool calls within a turn do run in parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpokit.envs.base import Environment, make_env_factory
from grpokit.envs.render import assistant_content, conversation_format, observation_text
from grpokit.rollout.decode import decoder_for
from grpokit.rollout.sampler import (
    Rollout,
    SamplingParams,
    _hits_stop,
    _sample_next,
    draw_scratch,
    encode_prompts,
    pad_token_id,
    sample,
    sampling_mode,
    uniforms,
)


@dataclass(frozen=True)
class EpisodeSpec:
    """How a run samples episodes instead of single completions (``rollout.env``)."""

    make_env: Callable[[], Environment]  # a fresh environment per episode
    max_turns: int
    max_episode_tokens: int


def rollout_rows(
    model, tokenizer, rows: list[dict], prompts: list[str], group_size: int, params: SamplingParams,
    generator: torch.Generator | None = None, *, episodes: EpisodeSpec | None = None, **kw,
) -> Rollout:  # fmt: skip
    """Single completions of the rendered ``prompts`` (``sampler.sample``), or with ``episodes`` the
    episodes of ``rows`` (their environment renders the prompts). ``kw``: row_offset,
    num_rows_total, policy_version."""
    if episodes is None:
        return sample(model, tokenizer, prompts, group_size, params, generator, **kw)
    return sample_episodes(
        model, tokenizer, rows, episodes.make_env, group_size, params, generator,
        max_turns=episodes.max_turns, max_episode_tokens=episodes.max_episode_tokens, **kw,
    )  # fmt: skip


def episodes_from_config(cfg, tokenizer, env: str | None) -> EpisodeSpec | None:
    """The run's :class:`EpisodeSpec` for environment ``env`` (``config.rollout_env``: rollout.env or
    the task's own), or None for single-turn runs. ``tool_format: auto`` is hermes for a tokenizer
    with a chat template, else pythonic."""
    if env is None:
        return None
    r, d = cfg.rollout, cfg.data
    fmt = r.tool_format
    if fmt == "auto":
        fmt = "hermes" if getattr(tokenizer, "chat_template", None) else "pythonic"
    make_env = make_env_factory(
        env, tools=r.tools, tool_format=fmt, tool_timeout_s=r.tool_timeout_s,
        prompt_column=d.prompt_column, system_prompt=d.system_prompt, env_args=r.env_args,
    )  # fmt: skip
    budget = r.max_episode_tokens or r.max_turns * r.max_new_tokens
    return EpisodeSpec(make_env, r.max_turns, budget)


def episode_columns(rollout: Rollout) -> dict[str, list]:
    """The reward columns of an episode rollout: ``conversation`` (each episode's messages) and
    ``env_reward`` (the environment's reward, None where it gave none); empty for single turns."""
    if rollout.episodes is None:
        return {}
    return {
        "conversation": [e.messages for e in rollout.episodes],
        "env_reward": [e.reward for e in rollout.episodes],
    }


def rollout_prompts(rollout: Rollout, tokenizer) -> list[str]:
    """Each row's prompt text as the model saw it (the rendered first messages of its episode)."""
    texts = [
        tokenizer.decode(ids[m].tolist())
        for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask, strict=True)
    ]
    return [t for t in texts for _ in range(rollout.group_size)]


@dataclass
class Turn:
    role: str  # "assistant" for the model's turns; the inserted messages' roles otherwise ("tool")
    text: str  # the model's message / the inserted text, as it appears in the stream
    trained: bool  # the model wrote it: it gets a loss
    num_tokens: int


@dataclass
class Episode:
    messages: list[dict]  # the whole conversation: the first messages, then the turns
    turns: list[Turn]  # the stream after the prompt, in order
    reward: float | None  # sum of the environment's rewards; None when it gave none
    num_tool_calls: int
    num_tool_errors: int
    stop: str  # done (the environment ended it) | max_turns | turn_length | budget

    @property
    def num_turns(self) -> int:  # model turns
        return sum(t.trained for t in self.turns)

    @property
    def final_text(self) -> str:  # the model's last message: what a verifier reads
        return next((t.text for t in reversed(self.turns) if t.trained), "")

    def transcript(self) -> str:
        """The stream after the prompt as text: the model's turns and what the environment inserted."""
        return "".join(t.text for t in self.turns)

    def as_dict(self) -> dict:
        return {
            "turns": [vars(t) for t in self.turns],
            "env_reward": self.reward,
            "tool_calls": self.num_tool_calls,
            "tool_errors": self.num_tool_errors,
            "stop": self.stop,
        }


@torch.no_grad()
def sample_episodes(
    model,
    tokenizer,
    rows: list[dict],
    make_env: Callable[[], Environment],
    group_size: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    max_turns: int,
    max_episode_tokens: int,
    row_offset: int = 0,
    num_rows_total: int | None = None,
    policy_version: int = 0,
    fmt=None,
) -> Rollout:
    """``group_size`` episodes for each row; ``Rollout.completions`` holds each episode's final
    model message and ``Rollout.episodes`` the turns. ``fmt``: the conversation format (default:
    the tokenizer's chat template, else ``PlainFormat``). Other arguments as ``sampler.sample``."""
    device = next(model.parameters()).device
    P, G = len(rows), group_size
    B = P * G
    total = B if num_rows_total is None else num_rows_total
    if not 0 <= row_offset <= total - B:
        raise ValueError(f"rows [{row_offset}, {row_offset + B}) do not fit a batch of {total} rows")
    envs, rec, fmt, prompt_ids, prompt_mask, stops = start_episodes(
        tokenizer, rows, make_env, G, params, max_turns, max_episode_tokens, fmt
    )
    eos, pad = tokenizer.eos_token_id, pad_token_id(tokenizer)
    capacity = prompt_ids.shape[1] + max_episode_tokens  # positions; padding may take more slots
    decoder = decoder_for(model, params.decode, capacity, params.reorder_weights, params.share_prompts)
    # nothing made inside leaves it but Python lists (the environments' own steps run outside it)
    with sampling_mode(model, decoder):
        u_KB = uniforms(max_episode_tokens, total, row_offset, B, params.temperature, generator, device)
        logits_bV, state = decoder.prefill(prompt_ids.to(device), prompt_mask.to(device), G, capacity)
        scratch = draw_scratch(logits_bV)

        active = list(range(B))  # rows still running, in the cache's batch order
        while active:
            u_b = u_KB[[rec[b].num_model for b in active], active]
            next_b, logp_b = _sample_next(logits_bV, params, u_b, scratch)
            tokens, logps = next_b.tolist(), logp_b.tolist()
            for b, token, logp in zip(active, tokens, logps, strict=True):
                rec[b].add([token], True, [logp])
                rec[b].turn.append(token)
            ended = [token == eos for token in tokens]
            if stops:  # one batched decode of the running turns per step
                check = [j for j, done in enumerate(ended) if not done]
                hits = _hits_stop(tokenizer, [rec[active[j]].turn for j in check], stops).tolist()
                for j, hit in zip(check, hits, strict=True):
                    ended[j] = hit
            feeds, keep = [], []
            for j, b in enumerate(active):
                r, token = rec[b], tokens[j]
                if not ended[j] and len(r.turn) < params.max_new_tokens and len(r.ids) < max_episode_tokens:
                    feeds.append([token])
                    keep.append(j)
                    continue
                with torch.inference_mode(False):  # the user's environment: ordinary tensors
                    delta = end_turn(r, envs[b], fmt, tokenizer, ended[j], max_turns, max_episode_tokens)
                if delta is not None:
                    feeds.append([token, *delta])
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows from the batch and the cache
                decoder.select(state, torch.tensor(keep, device=device))
                active = [active[j] for j in keep]
            logits_bV = decoder.feed(*_chunks(feeds, pad, device), state)

    return episode_rollout(rec, prompt_ids, prompt_mask, G, pad, policy_version)


def start_episodes(
    tokenizer, rows: list[dict], make_env, group_size: int, params: SamplingParams,
    max_turns: int, max_episode_tokens: int, fmt=None,
):  # fmt: skip
    """A fresh environment and :class:`Record` per episode (``group_size`` per row, group after
    group), reset on its row, once the limits are checked; returns ``(envs, records, fmt,
    prompt_ids, prompt_mask, stops)``: the conversation format, each row's rendered first messages
    encoded once (left-padded), and the strings that end a model turn (``params.stop``, then the
    environment's)."""
    if group_size < 1 or params.max_new_tokens < 1 or max_turns < 1 or max_episode_tokens < 1:
        raise ValueError("need group_size, max_new_tokens, max_turns and max_episode_tokens >= 1")
    G = group_size
    envs = [make_env() for _ in range(len(rows) * G)]
    first = [env.reset(rows[b // G]) for b, env in enumerate(envs)]
    if any(first[b] != first[b // G * G] for b in range(len(envs))):
        raise ValueError("an environment's reset(row) returned different messages for the same row")
    fmt = fmt if fmt is not None else conversation_format(tokenizer, envs[0].tool_schemas)
    prompts = [fmt.render(first[p * G], True) for p in range(len(rows))]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    records = [Record(list(m)) for m in first]
    return envs, records, fmt, prompt_ids, prompt_mask, tuple(params.stop) + tuple(envs[0].stop)


def end_turn(
    r: Record, env: Environment, fmt, tokenizer, ended: bool, max_turns: int, max_episode_tokens: int
) -> list[int] | None:
    """Close the model turn whose ids are ``r.turn`` (already in ``r.ids``): record the message,
    and when the model ``ended`` it (EOS, a stop string) give it to the environment. Returns the
    ids of the observation the episode goes on with (appended to ``r``, not trained), or None when
    the episode is over (``r.stop`` says why)."""
    turn_text = tokenizer.decode(r.turn, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    before = list(r.messages)
    content = assistant_content(fmt, turn_text)
    r.messages.append({"role": "assistant", "content": content})
    r.turns.append(Turn("assistant", content, True, len(r.turn)))
    r.turn = []
    if not ended:
        r.stop = "turn_length" if len(r.ids) < max_episode_tokens else "budget"
        return None
    res = env.step(content)
    if res.reward is not None:
        r.reward = (r.reward or 0.0) + float(res.reward)
    r.tool_calls += int(res.info.get("tool_calls", 0))
    r.tool_errors += int(res.info.get("tool_errors", 0))
    if res.observation is None:
        r.stop = "done"
        return None
    if r.num_turns == max_turns:
        r.stop = "max_turns"
        return None
    text = observation_text(fmt, before, turn_text, res.observation)
    delta = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(r.ids) + len(delta) >= max_episode_tokens:  # no room for the observation and a reply
        r.stop = "budget"
        return None
    r.messages.extend(res.observation)
    r.turns.append(Turn("+".join(m["role"] for m in res.observation), text, False, len(delta)))
    r.add(delta, False, [0.0] * len(delta))
    return delta


def episode_rollout(
    records: list[Record], prompt_ids, prompt_mask, group_size: int, pad: int, policy_version: int,
    with_logprobs: bool = True,
) -> Rollout:  # fmt: skip
    """The :class:`Rollout` of finished episodes: each stream right-padded, ``model_mask`` on the
    model's tokens, the sampler log-probs (None without ``with_logprobs``), the episodes."""
    B, T = len(records), max(len(r.ids) for r in records)
    ids_BT = torch.full((B, T), pad, dtype=torch.long)
    real_BT = torch.zeros((B, T), dtype=torch.bool)
    model_BT = torch.zeros((B, T), dtype=torch.bool)
    logp_BT = torch.zeros((B, T), dtype=torch.float32)
    for b, r in enumerate(records):
        n = len(r.ids)
        ids_BT[b, :n], real_BT[b, :n] = torch.tensor(r.ids), True
        model_BT[b, :n], logp_BT[b, :n] = torch.tensor(r.trained), torch.tensor(r.logp)
    episodes = [r.episode() for r in records]
    return Rollout(
        prompt_ids,
        prompt_mask,
        ids_BT,
        real_BT,
        torch.tensor([e.stop != "done" for e in episodes]),
        [e.final_text for e in episodes],
        group_size,
        logp_BT if with_logprobs else None,
        torch.full((B,), policy_version, dtype=torch.long),
        model_BT,
        episodes,
    )


class Record:
    """One episode while it runs."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages, self.turns = messages, []
        self.ids: list[int] = []
        self.trained: list[bool] = []
        self.logp: list[float] = []
        self.turn: list[int] = []  # the current model turn's ids
        self.num_model, self.tool_calls, self.tool_errors = 0, 0, 0
        self.reward: float | None = None
        self.stop = "budget"

    @property
    def num_turns(self) -> int:
        return sum(t.trained for t in self.turns)

    def add(self, ids: list[int], trained: bool, logp: list[float]) -> None:
        self.ids += ids
        self.trained += [trained] * len(ids)
        self.logp += logp
        self.num_model += len(ids) if trained else 0

    def episode(self) -> Episode:
        return Episode(self.messages, self.turns, self.reward, self.tool_calls, self.tool_errors, self.stop)


def _chunks(feeds: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pending tokens (its sampled token, then any observation) right-padded to the
    longest: the ids [b, w] and which of them are real [b, w]."""
    lengths = [len(f) for f in feeds]
    w = max(lengths)
    ids_bw = torch.tensor([f + [pad] * (w - len(f)) for f in feeds] if w > 1 else feeds, device=device)
    real_bw = torch.arange(w, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    return ids_bw, real_bw
