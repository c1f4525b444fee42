"""Shared fixtures: a tiny Llama model and a character tokenizer, built here, saved to a temp dir."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from grpokit.models.tiny import char_tokenizer, tiny_config


def _save_tiny(path, initializer_range: float):
    tok = char_tokenizer()
    torch.manual_seed(1234)
    config = tiny_config(len(tok), hidden_size=32)
    config.initializer_range = initializer_range
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A randomly initialised 2-layer Llama model + char tokenizer, saved like any HF model."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-model"), initializer_range=0.02)


@pytest.fixture(scope="session")
def peaky_dir(tmp_path_factory):
    """The same architecture with large initial weights: next-token distributions far from uniform
    (max probability ~0.37 after "12+34="), so sampling tests have statistical power."""
    return _save_tiny(tmp_path_factory.mktemp("peaky-model"), initializer_range=0.5)


@pytest.fixture()
def tiny(tiny_dir):
    from grpokit.models.loading import load_model

    return load_model(str(tiny_dir))


@pytest.fixture()
def peaky(peaky_dir):
    from grpokit.models.loading import load_model

    return load_model(str(peaky_dir))
