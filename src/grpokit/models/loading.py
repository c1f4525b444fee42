"""Load a Hugging Face causal LM and its tokenizer from a local directory, and make a reference copy.

What it does: ``load_model`` resolves ``"tiny"`` to the embedded model, a packaged GGUF alias
(``"smollm2-135m-instruct"``, see models/gguf.py) or ``gguf_file`` to its converted cached copy,
and anything else to a local path, loads with ``AutoModelForCausalLM.from_pretrained`` in the
configured dtype, and makes sure the tokenizer has a pad token. ``reference_copy`` makes the
frozen reference model.

What it deliberately does not do: download from a hub (``local_files_only=True``), or wrap the
model for distributed training (``train.distributed`` does that).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
from pathlib import Path
from typing import NamedTuple

import torch

from grpokit.errors import MissingFileError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ALIASES = ("tiny", "tiny-calculator", "smollm2-135m-instruct")  # names that resolve without a path


def resolve_model_path(name_or_path: str, gguf_file: str | None = None) -> Path:
    """The local model directory for ``model.name_or_path`` (and ``model.gguf_file``).

    ``gguf_file`` is a path, or a file name inside the ``name_or_path`` directory (as transformers'
    ``gguf_file=``); it is converted once into grpokit's cache and the copy is used.
    """
    if gguf_file is not None:
        from grpokit.models.gguf import converted_dir

        file = Path(gguf_file)
        if not file.is_file() and Path(name_or_path).is_dir():
            file = Path(name_or_path) / gguf_file
        return converted_dir(file)
    if name_or_path in ("tiny", "tiny-calculator"):
        from grpokit.models.tiny import shipped_model_dir

        return shipped_model_dir(name_or_path)
    if name_or_path in ALIASES:
        from grpokit.models.gguf import converted_dir, shipped_gguf

        return converted_dir(shipped_gguf(name_or_path))
    path = Path(name_or_path)
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise MissingFileError(
            f"model.name_or_path={name_or_path!r} is not a local Hugging Face model directory "
            "(no config.json there); grpokit loads local models only -- download it first, use "
            f"model.gguf_file for a GGUF file, or one of the built-in names {', '.join(ALIASES)}"
        )
    return path


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    lora=None,
    gradient_checkpointing: bool = False,
    gguf_file: str | None = None,
):
    """Return ``(model, tokenizer)``; the model in eval mode, dropout disabled (see the trainer).

    A directory holding a LoRA adapter (``adapter_config.json``, e.g. a LoRA run's ``final/``) loads
    its base with the adapter. ``lora`` (a :class:`grpokit.config.LoraSpec`) adds new adapters.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # grpokit draws its own progress bar; HF's per-load bars are noise
    path = resolve_model_path(name_or_path, gguf_file)
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


def mixed_precision(device: torch.device, dtype: str | None):
    """A context in which the model computes in ``dtype`` (``torch.autocast``) while its parameters,
    gradients and optimizer state stay in their own dtype (float32); null: a no-op context.

    On CPUs with AMX / AVX512-BF16 the bfloat16 matmuls of a 135M model measure about 2x faster than
    float32 (docs/smollm2.md). Apply :func:`keep_head_float32` so log-probs keep float32 logits.
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype])


def _float32_head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        return type(self).forward(self, hidden.float())


def kept_float32(head: torch.nn.Module) -> bool:
    """Whether :func:`keep_head_float32` bound ``head``'s forward (float32 whatever autocast says)."""
    return getattr(vars(head).get("forward"), "__func__", None) is _float32_head_forward


def keep_head_float32(model) -> None:
    """Run the output projection (the vocabulary logits) in float32 even under autocast.

    bfloat16 logits carry ~3 significant digits: a logit of 20 is off by up to 0.06, and so is every
    log-prob, ratio and KL computed from it. The head is a small share of the step (only the
    completion positions are projected), so it stays exact. Bound as a method, so a deep copy (the
    reference model) gets its own head's forward.
    """
    head = model.get_output_embeddings()
    if head is not None:
        head.forward = types.MethodType(_float32_head_forward, head)


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


def reference_copy(model, compute_dtype: torch.dtype | None = None):
    """A frozen copy of ``model`` for the KL term: no gradients, eval mode, same device.

    ``compute_dtype``: the autocast dtype the copy always runs under (None: stored as the policy
    is). Autocast casts the weight and bias of every ``Linear`` to it at every forward, and keeps
    casts only of tensors that require grad, which a frozen copy's do not; so those are stored in
    ``compute_dtype`` once: the same values (the same rounding), half the bytes of float32, no
    cast per forward. The output head (float32, :func:`keep_head_float32`), the embeddings, the
    norms and any tensor a ``Linear`` shares with them stay as they are. Only for a reference that
    never moves: one that mixes in the policy (``algo.ref_sync_every``) keeps float32.
    """
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    if compute_dtype is not None:
        head = ref.get_output_embeddings()
        cast = [m for m in ref.modules() if type(m) is torch.nn.Linear and m is not head]
        cast_ids = {id(m) for m in cast}
        kept = {id(p) for m in ref.modules() if id(m) not in cast_ids for p in m.parameters(recurse=False)}
        for module in cast:
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != torch.float64 and id(p) not in kept:
                    p.data = p.data.to(compute_dtype)
    return ref


def base_model_path(path: Path) -> Path:
    """The directory of the model whose weights ``path`` holds: ``path`` itself, or for a LoRA
    adapter directory (``adapter_config.json``) its base model's, resolved as ``model.name_or_path``."""
    import json

    config = path / "adapter_config.json"
    if not config.is_file() or (path / "config.json").is_file():
        return path
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise MissingFileError(
            f"{config} names no base_model_name_or_path: cannot find the adapter's base model"
        )
    return resolve_model_path(base)


def lora_merge_reason(model) -> str | None:
    """None when :func:`merged_state_dict` can merge ``model``'s adapters exactly (a plain model, or
    peft LoRA on ``Linear`` layers: vanilla adapters, no DoRA or other variant, no LoRA bias, no
    ``modules_to_save`` copies); else why not."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return None  # without peft there are no adapters
    for name, module in hf_model(model).named_modules():
        if "modules_to_save" in name or "original_module" in name:
            return f"it trains full copies of some modules (modules_to_save: {name})"
        if not isinstance(module, LoraLayer):
            continue
        if type(module) is not LoraLinear or module.merged:
            kind = type(module).__name__ + (" (merged)" if module.merged else "")
            return f"{name} is a {kind}, not an unmerged LoRA Linear"
        for adapter in _active_adapters(module):
            if not vanilla_lora(module, adapter):
                why = "DoRA or another variant, a LoRA bias"
                return f"{name}'s adapter {adapter!r} is not vanilla LoRA ({why})"
    return None


def vanilla_lora(layer, adapter: str) -> bool:
    """Whether peft LoRA layer ``layer``'s ``adapter`` is plain ``s * B A`` LoRA: no DoRA or other
    variant, no LoRA bias."""
    return not (
        adapter in getattr(layer, "lora_variant", {})
        or layer.use_dora.get(adapter)
        or layer.lora_B[adapter].bias is not None
    )


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """``model``'s weights under the base model's parameter names, each LoRA layer's weight with its
    active adapters added (``W + scaling * B @ A``, peft's ``get_delta_weight``, as peft's merge does):
    what an inference engine without adapters loads. The model itself is not changed; weights
    without an adapter are returned as they are (no copy). Plain models: their ``state_dict``.

    A model sharded by FSDP2 (DTensor weights) gets every weight and delta whole on every rank:
    each rank must call this, as it gathers one tensor at a time in the state dict's order."""
    inner = hf_model(model)
    state = inner.state_dict()
    if (why := lora_merge_reason(model)) is not None:
        raise ValueError(f"cannot merge this model's adapters into plain weights: {why}")
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        LoraLayer = ()  # no peft installed: no adapter layers
    layers = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    out = {}
    for key, tensor in state.items():
        if ".lora_" in key:
            continue  # lora_A / lora_B / lora_embedding_*: folded into the base weight below
        tensor = _whole(tensor)
        name, _, leaf = key.rpartition(".")
        owner = name.removesuffix(".base_layer")
        if owner in layers and name.endswith(".base_layer") and leaf == "weight":
            module = layers[owner]
            with torch.no_grad():
                for adapter in _active_adapters(module):
                    tensor = tensor + _whole(module.get_delta_weight(adapter)).to(tensor.dtype)
        out[f"{owner}.{leaf}" if name.endswith(".base_layer") else key] = tensor
    return out


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) gathered whole -- a collective --; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _active_adapters(layer) -> list[str]:
    """The adapters a peft LoRA layer's forward applies (none while adapters are disabled)."""
    if layer.disable_adapters:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


