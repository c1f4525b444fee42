"""reward_model scores (prompt, completion) with a locally built sequence-classification model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForSequenceClassification

from grpokit.models.tiny import char_tokenizer, tiny_config
from grpokit.rewards import get


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    tok = char_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(len(tok), hidden_size=32)
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_scores_equal_a_manual_forward_in_any_batch_size(rm_dir):
    prompts, completions = ["12+34=", "5=", "7*8="], ["46", "5 or so", "56"]
    got = get("reward_model", path=str(rm_dir), batch_size=2)(prompts, completions)
    model = LlamaForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = char_tokenizer()
    for p, c, g in zip(prompts, completions, got, strict=True):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([tok(p + c)["input_ids"]])).logits[0, 0].item()
        assert g == pytest.approx(want, abs=1e-5)
    assert get("reward_model", path=str(rm_dir), batch_size=3)(prompts, completions) == pytest.approx(
        got, abs=1e-5
    )


def test_a_classifier_with_several_labels_is_refused(tmp_path):
    tok = char_tokenizer()
    config = tiny_config(len(tok), hidden_size=32)
    config.num_labels = 3
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 3 labels; a reward model has 1"):
        get("reward_model", path=str(tmp_path))
