"""A stand-in for vLLM's in-process ``LLM`` on CPU, for the engine's tests where vLLM cannot run.

It answers ``generate`` the way vLLM's offline API does (one ``RequestOutput`` per request, ``n``
``CompletionOutput`` each with ``token_ids``, ``finish_reason`` and, when ``logprobs`` is asked for,
one ``{token_id: Logprob}`` per token) by running grpokit's built-in sampler on a model of its own,
whose weights change only through the engine's ``load_weights`` push, as vLLM's do.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass

import torch

from grpokit.rollout.sampler import SamplingParams, encode_prompts, sample


@dataclass
class Logprob:  # vLLM's vllm.logprobs.Logprob, the fields grpokit reads
    logprob: float
    rank: int | None = None


def install_fake_vllm_module(monkeypatch) -> None:
    """``from vllm import SamplingParams`` gives a record of its keyword arguments."""
    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)


class FakeLLM:
    """``shift`` is added to every ``every``-th reported log-prob (another engine's numerics);
    ``decoy`` adds a second, wrong candidate to each token's dict, as ``logprobs=N`` would."""

    def __init__(self, model, tokenizer, shift: float = 0.0, every: int = 1, decoy: bool = False) -> None:
        self.model = copy.deepcopy(model)
        self.tokenizer = tokenizer
        self.shift, self.every, self.decoy = shift, every, decoy
        self.requests: list[list] = []  # the SamplingParams of each generate call
        self.pushes = 0
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load_weights))
        worker = types.SimpleNamespace(model_runner=runner)
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

    def _load_weights(self, named_tensors) -> None:
        self.model.load_state_dict(dict(named_tensors))
        self.pushes += 1

    def generate(self, requests, params, use_tqdm=False):
        self.requests.append(params)
        outputs, reported = [], 0
        for request, p in zip(requests, params, strict=True):
            text = self.tokenizer.decode(request["prompt_token_ids"])
            # vLLM runs the ids it is given; this stand-in replays them as text, so it checks that
            # the text encodes back to exactly those ids (else it would answer another prompt)
            again, real = encode_prompts(self.tokenizer, [text])
            if again[real].tolist() != list(request["prompt_token_ids"]):
                raise AssertionError("the fake vLLM cannot replay these prompt ids exactly as text")
            ours = SamplingParams(p.max_tokens, p.temperature, p.top_p, max(p.top_k, 0), tuple(p.stop or ()))
            r = sample(self.model, self.tokenizer, [text], p.n, ours, torch.Generator().manual_seed(p.seed))
            completions = []
            for b in range(r.num_rows):
                m = r.completion_mask[b]
                ids = r.completion_ids[b][m].tolist()
                logprobs = None
                if p.logprobs is not None:
                    logprobs = []
                    for token, lp in zip(ids, r.sampler_logp[b][m].tolist(), strict=True):
                        if reported % self.every == 0:
                            lp += self.shift
                        reported += 1
                        entry = {(token + 1) % len(self.tokenizer): Logprob(-0.01, 0)} if self.decoy else {}
                        entry[token] = Logprob(lp, 1)  # after the decoy: found by id, not by place
                        logprobs.append(entry)
                finish = "length" if bool(r.truncated[b]) else "stop"
                out = types.SimpleNamespace(token_ids=ids, finish_reason=finish, logprobs=logprobs)
                completions.append(out)
            outputs.append(types.SimpleNamespace(outputs=completions))
        return outputs
