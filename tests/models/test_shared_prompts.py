"""models/shared_prompts.py: the shared-prompt attention against a float64 softmax written from the
definition, over a dense mask built independently from the same spans."""

import pytest
import torch

from grpokit.models.shared_prompts import IMPLEMENTATION, SharedLayout, routed, shared_prompt_attention


def dense_reference(q, k, v, prompt_lengths, rows, S, scale):
    """softmax(q k^T * scale + mask) v per head in float64, with the mask of the spans: a prompt token
    sees the prompt's earlier tokens, a completion token the prompt and its own earlier tokens;
    padding outputs 0."""
    g, H, _, D = q.shape
    rep = H // k.shape[1]
    segment = torch.full((g, S), -1)  # 0: prompt, j + 1: row j
    for b, P in enumerate(prompt_lengths):
        segment[b, :P] = 0
    for j, (b, start, n) in enumerate(rows):
        segment[b, start : start + n] = j + 1
    out = torch.zeros(g, S, H, D, dtype=torch.float64)
    for b in range(g):
        for s in range(S):
            if segment[b, s] < 0:
                continue
            keys = [t for t in range(s + 1) if segment[b, t] == 0 or segment[b, t] == segment[b, s]]
            for h in range(H):
                scores = torch.stack([q[b, h, s] @ k[b, h // rep, t] for t in keys]) * scale
                weights = torch.softmax(scores, dim=0)
                out[b, s, h] = sum(w * v[b, h // rep, t] for w, t in zip(weights, keys, strict=True))
    return out


class Attn(torch.nn.Module):  # what transformers passes as ``module``
    num_key_value_groups = 1


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (6, 2)])  # (query heads, key heads): rep 1, 2, 3
def test_shared_attention_equals_the_dense_mask_in_float64(heads):
    H, K = heads
    torch.manual_seed(0)
    # two prompts of different lengths; group 0 holds 3 rows (one empty), group 1 one row and padding
    prompt_lengths = [4, 2]
    rows = [(0, 4, 3), (0, 7, 0), (0, 7, 2), (1, 2, 4)]
    S, D, scale = 9, 8, 0.3
    q = torch.randn(2, H, S, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, K, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    layout = SharedLayout(prompt_lengths, rows, S)
    out, _ = shared_prompt_attention(Attn(), q, k, v, None, scaling=scale, shared_layout=layout)
    ref = dense_reference(q, k, v, prompt_lengths, rows, S, scale)
    assert out.shape == (2, S, H, D)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert torch.equal(out[1, 6:], torch.zeros(3, H, D, dtype=torch.float64))  # group 1's padding
    g_out = torch.randn_like(ref)
    grads = torch.autograd.grad((out * g_out).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * g_out).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_without_a_layout_it_is_transformers_sdpa_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    ours, _ = shared_prompt_attention(Attn(), q, k, v, mask, scaling=0.5)
    theirs, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.5)
    assert torch.equal(ours, theirs)


def test_routed_switches_the_attention_and_restores_it_on_error(tiny):
    model, _ = tiny
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), routed(model):
        assert model.config._attn_implementation == IMPLEMENTATION
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"


def test_a_shared_micro_batch_outside_routed_fails_instead_of_attending_across_rows(tiny):
    from grpokit.train.batch import TrainBatch, collate_shared, completion_logprobs

    model, tok = tiny
    prompt = torch.tensor(tok("12+34=").input_ids)
    completions = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = TrainBatch([prompt] * 2, completions, torch.ones(2, 3, dtype=torch.bool), torch.zeros(2))
    mb = collate_shared(batch, [0, 1], tok.pad_token_id, torch.device("cpu"))
    with pytest.raises(RuntimeError):  # SDPA refuses the empty [groups, 1, 0, 0] mask
        completion_logprobs(model, mb, temperature=1.0)
    with routed(model):
        logp, _ = completion_logprobs(model, mb, temperature=1.0)
    for j in range(2):  # each row as if alone
        ids = torch.cat([prompt, batch.completion_ids[j]])[None]
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        alone = logits.log_softmax(-1).gather(1, batch.completion_ids[j][:, None])[:, 0]
        torch.testing.assert_close(logp[j], alone, rtol=0, atol=1e-5)
