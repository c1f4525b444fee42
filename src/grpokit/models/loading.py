"""Load a Hugging Face causal LM and its tokenizer from a local directory, and make a reference copy.

What it does: ``load_model`` resolves ``"tiny"`` to the embedded model and anything else to a
local path, loads with ``AutoModelForCausalLM.from_pretrained`` in the configured dtype, and
makes sure the tokenizer has a pad token. ``reference_copy`` makes the frozen reference model.

What it deliberately does not do: download from a hub (``local_files_only=True``), or wrap the
model for distributed training (``train.distributed`` does that).
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path == "tiny":
        from grpokit.models.tiny import shipped_model_dir

        return shipped_model_dir()
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.name_or_path={name_or_path!r} is not a local Hugging Face model directory "
            "(no config.json there); grpokit loads local models only -- download it first, or use 'tiny'"
        )
    return path


def load_model(name_or_path: str, dtype: str = "float32", device: str | torch.device = "cpu"):
    """Return ``(model, tokenizer)``; the model in eval mode (dropout off: see the trainer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # grpokit draws its own progress bar; HF's per-load bars are noise
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    return model.to(device).eval(), tokenizer


def reference_copy(model):
    """A frozen copy of ``model`` for the KL term: no gradients, eval mode, same device."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


_ACCEPTS: dict[tuple[type, str], bool] = {}


def accepts_kwarg(model, name: str) -> bool:
    """Does ``model.forward`` take keyword ``name``? (``logits_to_keep``, ``cache`` vs ``past_key_values``
    differ across transformers versions and architectures.) Cached per model class."""
    key = (type(model), name)
    if key not in _ACCEPTS:
        _ACCEPTS[key] = name in inspect.signature(model.forward).parameters
    return _ACCEPTS[key]
