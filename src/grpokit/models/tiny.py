"""The embedded tiny model's building blocks: a character-level tokenizer and a small config.

What it does: ``char_tokenizer`` trains (builds) a character-level tokenizer with the
``tokenizers`` library and wraps it as a ``PreTrainedTokenizerFast``; ``tiny_config`` gives a
small Llama config. Tests build throw-away models from these; the shipped demo model
(``shipped_model_dir()``, ``model.name_or_path: tiny``) is built from them by
``scripts/build_tiny_model.py``: ~100K parameters, a brief sloppy-teacher warm-up on the
built-in tasks, ~17% greedy accuracy on sort, the rest is left to GRPO. ``tiny-calculator``
(``--task calculator``) continues it with a sloppy warm-up on tool calls for the calculator task.

What it deliberately does not do: download anything. Every model here is made on this machine.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from grpokit.errors import MissingFileError

PAD, EOS = "<pad>", "<eos>"
DEFAULT_ALPHABET = "0123456789+-*/=()<>?,.:;!' \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus ``<pad>`` (id 0) and ``<eos>`` (id 1).

    Characters outside the alphabet are refused at encode time (``<unk>`` would hide bugs in a
    task's prompt format), except that they map to an ``<unk>`` id 2 so decoding never fails.
    """
    chars = sorted(set(alphabet))
    vocab = {PAD: 0, EOS: 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token="<unk>", padding_side="left"
    )


def tiny_config(
    vocab_size: int, hidden_size: int = 64, num_layers: int = 2, max_positions: int = 256
) -> LlamaConfig:
    """A small Llama decoder: ``num_layers`` layers of width ``hidden_size``, GQA with 2 KV heads.

    Llama rather than Qwen2 on purpose: transformers 5's ``AutoTokenizer`` replaces the saved
    tokenizer of a ``qwen2`` model with ``Qwen2Tokenizer``, which drops the spaces a character
    tokenizer must keep; for ``llama`` it loads the saved tokenizer as it was saved.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )


SHIPPED = {"tiny": "tiny_model", "tiny-calculator": "tiny_calculator_model"}


def shipped_model_dir(name: str = "tiny") -> Path:
    """The directory of an embedded model inside the installed package: ``tiny`` (the demo's) or
    ``tiny-calculator`` (the tiny model after a warm-up on calculator tool calls)."""
    path = Path(__file__).resolve().parent / SHIPPED[name]
    if not (path / "model.safetensors").is_file():
        raise MissingFileError(
            f"the embedded tiny model is missing from {path}; rebuild it with scripts/build_tiny_model.py"
        )
    return path
