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
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"model.name_or_path={name_or_path!r} is not a local Hugging Face model directory "
            "(no config.json there); grpokit loads local models only -- download it first, or use 'tiny'"
        )
    return path


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    lora=None,
    gradient_checkpointing: bool = False,
):
    """Return ``(model, tokenizer)``; the model in eval mode, dropout disabled (see the trainer).

    A directory holding a LoRA adapter (``adapter_config.json``, e.g. a LoRA run's ``final/``) loads
    its base with the adapter. ``lora`` (a :class:`grpokit.config.LoraSpec`) adds new adapters.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # grpokit draws its own progress bar; HF's per-load bars are noise
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if (path / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=0.0,
                target_modules=targets,
                task_type="CAUSAL_LM",
            ),
        )
    disable_dropout(model)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()  # checkpointed frozen embeddings (LoRA) still need grads
    return model.to(device).eval(), tokenizer


def disable_dropout(model) -> None:
    """Every dropout to 0: GRPO's first importance ratio must be exactly 1, and HF models only
    checkpoint activations in train mode, so dropout cannot be left to eval mode alone."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


def merged(model):
    """A plain model: LoRA adapters merged into the base weights (other models unchanged)."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def reference_copy(model):
    """A frozen copy of ``model`` for the KL term: no gradients, eval mode, same device."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


_ACCEPTS: dict[tuple[type, str], bool] = {}


def accepts_kwarg(model, name: str) -> bool:
    """Does ``model.forward`` take keyword ``name``? (``logits_to_keep``, ``cache`` vs ``past_key_values``
    differ across transformers versions and architectures.) Cached per model class."""
    target = getattr(model, "module", model)  # under a DistributedDataParallel wrapper
    target = target.get_base_model() if hasattr(target, "get_base_model") else target  # peft: **kwargs
    key = (type(target), name)
    if key not in _ACCEPTS:
        _ACCEPTS[key] = name in inspect.signature(target.forward).parameters
    return _ACCEPTS[key]