_ACCEPTS: dict[tuple[type, str], bool] = {}


def hf_model(model):
    """The Hugging Face model under a DistributedDataParallel wrapper and a peft model (whose layers
    keep their adapters); ``model`` itself otherwise."""
    inner = getattr(model, "module", model)  # DDP
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft


def accepts_kwarg(model, name: str) -> bool:
    """Does ``model.forward`` take keyword ``name``? (``logits_to_keep``, ``cache`` vs ``past_key_values``
    differ across transformers versions and architectures.) Cached per model class."""
    target = hf_model(model)  # peft's forward takes **kwargs
    key = (type(target), name)
    if key not in _ACCEPTS:
        _ACCEPTS[key] = name in inspect.signature(target.forward).parameters
    return _ACCEPTS[key]


# Decoders with Llama's layout: pre-norm RMSNorm blocks, rotary positions, grouped-query attention,
# a SiLU-gated MLP, logits = lm_head(norm(hidden)) unless the config caps or scales them
# (:func:`logit_transform`). The sampler's own decode path, the fused layers, the loss's fused head,
# padding-free packing and prompt sharing serve these families.
LLAMA_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def family_reason(config) -> str | None:
    """Why ``config``'s model (None: no config) is not one of :data:`LLAMA_FAMILIES`, or None."""
    family = getattr(config, "model_type", None)
    if family not in LLAMA_FAMILIES:
        return f"model_type {family!r} is not one of {LLAMA_FAMILIES}"
    return None


