"""A ChatML tokenizer (character-level plus <|im_start|> / <|im_end|>) and a random tiny Llama over it
whose logits are nudged towards EOS and a stop character, so episodes have short turns that end both
ways. Built here for the multi-turn tests."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from grpokit.models.tiny import char_tokenizer, tiny_config

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


def nudged_model(tok, nudges: dict[str, float], seed: int = 0, peaky: bool = True):
    """A random 2-layer Llama whose output logits get ``+value`` for each token in ``nudges``
    (a forward hook on the output head: the sampler and a plain forward see the same model)."""
    torch.manual_seed(seed)
    config = tiny_config(len(tok), hidden_size=32)
    config.initializer_range = 0.5 if peaky else 0.02
    model = LlamaForCausalLM(config).eval()
    bias = torch.zeros(len(tok))
    for token, value in nudges.items():
        bias[tok.convert_tokens_to_ids(token)] = value
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    return model
