"""Fixtures shared by the rollout tests."""

from __future__ import annotations

import pytest

from tests.envs.chatml import chatml_tokenizer, nudged_model


@pytest.fixture(scope="module")
def chatml():
    """A ChatML tokenizer and a random 2-layer Llama nudged towards ``<|im_end|>`` and ``q`` (Echo's
    stop string), so that turns end by both."""
    tok = chatml_tokenizer()
    return nudged_model(tok, {"<|im_end|>": 4.0, "q": 3.0}), tok