def logit_transform(config) -> str | None:
    """How ``config``'s model changes its logits after the head (a soft cap or a scale), or None."""
    for key in ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"the model scales or caps its logits ({key}={getattr(config, key)})"
    return None


def fused_head_reason(model) -> str | None:
    """None when the trainer may compute log-probs from the hidden states and the LM head
    (``algo.hidden_token_logprobs``, the full [B, T, V] logits never formed); else why not."""
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    if (why := family_reason(config) or logit_transform(config)) is not None:
        return why
    head = inner.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"its output head is a {type(head).__name__}, not a Linear layer"
    if type(head.weight.data) is not torch.Tensor and not _whole_after_forward(inner, head):
        return "its output head is sharded (FSDP) outside the root unit: not whole after the forward"
    return None


def _whole_after_forward(model, head: torch.nn.Module) -> bool:
    """Whether an FSDP2-sharded ``head`` is whole once ``model``'s forward has run: ``model`` is the
    root FSDP unit and the head belongs to it (no unit of its own in between), and FSDP2 leaves the
    root unit's parameters unsharded after its forward, for the backward that follows
    (``train.distributed.shard`` shards this way). ``completion_logprobs`` checks it at every use."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    owner = {m: name for name, m in model.named_modules()}.get(head)
    if not isinstance(model, FSDPModule) or owner is None or isinstance(head, FSDPModule):
        return False
    parts = owner.split(".")
    between = (model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts)))
    return not any(isinstance(m, FSDPModule) for m in between)


def packing_reason(model) -> str | None:
    """None when the trainer may pack micro-batches without padding (``train.packing``): the model's
    family builds its attention mask with transformers' packed-sequence detection (attention mask
    None, position ids restarting at 0 per sequence); else why not."""
    inner = hf_model(model)
    if (why := family_reason(getattr(inner, "config", None))) is not None:
        return why
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return "this transformers version does not detect packed sequences from position ids"
    return None


def sliding_window(config) -> int | None:
    """The sliding window of ``config``'s attention layers (keys more than this many positions back
    are not attended), or None when no layer has one (no window, ``use_sliding_window: false``, or
    ``layer_types`` without a sliding layer)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def prompt_sharing_reason(model) -> str | None:
    """None when the trainer may compute each prompt once for all its rows (``train.share_prompts``):
    a family whose layers call transformers' attention interface, which
    :mod:`grpokit.models.shared_prompts` routes to its own SDPA attention; else why not. A sliding
    window does not stop it: that attention skips its cut, so :func:`grpokit.train.batch.collate`
    shares only micro-batches whose rows fit inside the window (``SharingCosts.window``), where the
    window cuts nothing."""
    inner = hf_model(model)
    config = getattr(inner, "config", None)
    if (why := family_reason(config)) is not None:
        return why
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        return f"its attention implementation is {attn!r}, not 'sdpa' (the shared-prompt attention is SDPA)"
    return None


class SharingCosts(NamedTuple):
    """What ``train.batch.collate`` weighs to share a micro-batch's prompts: FLOPs per token of the
    decoder layers' matmuls, FLOPs per attended query-key pair, and the sliding window (None: none)
    that every shared row (prompt + completion) must fit in."""

    token: float
    pair: float
    window: int | None = None


def prompt_sharing_costs(model) -> SharingCosts:
    """The :class:`SharingCosts` of one forward of ``model``, for ``train.batch.sharing_pays`` to
    compare layouts: 2 per weight of the layers, and 4 per head dim per head per layer (the scores
    and the weighted sum)."""
    inner = hf_model(model)
    config = inner.config
    weights = sum(p.numel() for p in inner.model.layers.parameters() if p.dim() == 2)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return SharingCosts(
        2.0 * weights, 4.0 * heads * head_dim * config.num_hidden_layers, sliding_window(config)
    )


class head_returns_hidden:
    """Within this context the model's output head returns its input: the model's ``logits`` are the
    last hidden states, for :func:`grpokit.algo.hidden_token_logprobs` to project block by block."""

    def __init__(self, model) -> None:
        self.head = getattr(model, "module", model).get_output_embeddings()

    def __enter__(self) -> torch.nn.Linear:
        self.saved = self.head.__dict__.get("forward")
        self.head.forward = lambda hidden: hidden
        return self.head

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            del self.head.forward
        else:
            self.head.forward = self.saved
