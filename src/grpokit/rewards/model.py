"""``reward_model``: a Hugging Face sequence-classification model as a reward.

What it does: loads ``AutoModelForSequenceClassification`` (one output: a scalar score, e.g. a
Bradley-Terry reward model) and its tokenizer from a local directory, and scores each
(prompt, completion) pair -- the prompt and completion concatenated as text, or through the
tokenizer's chat template when ``chat_template=True`` -- in batches, without gradients.

What it deliberately does not do: train the reward model, or normalise its scores (group
advantages do that).
"""

from __future__ import annotations

import torch

from grpokit.errors import ConfigError
from grpokit.rewards.registry import register


@register("reward_model")
def reward_model(
    path: str,
    batch_size: int = 16,
    max_length: int = 1024,
    chat_template: bool = False,
    device: str | None = None,
    dtype: str = "float32",
):
    """Score = the model's single logit for ``prompt + completion`` (right-truncated to ``max_length``)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = (
        AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype)
        )
        .to(dev)
        .eval()
    )
    if model.config.num_labels != 1:
        raise ConfigError(f"reward_model: {path} has {model.config.num_labels} labels; a reward model has 1")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id

    def text_of(prompt: str, completion: str) -> str:
        if not chat_template:
            return prompt + completion
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return tok.apply_chat_template(messages, tokenize=False)

    @torch.no_grad()
    def reward(prompts, completions, **_):
        texts = [text_of(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        tok.padding_side = "right"
        for s in range(0, len(texts), batch_size):
            enc = tok(
                texts[s : s + batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_length,
            ).to(dev)
            scores += model(**enc).logits[:, 0].float().tolist()
        return scores

    reward.__name__ = "reward_model"
    return reward
