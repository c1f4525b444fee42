"""The sampler draws from the model's distribution, matches HF greedy decoding, and is seeded."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.rollout.decode import OwnDecoder
from grpokit.rollout.sampler import CDF_BLOCK, SamplingParams, encode_prompts, inverse_cdf, sample


def chi_square_bound(df: int, z: float = 4.5) -> float:
    """Wilson-Hilferty upper quantile of chi^2(df) at about 1 - 3e-6 (z = 4.5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, pooling bins with expected count < 5 into one."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def next_token_probs(model, tokenizer, text: str, temperature: float) -> torch.Tensor:
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    return torch.softmax(logits.double() / temperature, -1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_and_second_token_follow_the_model(peaky, temperature):
    model, tok = peaky
    N = 20000
    g = torch.Generator().manual_seed(0)
    r = sample(model, tok, ["12+34="], N, SamplingParams(max_new_tokens=2, temperature=temperature), g)
    V = len(tok)
    first = r.completion_ids[:, 0]
    stat, df = chi_square(
        torch.bincount(first, minlength=V), next_token_probs(model, tok, "12+34=", temperature)
    )
    assert stat < chi_square_bound(df), (stat, df)

    # second token, conditioned on the most frequent first token: exercises the repeated KV cache
    top = int(torch.bincount(first, minlength=V).argmax())
    rows = (first == top) & r.completion_mask[:, 1]
    second = r.completion_ids[rows, 1]
    probs = next_token_probs(model, tok, "12+34=" + tok.decode([top]), temperature)
    stat, df = chi_square(torch.bincount(second, minlength=V), probs)
    assert rows.sum() > 1000 and stat < chi_square_bound(df), (stat, df)


def test_chi_square_check_has_power(peaky):
    # the same test rejects samples drawn at the wrong temperature
    model, tok = peaky
    r = sample(
        model,
        tok,
        ["7*8="],
        20000,
        SamplingParams(max_new_tokens=1, temperature=1.0),
        torch.Generator().manual_seed(1),
    )
    stat, df = chi_square(
        torch.bincount(r.completion_ids[:, 0], minlength=len(tok)), next_token_probs(model, tok, "7*8=", 0.7)
    )
    assert stat > chi_square_bound(df)


def test_top_k_and_top_p_restrict_the_support(peaky):
    model, tok = peaky
    probs = next_token_probs(model, tok, "9-3=", 1.0)
    g = torch.Generator().manual_seed(2)
    r = sample(model, tok, ["9-3="], 20000, SamplingParams(max_new_tokens=1, top_k=5), g)
    top5 = torch.topk(probs, 5).indices
    counts = torch.bincount(r.completion_ids[:, 0], minlength=len(tok))
    assert set(counts.nonzero().flatten().tolist()) <= set(top5.tolist())
    renorm = torch.zeros_like(probs)
    renorm[top5] = probs[top5] / probs[top5].sum()
    stat, df = chi_square(counts, renorm)
    assert stat < chi_square_bound(df)

    sorted_p, order = torch.sort(probs, descending=True)
    k = int((sorted_p.cumsum(0) < 0.5).sum()) + 1  # smallest set with mass >= 0.5
    r = sample(model, tok, ["9-3="], 20000, SamplingParams(max_new_tokens=1, top_p=0.5), g)
    counts = torch.bincount(r.completion_ids[:, 0], minlength=len(tok))
    assert set(counts.nonzero().flatten().tolist()) <= set(order[:k].tolist())
    assert (counts[order[:k]] > 0).all()


def test_greedy_matches_hf_generate_token_for_token(peaky):
    model, tok = peaky
    prompts = ["12+34=", "5=", "(1+2)*3="]  # different lengths: left padding is exercised
    r = sample(model, tok, prompts, 1, SamplingParams(max_new_tokens=12, temperature=0))
    ids, mask = encode_prompts(tok, prompts)
    with torch.no_grad():
        hf = model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    hf = hf[:, ids.shape[1] :]
    for i in range(len(prompts)):
        ours = r.completion_ids[i][r.completion_mask[i]].tolist()
        theirs = hf[i].tolist()
        if tok.eos_token_id in theirs:
            theirs = theirs[: theirs.index(tok.eos_token_id) + 1]
        assert ours == theirs, i


def test_same_seed_same_completions_and_different_seed_differs(peaky):
    model, tok = peaky
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    a = sample(model, tok, ["1+1=", "2+2="], 4, params, torch.Generator().manual_seed(5))
    b = sample(model, tok, ["1+1=", "2+2="], 4, params, torch.Generator().manual_seed(5))
    c = sample(model, tok, ["1+1=", "2+2="], 4, params, torch.Generator().manual_seed(6))
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_layout_masks_truncation_and_stop_strings(peaky):
    model, tok = peaky
    params = SamplingParams(max_new_tokens=6, temperature=1.5)
    r = sample(model, tok, ["3+4=", "10-2="], 5, params, torch.Generator().manual_seed(7))
    assert r.num_rows == 10 and r.prompt_ids.shape[0] == 2 and r.group_size == 5
    for i in range(10):
        m = r.completion_mask[i]
        n = int(m.sum())
        assert n >= 1 and m[:n].all() and not m[n:].any()  # right-padded, contiguous
        ends_eos = r.completion_ids[i, n - 1] == tok.eos_token_id
        assert bool(r.truncated[i]) == (not ends_eos and n == 6)
        assert (r.completion_ids[i, n:] == tok.pad_token_id).all()

    stop = SamplingParams(max_new_tokens=30, temperature=1.5, stop=("1",))
    r = sample(model, tok, ["3+4="], 40, stop, torch.Generator().manual_seed(8))
    for i, text in enumerate(r.completions):
        n = int(r.completion_mask[i].sum())
        if "1" in text:  # stopped right at the stop string's last token
            assert text.endswith("1") and text.count("1") == 1 and not r.truncated[i]
        else:
            assert r.truncated[i] or r.completion_ids[i, n - 1] == tok.eos_token_id
    assert any("1" in t for t in r.completions)


@pytest.mark.parametrize("decode", ["hf", "auto"])
def test_prompt_runs_once_per_group(peaky, monkeypatch, decode):
    model, tok = peaky
    seen = []
    if decode == "hf":
        original = model.forward

        def spy(*args, **kwargs):
            seen.append(kwargs["input_ids"].shape)
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "forward", spy)
    else:
        original = OwnDecoder._forward

        def spy(self, ids, *args, **kwargs):
            seen.append(ids.shape)
            return original(self, ids, *args, **kwargs)

        monkeypatch.setattr(OwnDecoder, "_forward", spy)
    sample(
        model, tok, ["12+34=", "5="], 8, SamplingParams(max_new_tokens=3, decode=decode),
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert seen[0] == (2, 6)  # the prompt pass: 2 prompts, not 16 rows
    assert len(seen) > 1 and all(s[1] == 1 for s in seen[1:])  # then one token per step


def test_a_shard_samples_what_the_whole_batch_samples_for_its_rows(peaky):
    # data parallelism: rank r samples rows [offset, offset + B_r) of the global batch from the same
    # generator state, and must get exactly the completions one process gets for those rows
    model, tok = peaky
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    prompts = ["1+1=", "22+3=", "4-4=", "7+10="]  # different lengths: different left padding per shard
    whole = sample(model, tok, prompts, 3, params, torch.Generator().manual_seed(11))
    for offset_prompts, shard in ((0, prompts[:2]), (2, prompts[2:]), (3, prompts[3:])):
        g = torch.Generator().manual_seed(11)
        part = sample(model, tok, shard, 3, params, g, row_offset=offset_prompts * 3, num_rows_total=12)
        rows = slice(offset_prompts * 3, offset_prompts * 3 + len(shard) * 3)
        assert part.completions == whole.completions[rows]
        # the generator advanced by the whole batch's draw on every shard
        assert torch.equal(g.get_state(), _advanced(11, 8, 12).get_state())


def _advanced(seed: int, steps: int, rows: int) -> torch.Generator:
    g = torch.Generator().manual_seed(seed)
    torch.rand((steps, rows), generator=g)
    return g


def test_shard_outside_the_batch_is_refused(peaky):
    model, tok = peaky
    with pytest.raises(ValueError, match="do not fit"):
        sample(model, tok, ["1+1="], 4, SamplingParams(max_new_tokens=2), row_offset=2, num_rows_total=4)


def reference_inverse_cdf(z: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64, written from the definition: the first index whose cumulative probability exceeds
    u * total, never past the last token with mass, and each row's distance from its
    target to the nearest boundary of the drawn token's interval (rounding can only move a draw
    whose target is that close to a boundary)."""
    p = torch.softmax(z.double(), dim=-1)
    cdf = p.cumsum(dim=-1)
    target = u.double() * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    index = torch.minimum(index, (cdf < cdf[:, -1:]).sum(dim=-1))
    hi = cdf.gather(-1, index[:, None]).squeeze(-1)
    margin = torch.minimum(
        (hi - target).abs(), (target - (hi - p.gather(-1, index[:, None]).squeeze(-1))).abs()
    )
    return index, margin


@pytest.mark.parametrize("V", [5, 83, CDF_BLOCK, 3 * CDF_BLOCK + 7, 151936])
def test_inverse_cdf_draws_the_float64_reference_token(V):
    """The two-level draw picks the token the full float64 CDF picks, with its log-prob, on random
    logits with masked entries (in half the rows; a quarter of the rows have their leading blocks
    empty) and at the uniforms' extremes, and never draws a zero-probability token."""
    g = torch.Generator().manual_seed(V)
    B = 64
    z = torch.randn(B, V, generator=g) * 3
    masked = torch.rand(B, V, generator=g) < 0.5
    masked[:, : min(V - 1, 2 * CDF_BLOCK)] |= torch.arange(B)[:, None] % 4 == 0
    masked[:, -1] = False  # every row keeps a token
    z = z.masked_fill(masked & (torch.arange(B)[:, None] % 2 == 0), float("-inf"))
    u = torch.rand(B, generator=g)
    u[:8] = torch.tensor([0.0, 0.0, 1e-12, 1e-12, 1 - 2**-24, 1 - 2**-24, 1 - 2**-53, 1 - 2**-53])
    index, logp = inverse_cdf(z, u)
    ref_index, margin = reference_inverse_cdf(z, u)
    assert torch.isfinite(z.gather(-1, index[:, None])).all()  # a masked token is never drawn
    assert torch.equal(index[:8], ref_index[:8])  # the extremes: first and last tokens with mass
    clear = margin > 1e-6  # targets farther than rounding from the drawn interval's ends
    clear[:8] = True
    assert int(clear.sum()) >= B - 2
    assert torch.equal(index[clear], ref_index[clear])
    exact = torch.log_softmax(z.double(), -1).gather(-1, index[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), exact, rtol=0, atol=2e-6)
    work = z.clone()  # the draw written over its own input (out=z): the same tokens and log-probs
    assert all(torch.equal(a, b) for a, b in zip(inverse_cdf(work, u, out=work), (index, logp), strict=True))


def reference_truncation(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Float64, row by row, from the definitions: top-k keeps every logit at least the k-th largest;
    top-p then walks the (top-k) distribution's tokens from the most likely, keeping each while
    the mass before it is below top_p; a token whose logit ties the smallest kept one stays too.
    Returns z with -inf outside the kept tokens."""
    out = torch.full_like(z, float("-inf"), dtype=torch.float64)
    for r, row in enumerate(z.double().tolist()):
        finite = sorted((v for v in row if v != float("-inf")), reverse=True)
        t = finite[top_k - 1] if 0 < top_k < len(row) else -math.inf
        if top_p < 1.0:
            kept = [v for v in finite if v >= t]
            total = sum(math.exp(v - kept[0]) for v in kept)
            before = 0.0
            for v in kept:
                if before >= top_p:
                    break
                t, before = v, before + math.exp(v - kept[0]) / total
        out[r] = torch.tensor([v if v >= t else float("-inf") for v in row], dtype=torch.float64)
    return out


def truncation_logits(V: int) -> torch.Tensor:
    """Rows whose kept tokens fit the first candidates (peaked), the second (medium), or neither
    (flat), a plateau of 300 tied logits, ties at the top, and half-masked rows."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(16, V, generator=g, dtype=torch.float64)
    z[:4] *= 8
    z[4:8] *= 2.5
    z[8:12] *= 0.2
    z[12] = z[12] * 0.1 - 8
    z[12, 0], z[12, 100:400] = 3.0, 1.0
    z[13] -= 3
    z[13, [7, 9, 11]] = 5.0
    z[14:] = (z[14:] * 3).masked_fill(torch.rand(2, V, generator=g) < 0.5, float("-inf"))
    return z.float()


@pytest.mark.parametrize(
    ("top_k", "top_p", "widths"),
    [  # the widths drawn over: candidates, and V where a row sorts the whole vocabulary
        (5, 1.0, {6, "V"}),
        (200, 1.0, {201, "V"}),
        (0, 0.9, {64, 1024, "V"}),
        (0, 0.5, {64, 1024, "V"}),
        (50, 0.8, {51, "V"}),
        (2000, 0.95, {2001}),
    ],
)
def test_top_k_top_p_draw_the_float64_reference_token(monkeypatch, top_k, top_p, widths):
    """Top-k / top-p keep the tokens the definitions keep (ties included) and draw, for each
    uniform, the token a float64 inverse CDF over them in vocabulary order draws, with its
    renormalised log-prob: rows that draw among their largest logits and rows that sort the whole
    vocabulary (a tie at the k-th, a flat distribution) alike."""
    from grpokit.rollout import sampler

    V = 5 * CDF_BLOCK + 3
    z = truncation_logits(V)
    u = torch.rand(16, generator=torch.Generator().manual_seed(3)).double()
    drawn_widths, draw = [], sampler.inverse_cdf

    def recording(z_bV, u_b, out=None):
        drawn_widths.append(z_bV.shape[-1])
        return draw(z_bV, u_b, out=out)

    monkeypatch.setattr(sampler, "inverse_cdf", recording)
    before = z.clone()
    index, logp = sampler._sample_next(z, SamplingParams(1, top_k=top_k, top_p=top_p), u)
    assert torch.equal(z, before)
    kept = reference_truncation(z, top_k, top_p)
    assert set(drawn_widths) == {V if w == "V" else w for w in widths}
    ref_index, margin = reference_inverse_cdf(kept, u)
    assert torch.isfinite(kept.gather(-1, index[:, None])).all()  # only kept tokens are drawn
    clear = margin > 1e-6
    assert int(clear.sum()) >= 15
    assert torch.equal(index[clear], ref_index[clear])
    exact = torch.log_softmax(kept, -1).gather(-1, index[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), exact, rtol=0, atol=2e-6)
    if top_k == 5:  # the plateau's tie at the 5th logit keeps all 300 of it
        assert int(torch.isfinite(kept[12]).sum()) == 301


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1),
        SamplingParams(1, temperature=0.7),
        SamplingParams(1, temperature=0.7, top_k=50),
        SamplingParams(1, top_p=0.9),
    ],
    ids=["T1", "T0.7", "T0.7-top_k", "top_p"],
)
def test_a_draw_in_the_scratch_buffer_leaves_the_logits_and_draws_the_same(params):
    """``_sample_next`` with the call's scratch buffer (rows dropped: its first rows) gives the
    tokens and log-probs it gives without one, bit for bit, leaves the logits as they were, and at
    temperature 1 without filters writes its working tensor into the scratch, not a new one."""
    from grpokit.rollout.sampler import _sample_next, draw_scratch

    g = torch.Generator().manual_seed(7)
    V = 3 * CDF_BLOCK + 7
    logits = torch.randn(12, V, generator=g) * 3
    u = torch.rand(12, generator=g).double()
    scratch = draw_scratch(torch.empty(16, V))
    assert scratch.shape == (16, V) and scratch.dtype == torch.float32
    assert draw_scratch(torch.empty(16, CDF_BLOCK)) is None  # one level: no vocabulary-wide tensor
    before = logits.clone()
    got = _sample_next(logits, params, u, scratch)
    assert torch.equal(logits, before)
    want = _sample_next(logits, params, u)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if params.temperature == 1.0 and params.top_p == 1.0:
        e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        assert torch.equal(scratch[:12], e)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_sampler_draws_every_step_in_one_scratch_buffer(monkeypatch, temperature):
    """Over a vocabulary of more than one CDF block, every step of a call draws in the same
    buffer (no vocabulary-wide tensor per step), and the call samples what it samples without one."""
    from transformers import LlamaForCausalLM

    from grpokit.models.tiny import char_tokenizer, tiny_config
    from grpokit.rollout import sampler

    tok = char_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(len(tok), hidden_size=16)
    config.vocab_size = 3 * CDF_BLOCK + 7  # ids past the characters decode to nothing
    model = LlamaForCausalLM(config).eval()
    params = SamplingParams(max_new_tokens=6, temperature=temperature)
    made, buffers = [], []
    draw, make = sampler.inverse_cdf, sampler.draw_scratch

    def spy(z, u, out=None):
        buffers.append(None if out is None else out.data_ptr())
        return draw(z, u, out)

    monkeypatch.setattr(sampler, "inverse_cdf", spy)
    monkeypatch.setattr(sampler, "draw_scratch", lambda logits: made.append(make(logits)) or made[-1])
    got = sample(model, tok, ["12+34=", "7+8="], 4, params, torch.Generator().manual_seed(3))
    assert len(made) == 1 and buffers == [made[0].data_ptr()] * 6, buffers
    monkeypatch.setattr(sampler, "inverse_cdf", draw)
    monkeypatch.setattr(sampler, "draw_scratch", lambda logits: None)
    want = sample(model, tok, ["12+34=", "7+8="], 4, params, torch.Generator().manual_seed(3))
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.sampler_logp, want.sampler_logp)


