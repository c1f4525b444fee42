"""model.fused_layers: RMSNorm and the SwiGLU MLP as autograd functions that save fewer tensors.

The formulas are checked against float64 references written from the papers (and gradcheck's
finite differences); the rebound modules against HF's own: forward bit for bit, gradients to
float32 rounding, the MLP's gradients bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from grpokit.models.fused_layers import RMSNormFn, SwiGLUDownFn, fuse_layers, saved_bytes

BODY = dict(
    vocab_size=40, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(BODY | kw)))
    with torch.no_grad():  # norms away from 1, so a gradient that ignores their weight is caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=_gen(len(name))))
    return model


@pytest.mark.parametrize("shape", [(3, 5, 16), (2, 4, 3, 8)])  # [B, T, D], Qwen3's per-head [B, T, H, D]
def test_rms_norm_matches_float64_reference(shape):
    # Zhang & Sennrich 2019: y = w * x / sqrt(mean(x^2) + eps), computed here in float64 throughout
    x = (3 * torch.randn(shape, generator=_gen(1), dtype=torch.float64)).requires_grad_()
    w = torch.randn(shape[-1], generator=_gen(2), dtype=torch.float64).requires_grad_()
    g = torch.randn(shape, generator=_gen(3), dtype=torch.float64)
    eps = 1e-5
    ref = w * x / torch.sqrt((x * x).sum(-1, keepdim=True) / shape[-1] + eps)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), g)
    out = RMSNormFn.apply(x, w, eps, torch.float64)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFn.apply(a, b, eps, torch.float64), (x, w))


def test_swiglu_down_matches_float64_reference():
    # Shazeer 2020: down(silu(gate) * up), silu(z) = z * sigmoid(z)
    gate = (2 * torch.randn(3, 5, 12, generator=_gen(4), dtype=torch.float64)).requires_grad_()
    up = torch.randn(3, 5, 12, generator=_gen(5), dtype=torch.float64).requires_grad_()
    w = torch.randn(7, 12, generator=_gen(6), dtype=torch.float64).requires_grad_()
    g = torch.randn(3, 5, 7, generator=_gen(7), dtype=torch.float64)
    ref = ((gate * torch.sigmoid(gate)) * up) @ w.T
    refs = torch.autograd.grad(ref, (gate, up, w), g)
    out = SwiGLUDownFn.apply(gate, up, w)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out, (gate, up, w), g), refs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(SwiGLUDownFn.apply, (gate, up, w))


@pytest.mark.parametrize("autocast", [False, True])
def test_swiglu_down_is_autograd_bit_for_bit(autocast):
    # the same operators as HF's MLP under autograd, in the same dtypes: values and all three gradients
    gate = torch.randn(4, 6, 24, generator=_gen(8)).requires_grad_()
    up = torch.randn(4, 6, 24, generator=_gen(9)).requires_grad_()
    w = torch.randn(10, 24, generator=_gen(10)).requires_grad_()
    g = torch.randn(4, 6, 10, generator=_gen(11))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        gate_in, up_in = (gate.bfloat16(), up.bfloat16()) if autocast else (gate, up)
        ref = F.linear(F.silu(gate_in) * up_in, w)
        out = SwiGLUDownFn.apply(gate_in, up_in, w)
    g = g.to(ref.dtype)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    for got, want in zip(
        torch.autograd.grad(out, (gate, up, w), g), torch.autograd.grad(ref, (gate, up, w), g), strict=True
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_rebound_norm_is_hf_forward_bit_for_bit(x_dtype):
    # bfloat16 inputs with a float32 weight: Qwen3's q/k norms under autocast
    model = _llama()
    norm = model.model.layers[0].input_layernorm
    assert fuse_layers(model) is None and "forward" in vars(norm)
    x = (4 * torch.randn(3, 7, 32, generator=_gen(12))).to(x_dtype).requires_grad_()
    g = torch.randn(3, 7, 32, generator=_gen(13))
    ours, hf = norm(x), type(norm).forward(norm, x)
    assert ours.dtype == hf.dtype and torch.equal(ours, hf)
    got = torch.autograd.grad(ours, (x, norm.weight), g)
    want = torch.autograd.grad(hf, (x, norm.weight), g)
    tol = 1e-5 if x_dtype == torch.float32 else 1e-2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_model_gives_hf_logits_and_gradients_with_fewer_saved_bytes(family, autocast):
    plain = _llama(1) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**BODY, head_dim=8))
    fused = copy.deepcopy(plain)
    assert fuse_layers(fused) is None
    ids = torch.randint(0, 40, (3, 11), generator=_gen(14))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want, got = plain(ids).logits, fused(ids).logits
        assert torch.equal(got, want)
        g = torch.randn(want.shape, generator=_gen(15)).to(want.dtype)
        grads = [
            torch.autograd.grad(out, list(m.parameters()), g) for out, m in ((got, fused), (want, plain))
        ]
    tol = 1e-2 if autocast else 1e-4
    for (name, _), a, b in zip(plain.named_parameters(), *grads, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(), msg=name)
    assert saved_bytes(fused, ids) < 0.75 * saved_bytes(plain, ids)


def test_fusing_survives_a_deep_copy_and_stays_off_the_class():
    model = _llama()
    fuse_layers(model)
    ref = copy.deepcopy(model)
    norm, mlp = ref.model.norm, ref.model.layers[1].mlp
    assert norm.forward.__self__ is norm and mlp.forward.__self__ is mlp  # the copy's own modules
    assert "forward" not in vars(_llama().model.norm)  # other models of the class are untouched
    assert fuse_layers(model) == (
        "its RMSNorm modules are missing or already replaced; its MLP modules are missing or already replaced"
    )


def test_refusals_name_the_reason():
    gelu = _llama(hidden_act="gelu")
    assert fuse_layers(gelu) == "its MLP activation is 'gelu', not silu"
    assert "forward" in vars(gelu.model.norm) and "forward" not in vars(gelu.model.layers[0].mlp)

    hooked = _llama()
    hooked.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert fuse_layers(hooked) == "its MLP down projections are not plain bias-free Linear layers"

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2))
    assert fuse_layers(gpt2).startswith("model_type 'gpt2' is not one of")


def test_a_norm_that_is_not_hf_llama_formula_is_left_alone(monkeypatch):
    # a Gemma-style (1 + w) scale under the Llama class name: the start-up check sees the difference
    from transformers.models.llama import modeling_llama

    def gemma_like(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (1 + self.weight) * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", gemma_like)
    model = _llama()
    assert fuse_layers(model) == "LlamaRMSNorm does not compute HF's Llama RMSNorm"
    assert "forward" not in vars(model.model.norm)


def test_lora_on_the_down_projection_keeps_the_mlp_and_fuses_the_norms():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    assert fuse_layers(lora) == "its MLP down projections are not plain bias-free Linear layers"
    base = lora.get_base_model()
    assert "forward" in vars(base.model.norm)
    ids = torch.randint(0, 40, (2, 6), generator=_gen(16))
    lora(ids).logits.sum().backward()  # adapters still train through the rebound norms
    assert all(p.grad is not None for n, p in lora.named_parameters() if p.requires_grad)

    up = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in up.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # adapters that change the output
    plain = copy.deepcopy(up)
    assert fuse_layers(up) is None  # up_proj is still called as a module: its adapter applies
    assert torch.equal(up(ids).logits, plain(ids).logits)
    assert not torch.equal(up(ids).logits, _llama()(ids).logits)
