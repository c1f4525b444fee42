"""RMSNorm and the SwiGLU MLP of Llama-family decoders as autograd functions that save less.

What it does: :func:`fuse_layers` rebinds the ``forward`` of a model's RMSNorm modules and MLPs
(families in :data:`~grpokit.models.loading.LLAMA_FAMILIES`) to :class:`RMSNormFn` and
:class:`SwiGLUDownFn`. Their forward values are Hugging Face's, bit for bit (the same operators in
the same dtypes; checked on the model's own first modules before anything is rebound); their
backward computes the same gradient from fewer saved tensors:

- RMSNorm ``y = w * (x / sqrt(mean(x^2) + eps))`` (Zhang & Sennrich 2019; HF computes it in
  float32 and casts back before the scale): autograd keeps ``x`` and the normalised ``x_hat``;
  this keeps ``x`` and the per-row ``rstd = 1 / sqrt(mean(x^2) + eps)`` and rebuilds ``x_hat`` in
  backward. Gradient: ``dw = sum(g * x_hat)``, ``dx = rstd * (gh - x_hat * mean(gh * x_hat))`` with
  ``gh = g * w``.
- The MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020): autograd keeps ``gate``, ``silu(gate)``,
  ``up`` and their product (the down projection's input), four ``[tokens, intermediate]`` tensors;
  this keeps ``gate`` and ``up`` and recomputes the product in backward (elementwise, no matmul).
  The gradient is autograd's own operators (``silu_backward``, the two matmuls of a linear layer
  in its layouts), so it is bit for bit autograd's in float32.

At 8 layers x 512 hidden x 1376 intermediate, autograd saves 0.63x the bytes (322 -> 202 MiB over
16 x 64 tokens; ``benchmarks/bench_memory.py``, docs/benchmarks.md). The gate and up
projections are still called as modules (LoRA on them works); the down projection's weight is
used directly, so the MLP is rebound only where ``down_proj`` is a plain bias-free ``Linear``
with no hooks.

What it deliberately does not do: touch attention or rotary embeddings, or any family whose
norm or MLP is not HF's Llama formula (checked, not assumed); recompute any matmul.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from grpokit.models.loading import family_reason, hf_model


class RMSNormFn(torch.autograd.Function):
    """``weight * (x * rstd).to(x.dtype)`` with ``rstd`` computed in ``compute`` dtype (HF: float32);
    saves ``x`` and ``rstd`` only."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, compute: torch.dtype):
        xc = x.to(compute)
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.compute = compute
        return weight * (xc * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(ctx.compute) * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * x_hat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gh = (g * weight).to(ctx.compute)
        grad_x = rstd * (gh - x_hat * (gh * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None, None


class SwiGLUDownFn(torch.autograd.Function):
    """``linear(silu(gate) * up, weight)``, in the autocast dtype when autocast is on (as
    ``F.linear`` would run); saves ``gate`` and ``up``, not ``silu(gate)`` nor the product."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        device = gate.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.cast = cast
        ctx.save_for_backward(gate, up, weight)
        h = F.silu(gate) * up
        with torch.autocast(device, enabled=False):
            if cast is not None:
                h, weight = h.to(cast), weight.to(cast)
            return F.linear(h, weight)

    @staticmethod
    def backward(ctx, g):
        gate, up, weight = ctx.saved_tensors
        with torch.autocast(gate.device.type, enabled=False):
            s = F.silu(gate)
            h = s * up
            w = weight if ctx.cast is None else weight.to(ctx.cast)
            if ctx.cast is not None:
                h = h.to(ctx.cast)
            g2 = g.reshape(-1, g.shape[-1])
            grad_h = g2.mm(w).view(*g.shape[:-1], w.shape[1]).to(up.dtype)
            grad_w = (
                g2.t().mm(h.reshape(-1, h.shape[-1])).to(weight.dtype) if ctx.needs_input_grad[2] else None
            )
            grad_up = grad_h * s
            grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        return grad_gate, grad_up, grad_w


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return RMSNormFn.apply(x, self.weight, self.variance_epsilon, torch.float32)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return SwiGLUDownFn.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def _plain_linear(layer) -> bool:
    return (
        type(layer) is torch.nn.Linear
        and layer.bias is None
        and "forward" not in vars(layer)
        and not (layer._forward_hooks or layer._forward_pre_hooks)
    )


def _same_forward(module, fused, width: int) -> bool:
    """Does ``fused`` give the module's own forward, bit for bit, on a seeded random input?"""
    param = next(module.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, width, generator=gen).to(param.device, param.dtype)
    with torch.no_grad():
        return torch.equal(type(module).forward(module, x), fused(module, x))


def fuse_layers(model) -> str | None:
    """Rebind the RMSNorm and MLP forwards of ``model`` (see the module docstring), in place;
    bound per module, so a deep copy (the reference model) keeps them. Returns None when both
    were rebound, else why one or both were left as they are."""
    inner = hf_model(model)
    config = getattr(inner, "config", None)
    if (why := family_reason(config)) is not None:
        return why
    norms = [
        m for m in inner.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")
    ]
    mlps = [m for m in inner.modules() if type(m).__name__.endswith("MLP") and hasattr(m, "gate_proj")]
    reasons = []
    if not norms or any("forward" in vars(m) for m in norms):
        reasons.append("its RMSNorm modules are missing or already replaced")
    elif not _same_forward(norms[0], _norm_forward, norms[0].weight.shape[-1]):
        reasons.append(f"{type(norms[0]).__name__} does not compute HF's Llama RMSNorm")
    else:
        for m in norms:
            m.forward = types.MethodType(_norm_forward, m)
    if getattr(config, "hidden_act", None) != "silu":
        reasons.append(f"its MLP activation is {getattr(config, 'hidden_act', None)!r}, not silu")
    elif not mlps or any("forward" in vars(m) for m in mlps):
        reasons.append("its MLP modules are missing or already replaced")
    elif not all(_plain_linear(m.down_proj) for m in mlps):
        reasons.append("its MLP down projections are not plain bias-free Linear layers")
    elif not _same_forward(mlps[0], _mlp_forward, mlps[0].gate_proj.in_features):
        reasons.append(f"{type(mlps[0]).__name__} does not compute down(silu(gate(x)) * up(x))")
    else:
        for m in mlps:
            m.forward = types.MethodType(_mlp_forward, m)
    return "; ".join(reasons) or None


def saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward of ``model`` over ``ids`` (each
    storage counted once, parameters excluded): what :func:`fuse_layers` reduces."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).logits.sum().backward()
    return sum(v for k, v in seen.items() if k not in params)