@pytest.mark.parametrize("V", [83, 3 * CDF_BLOCK + 7])
def test_inverse_cdf_at_u_one_draws_the_last_token_with_mass(V):
    """u = 1 (the upper end, which torch.rand never gives) with the vocabulary's tail masked, as
    top-k leaves it: the draw stops at the last token with mass, never a masked one."""
    g = torch.Generator().manual_seed(V)
    z = torch.randn(6, V, generator=g)
    last = torch.tensor([0, 1, V // 2, V - 40, V - 2, V - 1])
    z = z.masked_fill(torch.arange(V)[None] > last[:, None], float("-inf"))
    index, logp = inverse_cdf(z, torch.ones(6))
    assert torch.equal(index, last)
    exact = torch.log_softmax(z.double(), -1).gather(-1, last[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), exact, rtol=0, atol=2e-6)


def _byte_level_bpe():
    """A byte-level BPE tokenizer trained here (GPT-2 / Qwen / SmolLM2's kind), with multi-byte
    characters split across tokens and two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = ["x = 3 + 4 </call> résumé naïve 東京 ok.", "call(7 * 6) . , ! ?  tabs\tand\nlines"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    raw.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<pad>")


def test_prompts_encode_as_each_does_alone_left_padded():
    """Each prompt's ids are the ones it gets alone (a template's BOS included), right-aligned
    after the pad id, the mask True exactly at them."""
    from tokenizers.processors import TemplateProcessing

    tok = _byte_level_bpe()
    bos = tok.convert_tokens_to_ids("<|im_end|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_end|> $A", special_tokens=[("<|im_end|>", bos)]
    )
    prompts = ["x = 3 + 4", "résumé naïve 東京 ok.", "a"]
    ids, mask = encode_prompts(tok, prompts)
    for i, p in enumerate(prompts):
        alone = tok(p)["input_ids"]
        assert alone[0] == bos and ids[i, mask[i]].tolist() == alone
        assert mask[i].tolist() == [False] * (ids.shape[1] - len(alone)) + [True] * len(alone)
        assert (ids[i, ~mask[i]] == tok.pad_token_id).all()


def test_batch_decode_gives_transformers_texts():
    from grpokit.models.tiny import char_tokenizer
    from grpokit.rollout.sampler import _backend_decodes, batch_decode

    gen = torch.Generator().manual_seed(0)
    char = char_tokenizer()
    char.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    cleaned = char_tokenizer()
    cleaned.clean_up_tokenization_spaces = True  # " ." -> ".": transformers' own decode must run
    for tok in (_byte_level_bpe(), char, cleaned):
        V = len(tok)
        # random ids, special ones included, rows of 0-40 tokens: partial UTF-8 sequences at row ends
        lengths = torch.randint(41, (200,), generator=gen).tolist()
        ids = [torch.randint(V, (n,), generator=gen).tolist() for n in lengths]
        want = tok.batch_decode(ids, skip_special_tokens=True)
        assert batch_decode(tok, ids) == want
        with_special = tok.batch_decode(ids)  # the rows do hold special tokens, and they are skipped
        assert any(tok.eos_token in t for t in with_special) and not any(tok.eos_token in t for t in want)
    assert _backend_decodes(char) and not _backend_decodes(cleaned)
    # and there the backend's texts differ: the clean-up is not the backend's
    assert cleaned.backend_tokenizer.decode_batch(ids, skip_special_tokens=True) != want

    class OwnDecode(type(char)):  # a tokenizer class with a decode of its own keeps it
        def _decode(self, token_ids, **kwargs):
            return "own"

    char.__class__ = OwnDecode
    assert not _backend_decodes(char) and set(batch_decode(char, [[1, 2], [3]])) == {"own"}
