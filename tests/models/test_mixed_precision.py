"""bfloat16 autocast (model.autocast): float32 logits, a reference with its own head, a real run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpokit.config import load_config
from grpokit.models.loading import keep_head_float32, load_model, mixed_precision, reference_copy
from grpokit.models.tiny import tiny_config
from grpokit.rollout.sampler import SamplingParams, sample
from grpokit.train.trainer import GRPOTrainer
from tests.helpers import varied


def test_head_stays_float32_under_autocast_and_the_body_does_not(tiny_dir):
    model, _ = load_model(str(tiny_dir))
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(ids).logits
        with mixed_precision("cpu", "bfloat16"):
            plain = model(ids).logits
            keep_head_float32(model)
            kept = model(ids).logits
    assert plain.dtype == torch.bfloat16 and kept.dtype == torch.float32
    # the body ran in bfloat16 (not float32), the head in float32: closer than bf16 logits, not exact
    assert 0 < (kept - exact).abs().max() < (plain.float() - exact).abs().max()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, exact)  # outside autocast nothing changed
    assert mixed_precision("cpu", None).__enter__() is None  # null: a no-op context


def test_reference_copy_keeps_its_own_float32_head(tiny_dir):
    model, _ = load_model(str(tiny_dir))
    keep_head_float32(model)
    ref = reference_copy(model)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = ref(ids).logits
        model.get_output_embeddings().weight.add_(1.0)  # the policy moves; the copy must not see it
        with mixed_precision("cpu", "bfloat16"):
            assert ref(ids).logits.dtype == torch.float32
        assert torch.equal(ref(ids).logits, before)
        assert not torch.equal(model(ids).logits, before)


def _body_linears(model) -> list[torch.nn.Linear]:
    """The model's Linear layers but its output head."""
    head = model.get_output_embeddings()
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_a_reference_under_autocast_stores_its_linear_weights_in_the_autocast_dtype(family, tied):
    """reference_copy(model, bfloat16): every Linear but the head in bfloat16 (Qwen2's q/k/v
    biases too), everything else as it was; under autocast the same logits, bit for bit, as a
    float32 copy (autocast casts the float32 copy's weights to exactly those values at every
    forward)."""
    torch.manual_seed(5)
    if family == "llama":
        config = tiny_config(40, hidden_size=32)
        config.tie_word_embeddings = tied
        model = LlamaForCausalLM(config).eval()
    else:
        config = Qwen2Config(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config).eval()
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    keep_head_float32(model)
    plain, cast = reference_copy(model), reference_copy(model, torch.bfloat16)
    head = cast.get_output_embeddings()
    linears = _body_linears(cast)
    assert len(linears) == 7 * config.num_hidden_layers
    assert all(p.dtype == torch.bfloat16 for m in linears for p in m.parameters())
    others = [p for p in cast.parameters() if not any(p is q for m in linears for q in m.parameters())]
    assert others and all(p.dtype == torch.float32 for p in others)  # head, embeddings, norms
    assert (head.weight is cast.get_input_embeddings().weight) == tied
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the policy untouched
    ids = torch.randint(3, 40, (3, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), mixed_precision("cpu", "bfloat16"):
        want, got = plain(ids).logits, cast(ids).logits
    assert got.dtype == torch.float32 and torch.equal(got, want)
    size = sum(p.nbytes for p in cast.parameters())
    assert size < 0.75 * sum(p.nbytes for p in plain.parameters())


def _autocast_config(tmp_path, tiny_dir, **sets):
    """A run of the tiny model under bfloat16 autocast, with ``sets`` (dotted keys) on top."""
    sets = {
        "model.name_or_path": str(tiny_dir),
        "model.autocast": "bfloat16",
        "train.output_dir": str(tmp_path / "run"),
        "train.quiet": True,
        **sets,
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def _ref_run_config(tmp_path, tiny_dir, **more):
    return _autocast_config(
        tmp_path, tiny_dir,
        **{
            "train.max_steps": 1, "train.prompts_per_step": 2, "rollout.group_size": 2,
            "rollout.max_new_tokens": 4, "train.eval_every": 0, "algo.beta": 0.04, **more,
        },
    )  # fmt: skip


def test_the_trainer_keeps_a_frozen_reference_in_the_autocast_dtype_and_a_moving_one_float32(
    tmp_path, tiny_dir
):
    def dtypes(trainer):
        return {m.weight.dtype for m in _body_linears(trainer.ref_model)}

    assert dtypes(GRPOTrainer(_ref_run_config(tmp_path, tiny_dir), rewards=[varied])) == {torch.bfloat16}
    moving = _ref_run_config(tmp_path, tiny_dir, **{"algo.ref_sync_every": 2})
    assert dtypes(GRPOTrainer(moving, rewards=[varied])) == {torch.float32}  # mixes in float32
    plain = _ref_run_config(tmp_path, tiny_dir, **{"model.autocast": None})
    assert dtypes(GRPOTrainer(plain, rewards=[varied])) == {torch.float32}


def test_a_run_under_bfloat16_autocast_trains_float32_weights(tmp_path, tiny_dir):
    sets = {
        "train.max_steps": 2,
        "train.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "rollout.temperature": 1.2,
        "train.eval_max_prompts": 8,
        "algo.beta": 0.04,
        "train.mu": 2,
    }
    cfg = _autocast_config(tmp_path, tiny_dir, **sets)
    trainer = GRPOTrainer(cfg, rewards=[varied])  # spread in every group: a real update
    start = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    summary = trainer.train()
    assert summary["steps"] == 2
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert any(not torch.equal(start[k], v) for k, v in trainer.model.named_parameters())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert all(isinstance(r[k], float) and r[k] == r[k] for k in ("loss", "kl", "grad_norm"))
        assert r["ratio_max"] > 0


def test_every_forward_under_autocast_uses_the_weights_as_they_are(tmp_path, tiny_dir):
    """One train step runs in one autocast context, and autocast keeps its bfloat16 casts of the
    weights until the context ends. With several optimizer steps per generation (mu = 2 here), a
    forward after the first optimizer step must not compute with those stale casts."""
    sets = {
        "train.max_steps": 1,
        "train.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "rollout.temperature": 1.2,
        "train.eval_every": 0,
        "train.mu": 2,
        "train.lr": 1e-2,
    }
    cfg = _autocast_config(tmp_path, tiny_dir, **sets)
    trainer = GRPOTrainer(cfg, rewards=[varied])
    proj = next(m for n, m in trainer.model.named_modules() if n.endswith("q_proj"))
    seen = []  # per call: (the weight then, whether the output is that weight's bfloat16 product)

    def check(module, args, out):
        x, w, b = args[0], module.weight.detach(), module.bias
        b = None if b is None else b.bfloat16()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            fresh = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), b)
        seen.append((w.clone(), torch.equal(out, fresh)))

    proj.register_forward_hook(check)
    trainer.train()
    moved = [i for i in range(1, len(seen)) if not torch.equal(seen[i][0], seen[0][0])]
    assert moved, "no forward ran after an optimizer step"
    assert all(same for _, same in seen)


def test_weight_casts_made_while_sampling_still_carry_the_gradient(tiny_dir):
    """Under autocast the sampler runs under no_grad, and autocast keeps the bfloat16 casts of the
    weights it made there for the train step's forward: the gradients must be those of casts made
    with gradients on."""
    model, tok = load_model(str(tiny_dir))
    keep_head_float32(model)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, decode="hf")

    def grads(sample_first: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mixed_precision("cpu", "bfloat16"):
            if sample_first:
                sample(model, tok, ["sort:12="], 2, params, torch.Generator().manual_seed(0))
            model(ids).logits.logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    fresh, after_sampling = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(fresh, after_sampling, strict=True))
