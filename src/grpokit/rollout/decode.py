"""grpokit's own forward for sampling from Llama-family decoders, with a preallocated KV cache.

What it does: for the families in :data:`~grpokit.models.loading.LLAMA_FAMILIES` (Llama, Qwen2,
Qwen3, Mistral: pre-norm RMSNorm blocks, rotary positions, grouped-query attention, a SiLU-gated
MLP, logits = ``lm_head(norm(h))``)
:class:`OwnDecoder` runs the model's own weights with a few tensor operations per layer instead
of the Hugging Face module tree, and keeps the keys and values in one buffer per layer, allocated
once at the prompt pass for the prompt plus every new token and written in place (no per-step
``torch.cat``, no cache object, no mask rebuilt per step). Queries of one kv head's group are
packed into one attention call, so grouped-query attention never repeats the keys. The operations
and their dtypes are HF's (RMSNorm in float32, rotary from the model's own ``rotary_emb`` -- every
rope scaling HF implements --, SDPA, the output head called as a module so ``keep_head_float32``
holds), under autocast too; tests check greedy and same-uniform sampled tokens against the HF path.
On a CPU, the projections with at least :data:`PACK_NUMEL` weights and a float32 head run oneDNN's
matmul on copies of their weights reordered once per call into its blocked layout (:class:`Packed`),
faster than F.linear's MKL product for a decode step's few rows (same tokens in the tests, logits
to float32 rounding).
When the G rows' copies of the prompts' keys would be large (:data:`SHARE_BYTES`; on a CPU), the
cache holds each prompt's keys once (:class:`SharedPrefix`) and a step's attention is split: a
group's queries attend to their prompt together, each row to its own tokens, merged by the two
log-sum-exps (:func:`_prefix_attention`; exact in float64, another rounding in float32 and bfloat16).
Under peft's vanilla LoRA (one active, unmerged adapter) each adapted projection runs peft's own
arithmetic, ``x W^T + b + s * (x A^T) B^T``; on a CPU its base product ``x W^T + b`` is packed like a
plain projection's (q/k/v and gate/up bases then fused into one product each, their adapters one
stacked A and block-diagonal B), the adapters' small products stay ``F.linear``. The tokens are
the HF path's (tested).

:class:`HFDecoder` is the same interface over the model's own forward and cache: every other
architecture, DoRA and other LoRA variants, merged or several adapters, sharded weights, sliding
windows the sequence outgrows.
:func:`decoder_for` picks one; :func:`own_decoder_reason` says why a model cannot use its own path.

Multi-turn episodes (``rollout.episodes``) use the same decoders: :meth:`OwnDecoder.feed` runs each
row's chunk of pending tokens (its sampled token and an environment's observation), right-padded,
the padding's cache slots masked for good; the cache grows (doubling) when padding outruns it.

What it deliberately does not do: training forwards (the trainer uses the HF model, with autograd),
or ``torch.compile``
(its one-token step measured slower on a 2-core CPU for the tiny model and SmolLM2, by 16-26% on
SmolLM2, after minutes of compiling, and it changes bfloat16 tokens: ``bench_rollout.py --compile``,
docs/benchmarks.md).

Shape legend: P prompts, G group size, b rows being decoded, L prompt length, S keys so far,
C cache capacity (L + max new tokens), H query heads, K kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpokit.models.loading import (
    family_reason,
    hf_model,
    kept_float32,
    logit_transform,
    sliding_window,
    vanilla_lora,
)


def own_decoder_reason(model, capacity: int | None = None, gathered: bool = False) -> str | None:
    """None when :class:`OwnDecoder` can sample from ``model`` (sequences up to ``capacity`` tokens);
    else the reason it cannot, for the one-line note the trainer prints. ``gathered``: the caller
    decodes with FSDP's shards gathered (``train.distributed.full_parameters``), so sharded weights
    are no reason."""
    inner = hf_model(model)
    config = getattr(inner, "config", None)
    if (why := family_reason(config)) is not None:
        return why
    if getattr(config, "hidden_act", None) != "silu":
        return f"its MLP activation is {getattr(config, 'hidden_act', None)!r}, not silu"
    if (why := logit_transform(config)) is not None:
        return why
    window = sliding_window(config)
    if window is not None and (capacity is None or capacity > window):
        return f"sliding-window attention (window {window}) that the sequence may outgrow"
    base = getattr(inner, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        return "it does not have the model.layers / rotary_emb / embed_tokens layout of its family"
    head, embed = inner.get_output_embeddings(), base.embed_tokens
    if type(head) is not torch.nn.Linear or type(embed) is not torch.nn.Embedding:
        return "its output head or embedding is not a plain Linear / Embedding (quantized or adapted)"
    for layer in layers:
        for x in _projections(layer):
            if type(x) is not torch.nn.Linear and (why := _lora_reason(x)) is not None:
                return why
    if not gathered and any(type(p.data) is not torch.Tensor for p in inner.parameters()):
        return "its weights are sharded (FSDP DTensors)"
    return None


def _lora_reason(layer) -> str | None:
    """None when ``layer`` is a projection :func:`_projection` reads: peft's LoRA ``Linear`` over a
    plain ``Linear`` with one active, unmerged, vanilla adapter (no DoRA or other variant, no LoRA
    bias, no dropout: grpokit sets every dropout to 0); else why not."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        LoraLinear = None
    if LoraLinear is None or type(layer) is not LoraLinear or type(layer.base_layer) is not torch.nn.Linear:
        return f"some of its projections are not plain or LoRA Linear layers ({type(layer).__name__})"
    active = list(layer.active_adapters)
    if layer.disable_adapters or layer.merged or len(active) != 1 or active[0] not in layer.lora_A:
        return "its LoRA layers are merged, disabled or run several adapters at once"
    name = active[0]
    dropout = layer.lora_dropout[name]
    if (
        not vanilla_lora(layer, name)
        or layer.fan_in_fan_out
        or not (isinstance(dropout, torch.nn.Identity) or getattr(dropout, "p", None) == 0)
    ):
        return "its LoRA adapters are not vanilla LoRA (DoRA or another variant, a LoRA bias, dropout)"
    return None


# (weight, bias) for F.linear, no module hooks; Packed; or Lora
Linear = tuple


class Packed(NamedTuple):
    """A projection whose weight oneDNN has reordered into its blocked matmul layout (see PACK_NUMEL)."""

    weight: torch.Tensor  # torch._mkldnn layout, [out, in]
    bias: torch.Tensor | None
    dtype: torch.dtype  # the inputs' dtype: cast to it by hand (autocast does not see oneDNN's op)


class Lora(NamedTuple):
    """peft's vanilla LoRA over a base projection (a (weight, bias) pair or :class:`Packed`), in
    peft's order: ``base(x) + (x A^T) B^T * scaling`` in the base output's dtype. A fused base (q/k/v
    or gate/up under packing) carries one adapter per adapted projection, each added to its own
    columns of the output, or their stack (:func:`_stacked`)."""

    base: Linear
    adapters: tuple  # ((A, B, scaling, start, stop), ...): the output columns [start, stop) it adds to


# On a CPU, a projection with at least this many weights runs oneDNN's matmul on a copy of its weight
# reordered once per sampler call into oneDNN's blocked layout (what PyTorch's own CPU inference
# compiler does with frozen weights), instead of F.linear's MKL matmul. Measured on a 2-core AMD EPYC
# (docs/benchmarks.md): for the 8-64 rows of a decode step the reordered product is 1.2-2.4x faster
# at SmolLM2's layer shapes, 2.4x for its [32, 576] x [576, 49152] head, and 1.2-1.8x at the 3M
# model's shapes; its ~14 us call overhead makes weights of the shipped tiny model's size slower.
# Values differ from F.linear's by rounding (another summation order): greedy tokens and sampled
# ones for the same uniforms stay HF's in float32 in the tests, log-probs to 1e-5.
PACK_NUMEL = 2**17

# Up to this many bytes of weights per call, a layer's q/k/v projections (and gate/up) are
# concatenated into one matmul each: small models pay per operation, not per flop, and the copy is
# made once per sampler call. Larger models use the weights as they are (no copy, no extra memory),
# unless they are packed for oneDNN (PACK_NUMEL), a copy anyway: then the concatenation is packed
# (SmolLM2's k and v, 110,592 entries each, would run F.linear alone; together with q, 4-14% more
# tokens per second in docs/benchmarks.md).
FUSE_BYTES = 64 * 2**20


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: list[Linear]  # [q, k, v], or one Linear giving all three
    o: Linear
    gate_up: list[Linear]  # [gate, up], or one Linear giving both
    down: Linear
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head's dims
    k_norm: torch.Tensor | None


@dataclass
class KVState:
    """The decoding batch: per layer keys / values [b, K, C, D] filled up to ``length``, the
    attention bias of each key position ([b, C] in the keys' dtype: -inf at the prompts' left
    padding and episodes' chunk padding, else 0: SDPA's own conversion of a bool mask, made once
    instead of per layer and step), each row's next position. With ``prefix`` (see
    :data:`SHARE_BYTES`) the prompts' keys live there, once per prompt, and ``keys`` /
    ``values`` / ``key_bias`` hold only the positions after the prompt."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_bias: torch.Tensor
    positions: torch.Tensor  # [b] long
    length: int
    padded: bool  # some key is masked (key_bias has -inf): False lets a step's attention skip the bias
    prefix: SharedPrefix | None = None


@dataclass
class SharedPrefix:
    """The prompts' keys and values, once per prompt: the G rows of a group attend to them together
    (:func:`_prefix_attention`). Rows sit in a grid of P x G slots, group after group, as the prompt
    pass made them; ``slots`` says which slot each row of the batch is once rows have left it."""

    keys: list[torch.Tensor]  # per layer [P, K, L, D], in the dtype attention computes in
    values: list[torch.Tensor]
    bias: torch.Tensor | None  # [P, 1, 1, L]: -inf at a prompt's left padding; None: no padding
    group: int  # G
    slots: torch.Tensor | None  # [b] long: each row's slot; None while the rows are every slot, in order

    def select(self, keep_b: torch.Tensor) -> SharedPrefix:
        """The prefix of the rows ``keep_b``: prompts none of them comes from are dropped (one copy
        of the remaining prompts' keys, so attention stops reading them)."""
        P, G = self.keys[0].shape[0], self.group
        every = torch.arange(P * G, device=keep_b.device)
        slots_b = (every if self.slots is None else self.slots)[keep_b]
        prompt_b = torch.div(slots_b, G, rounding_mode="floor")
        live_p = torch.unique(prompt_b)  # sorted
        keys, values, bias = self.keys, self.values, self.bias
        if len(live_p) < P:
            keys = [k.index_select(0, live_p) for k in keys]
            values = [v.index_select(0, live_p) for v in values]
            bias = None if bias is None else bias.index_select(0, live_p)
            renumber_P = torch.full((P,), -1, dtype=torch.long, device=keep_b.device)
            renumber_P[live_p] = torch.arange(len(live_p), device=keep_b.device)
            slots_b = renumber_P[prompt_b] * G + slots_b % G
        if len(slots_b) == len(live_p) * G and torch.equal(slots_b, every[: len(slots_b)]):
            slots_b = None
        return SharedPrefix(keys, values, bias, G, slots_b)


# A prompt pass of G >= 2 rows per prompt whose prompts' keys and values would take at least this
# many bytes per layer in a cache of every row keeps each prompt's keys once instead (SharedPrefix):
# a step's attention reads them once per group, for all G rows' queries together, attends to each
# row's own tokens apart, and merges the two by their log-sum-exps. Below it the extra operations per
# layer (a second attention call, the merge) cost more than the reading they save. Measured on a
# 2-core CPU at 32 rows (docs/benchmarks.md), a step broke even at 1.5 MiB for SmolLM2 in bfloat16
# (64-token prompts), 2 MiB for the shipped tiny model (256) and about 3 MiB for the 3M model (96).
# It needs the log-sum-exps of PyTorch's CPU flash attention (a CPU only).
SHARE_BYTES = 2 * 2**20


class OwnDecoder:
    """Prompt pass and one-token steps over a model's weights (see the module docstring)."""

    name = "own"
    keep_finished = 0.25  # finished rows stay in the batch until they are over this share of it

    def __init__(self, model, reorder: bool = True, share: bool = True) -> None:
        """``reorder`` False: no projection is packed for oneDNN (no weight copies; PACK_NUMEL).
        ``share`` False: the cache keeps G copies of each prompt's keys, whatever their size
        (SHARE_BYTES)."""
        inner = hf_model(model)
        config, base = inner.config, inner.model
        self.H, self.K = config.num_attention_heads, config.num_key_value_heads
        self.D = getattr(config, "head_dim", None) or config.hidden_size // self.H
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.rotary, self.norm, self.head = base.rotary_emb, base.norm.weight, inner.get_output_embeddings()
        # dynamic rope rescales with the sequence seen so far: it is asked per step, not tabled
        rope_type = str(getattr(self.rotary, "rope_type", "default"))
        self.rope_per_step = "dynamic" in rope_type or "longrope" in rope_type
        fused = 2 * sum(
            layer.self_attn.q_proj.weight.nbytes * 2 + layer.mlp.gate_proj.weight.nbytes * 2
            for layer in base.layers
        )  # about the bytes of the concatenated copies
        # under autocast, weights that autocast's cache does not keep (the fused copies, frozen
        # weights) are cast once here: the same values, not once per step (see _cast)
        device_type = self.embed.device.type
        cast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        pack = _pack_dtype(self.embed, cast) if reorder else None
        # packed weights are copies anyway, so concatenating them first costs no memory past the
        # call's one layer at a time (_maybe_fused: layers under LoRA are fused only when packed)
        fuse = fused <= FUSE_BYTES or pack is not None
        self.reorder, self.share = reorder, share
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    _maybe_fused([a.q_proj, a.k_proj, a.v_proj], fuse, cast, pack),
                    _projection(a.o_proj, cast, pack),
                    _maybe_fused([m.gate_proj, m.up_proj], fuse, cast, pack),
                    _projection(m.down_proj, cast, pack),
                    None if qn is None else qn.weight,
                    None if kn is None else kn.weight,
                )
            )
        self.rope = None  # [C, 2D] rotary table: cos | signed sin (see _signed), made at the prompt pass
        self._logits_buf: torch.Tensor | None = None  # see _logits
        self._head: Linear | None = None  # the float32 head as _pack leaves it (see _float32_logits)
        # whether a step leaves autocast a weight to cast (a trainable leaf F.linear reads as it is,
        # or a head called as a module): autocast keeps those casts only outside inference mode
        self.casts_weights = cast is not None and (
            not self._float32_head(autocast=True)
            or any(
                _autocast_casts(x, cast)
                for layer in self.layers
                for x in (*layer.qkv, layer.o, *layer.gate_up, layer.down)
            )
        )

    def prefill(
        self, ids_PL: torch.Tensor, mask_PL: torch.Tensor, group_size: int, capacity: int
    ) -> tuple[torch.Tensor, KVState]:
        """Run each prompt once; return the next-token logits [P*G, V] and a state whose cache holds
        each prompt's keys G times over, with room for ``capacity`` positions."""
        P, L = ids_PL.shape
        device = ids_PL.device
        if not self.rope_per_step:  # the model's own rotary module, asked once for every position
            probe = self.embed[:1][None]
            cos, sin = self.rotary(probe, torch.arange(capacity, device=device)[None])
            self.rope = torch.cat((cos[0], _signed(sin[0])), dim=-1)
        positions_PL = (mask_PL.long().cumsum(dim=1) - 1).clamp(min=0)
        causal_LL = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        eye_LL = torch.eye(L, dtype=torch.bool, device=device)
        # a padding query attends to itself only, so no row of the softmax is empty (NaN)
        attend_P1LL = ((causal_LL & mask_PL[:, None, :]) | eye_LL)[:, None]
        keys: list = [None] * len(self.layers)
        values: list = [None] * len(self.layers)
        hidden_Nd = self._forward(ids_PL, positions_PL, attend_P1LL, keys, values, 0, prefill=True)
        b = P * group_size
        positions_b = mask_PL.sum(dim=1).repeat_interleave(group_size)
        logits_PV = self._logits(hidden_Nd.view(P, L, -1)[:, -1])
        padded = not bool(mask_PL.all())
        if self.share and group_size > 1 and shares_prefix(keys[0], b):
            bias_P11L = None  # -inf at each prompt's left padding
            if padded:
                bias_P11L = keys[0].new_zeros((P, 1, 1, L)).masked_fill_(~mask_PL[:, None, None], -torch.inf)
            prefix = SharedPrefix(keys, values, bias_P11L, group_size, None)
            own = capacity - L  # the cache below holds the positions after the prompt
            keys = [k.new_empty((b, self.K, own, self.D)) for k in prefix.keys]
            values = [v.new_empty((b, self.K, own, self.D)) for v in prefix.values]
            state = KVState(keys, values, keys[0].new_zeros((b, own)), positions_b, 0, False, prefix)
            return logits_PV.repeat_interleave(group_size, dim=0), state
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            keys[i] = k.new_empty((b, self.K, capacity, self.D))
            values[i] = v.new_empty((b, self.K, capacity, self.D))
            keys[i][:, :, :L] = k.repeat_interleave(group_size, dim=0)
            values[i][:, :, :L] = v.repeat_interleave(group_size, dim=0)
        key_bias = keys[0].new_zeros((b, capacity))
        key_bias[:, :L].masked_fill_(~mask_PL.repeat_interleave(group_size, dim=0), float("-inf"))
        state = KVState(keys, values, key_bias, positions_b, L, padded)
        return logits_PV.repeat_interleave(group_size, dim=0), state

    def step(self, ids_b: torch.Tensor, state: KVState) -> torch.Tensor:
        """Feed one token per row; return the next-token logits [b, V]."""
        length, capacity = state.length + 1, state.key_bias.shape[1]
        if length > capacity:
            raise ValueError(f"the cache holds {capacity} positions; step {length} does not fit")
        # no key is masked until some row has padding: SDPA without a mask (the same values as with
        # an all-zero one, one addition fewer per score)
        attend_b11S = state.key_bias[:, None, None, :length] if state.padded else None
        hidden_bd = self._forward(
            ids_b[:, None], state.positions[:, None], attend_b11S, state.keys, state.values, state.length,
            prefix=state.prefix,
        )  # fmt: skip
        state.length, state.positions = length, state.positions + 1
        return self._logits(hidden_bd)

    def feed(self, ids_bw: torch.Tensor, real_bw: torch.Tensor, state: KVState) -> torch.Tensor:
        """Feed each row a chunk of tokens (multi-turn episodes: the sampled token, then an
        observation), right-padded to the longest (``real_bw`` False at padding); return the logits
        at each row's last real token [b, V]. Padding takes cache slots whose keys stay masked for
        every later query, and no positions: a row's positions count its real tokens only."""
        b, w = ids_bw.shape
        start = state.length
        self._reserve(state, start + w)
        if w == 1:
            return self.step(ids_bw[:, 0], state)
        length = start + w
        state.key_bias[:, start:length].masked_fill_(~real_bw, float("-inf"))  # slots past length are 0
        state.padded = state.padded or not bool(real_bw.all())
        slots_S = torch.arange(length, device=ids_bw.device)
        future_wS = slots_S[None] > start + torch.arange(w, device=ids_bw.device)[:, None]
        # a padding query sees the real keys before the chunk, so no softmax row is empty (NaN)
        attend_b1wS = state.key_bias[:, None, None, :length].masked_fill(future_wS, float("-inf"))
        positions_bw = state.positions[:, None] + (real_bw.long().cumsum(dim=1) - 1).clamp(min=0)
        hidden_Nd = self._forward(
            ids_bw, positions_bw, attend_b1wS, state.keys, state.values, start, prefix=state.prefix
        )
        n_b = real_bw.sum(dim=1)
        state.length, state.positions = length, state.positions + n_b
        return self._logits(hidden_Nd.view(b, w, -1)[torch.arange(b, device=ids_bw.device), n_b - 1])

    @staticmethod
    def _reserve(state: KVState, slots: int) -> None:
        """Grow the cache to hold ``slots`` positions (doubling, copied once) when it is too small:
        the padding inside episodes' chunks takes slots no capacity given up front can foresee."""
        capacity = state.key_bias.shape[1]
        if slots <= capacity:
            return
        grown = max(slots, 2 * capacity)

        def wider(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = grown
            out = t.new_zeros(shape)
            out.narrow(dim, 0, state.length).copy_(t.narrow(dim, 0, state.length))
            return out

        state.keys = [wider(k, 2) for k in state.keys]
        state.values = [wider(v, 2) for v in state.values]
        state.key_bias = wider(state.key_bias, 1)

    def select(self, state: KVState, keep_b: torch.Tensor) -> None:
        """Keep only rows ``keep_b`` (distinct indices) in the batch. They move to the front of the
        same buffers, filled slots only: a fresh buffer per drop page-faults its whole capacity again
        (a tiny-model call with room for 256 new tokens spent 0.95 ms in drops, against 0.18 ms with
        room for 64, for the same tokens)."""
        m, n = len(keep_b), state.length
        for t in (*state.keys, *state.values):
            t[:m, :, :n] = t[:, :, :n].index_select(0, keep_b)  # (gathered first, then written)
        state.key_bias[:m, :n] = state.key_bias[keep_b, :n]  # the slots past n are 0 in every row
        state.keys, state.values = [k[:m] for k in state.keys], [v[:m] for v in state.values]
        state.key_bias, state.positions = state.key_bias[:m], state.positions[keep_b]
        if state.prefix is not None:
            state.prefix = state.prefix.select(keep_b)

    def _logits(self, hidden_bd: torch.Tensor) -> torch.Tensor:
        """The next-token logits [b, V]. A float32 head (a plain one outside autocast, no hook, or
        :func:`~grpokit.models.loading.keep_head_float32`'s) is computed by :meth:`_float32_logits`;
        any other head is called as the module."""
        h_bd = _rms_norm(hidden_bd, self.norm, self.eps)
        device_type = h_bd.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if not self._float32_head(autocast):
            return self.head(h_bd)
        if not autocast:
            return self._float32_logits(h_bd)
        with torch.autocast(device_type, enabled=False):
            return self._float32_logits(h_bd.float())

    def _float32_head(self, autocast: bool) -> bool:
        """Whether :meth:`_logits` computes the head itself in float32 (else it calls the module)."""
        head = self.head
        return (
            type(head) is torch.nn.Linear
            and head.weight.dtype == torch.float32
            and not (head._forward_hooks or head._forward_pre_hooks)
            and (kept_float32(head) or ("forward" not in vars(head) and not autocast))
        )

    def _float32_logits(self, h_bd: torch.Tensor) -> torch.Tensor:
        """The float32 head's logits: packed for oneDNN (PACK_NUMEL), or else written into one buffer
        reused by every step, valid until the next call (a fresh [64, 151936] tensor per step costs
        its page faults again: 66.7 vs 54.3 ms per step)."""
        weight, bias = self.head.weight, self.head.bias
        if self._head is None:  # packed once per call (the decoder's life)
            self._head = _pack((weight, bias), _pack_dtype(weight, None) if self.reorder else None)
        if type(self._head) is Packed:
            return _linear(self._head, h_bd)
        b, V = h_bd.shape[0], weight.shape[0]
        if self._logits_buf is None or self._logits_buf.shape[0] < b:
            self._logits_buf = h_bd.new_empty((b, V))
        out_bV = torch.matmul(h_bd, weight.t(), out=self._logits_buf[:b])
        return out_bV if bias is None else out_bV.add_(bias)

    def _forward(self, ids, positions, attend, keys, values, start: int, prefill: bool = False, prefix=None):
        """The last hidden states [b*Q, d] of ``ids`` [b, Q] (rows in (b, Q) order). Every token is one
        row of 2-D tensors outside attention: a one-token step's projections, norms and rotary run
        without the Q dimension's views and transposes (10-15% of a step at the shipped model).
        ``prefix``: the prompts' keys are there, ``keys`` / ``values`` hold the later positions."""
        b, Q = ids.shape
        H, K, D = self.H, self.K, self.D
        x = F.embedding(ids.reshape(-1), self.embed)  # [N, d], N = b * Q
        if self.rope_per_step:
            cos, sin = self.rotary(x[None], positions.reshape(1, -1))
            cos, sin = cos[0][:, None], _signed(sin[0])[:, None]  # [N, 1, D]
        else:
            rope = self.rope[positions.reshape(-1)][:, None]  # one lookup for both tables
            cos, sin = rope[..., :D], rope[..., D:]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.in_norm, self.eps)
            if len(layer.qkv) == 1:
                qkv = _linear(layer.qkv[0], h).view(-1, H + 2 * K, D)
                q, k, v = qkv[:, :H], qkv[:, H : H + K], qkv[:, H + K :]
            else:
                q, k, v = (_linear(w, h).view(-1, n, D) for w, n in zip(layer.qkv, (H, K, K), strict=True))
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm, self.eps), _rms_norm(k, layer.k_norm, self.eps)
            if len(layer.qkv) == 1 and layer.q_norm is None:  # q and k rotated in one go
                qk = _rotate(qkv[:, : H + K], cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if prefix is not None:  # a step or a chunk, after a shared prompt
                keys[i][:, :, start : start + Q] = k.view(b, Q, K, D).transpose(1, 2)
                values[i][:, :, start : start + Q] = v.view(b, Q, K, D).transpose(1, 2)
                out = _prefix_attention(
                    q, prefix, i, keys[i][:, :, : start + Q], values[i][:, :, : start + Q], attend, b
                )
            elif Q == 1 and not prefill:  # one token per row
                keys[i][:, :, start] = k
                values[i][:, :, start] = v
                # the G = H / K query heads of a kv head are one query block
                out = F.scaled_dot_product_attention(
                    q.reshape(b, K, H // K, D), keys[i][:, :, : start + 1], values[i][:, :, : start + 1],
                    attn_mask=attend,
                )  # fmt: skip
                out = out.reshape(b, H * D)
            else:
                q, k, v = (t.view(b, Q, -1, D).transpose(1, 2) for t in (q, k, v))
                if prefill:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, enable_gqa=H != K)
                    # the cache holds keys in the dtype attention computes in (autocast's, under it):
                    # cast once as written, not the whole prefix again at every step; the same values
                    keys[i], values[i] = k.to(out.dtype), v.to(out.dtype)
                else:  # a chunk (:meth:`feed`)
                    keys[i][:, :, start : start + Q] = k
                    values[i][:, :, start : start + Q] = v
                    k_all, v_all = keys[i][:, :, : start + Q], values[i][:, :, : start + Q]
                    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attend, enable_gqa=H != K)
                out = out.transpose(1, 2).reshape(b * Q, H * D)
            x = x + _linear(layer.o, out)
            h = _rms_norm(x, layer.post_norm, self.eps)
            if len(layer.gate_up) == 1:
                gate, up = _linear(layer.gate_up[0], h).chunk(2, dim=-1)
            else:
                gate, up = (_linear(w, h) for w in layer.gate_up)
            x = x + _linear(layer.down, F.silu(gate) * up)
        return x


def shares_prefix(keys: torch.Tensor, rows: int) -> bool:
    """Whether a prompt pass of ``rows`` = P * G rows keeps each prompt's keys ``keys``
    [P, K, L, D] once (:data:`SHARE_BYTES`); the caller checks G >= 2."""
    return 2 * keys[0].nbytes * rows >= SHARE_BYTES and keys.device.type == "cpu" and flash_lse_available()


@functools.cache
def flash_lse_available() -> bool:
    """Whether this torch build has the CPU flash attention that returns its log-sum-exps (an
    internal PyTorch operator, the one SDPA runs on a CPU; without it prompts are not shared)."""
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _prefix_attention(q_NHD, prefix: SharedPrefix, layer: int, keys, values, attend, b: int) -> torch.Tensor:
    """Attention of ``q`` [b*Q, H, D] (rows in (b, Q) order) over [the row's prompt | its keys after
    the prompt], as [b*Q, H*D]. The softmax over both is split: per prompt, all its G rows' queries
    attend to its keys at once (one read of them); each row's queries attend to its own keys
    (``keys`` / ``values`` [b, K, S, D], ``attend`` [b, 1, Q, S] or None); the two outputs are merged
    by their log-sum-exps, ``o = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2) = lerp(o2, o1, sigmoid(l1 - l2))``,
    in float32 at least. Each part is never empty (a prompt has a real token; a row's own keys include its
    first new token), so both log-sum-exps are finite."""
    N, H, D = q_NHD.shape
    K, Q = keys.shape[1], N // b
    m = Q * (H // K)  # queries per row and kv head: the Q tokens' G = H / K heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # the query block of a row's kv head, in (Q, head) order; in the keys' dtype, as SDPA's autocast
    q_bKmD = q_NHD.to(keys.dtype).view(b, Q, K, H // K, D).transpose(1, 2).reshape(b, K, m, D)
    P, G = prefix.keys[layer].shape[0], prefix.group
    if prefix.slots is None:
        grid_bKmD = q_bKmD
    else:  # rows have left: their slots' queries are zeros, and their outputs are not read
        grid_bKmD = q_bKmD.new_zeros((P * G, K, m, D)).index_copy_(0, prefix.slots, q_bKmD)
    q_PKnD = grid_bKmD.view(P, G, K, m, D).transpose(1, 2).reshape(P, K, G * m, D)
    o1_PKnD, l1_PKn = flash(q_PKnD, prefix.keys[layer], prefix.values[layer], attn_mask=prefix.bias)
    o1_PGKmD = o1_PKnD.view(P, K, G, m, D).transpose(1, 2)  # views, in the rows' order
    l1_PGKm = l1_PKn.view(P, K, G, m).transpose(1, 2)
    if attend is not None and Q > 1:  # each token's mask row, for each of its heads
        S = attend.shape[-1]
        attend = attend[:, :, :, None].expand(b, 1, Q, H // K, S).reshape(b, 1, m, S)
    o2_bKmD, l2_bKm = flash(q_bKmD, keys, values, attn_mask=attend)
    if prefix.slots is None:  # the rows are the grid: merge on views, no copy of the prefix's outputs
        o1, l1 = o1_PGKmD, l1_PGKm
        o2, l2 = o2_bKmD.view(P, G, K, m, D), l2_bKm.view(P, G, K, m)
    else:
        o1, l1 = o1_PGKmD.reshape(P * G, K, m, D)[prefix.slots], l1_PGKm.reshape(P * G, K, m)[prefix.slots]
        o2, l2 = o2_bKmD, l2_bKm
    acc = torch.promote_types(keys.dtype, torch.float32)  # (float64 stays float64)
    out = torch.lerp(o2.to(acc), o1.to(acc), torch.sigmoid(l1 - l2).to(acc)[..., None])  # laid out as o2
    return out.to(keys.dtype).reshape(b, K, Q, H // K, D).transpose(1, 2).reshape(N, H * D)


def _projections(layer) -> tuple:
    """A decoder layer's seven projections: q, k, v, o, gate, up, down."""
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj


def _maybe_fused(
    linears: list[torch.nn.Module], fuse: bool, cast: torch.dtype | None, pack: torch.dtype | None
) -> list[Linear]:
    """The projections as :func:`_projection` reads them, or with ``fuse`` one projection of their
    concatenation; in dtype ``cast`` when it is not None (see :func:`_cast`), packed as :func:`_pack`
    says. Plain Linear layers fuse into one (weight, bias) pair. Where peft's LoRA adapts some of
    them, they fuse only when the concatenation is packed (unpacked, every projection keeps peft's
    arithmetic as it is): their base layers' weights make one product, and each adapter adds to its
    own projection's columns of it (:class:`Lora`, :func:`_stacked`)."""
    bases = [x if type(x) is torch.nn.Linear else x.base_layer for x in linears]
    lora = any(x is not b for x, b in zip(linears, bases, strict=True))
    if not fuse or (lora and (pack is None or sum(b.weight.numel() for b in bases) < PACK_NUMEL)):
        return [_projection(x, cast, pack) for x in linears]
    weight = torch.cat([b.weight for b in bases])
    bias = None
    if any(b.bias is not None for b in bases):
        bias = torch.cat([b.bias if b.bias is not None else b.weight.new_zeros(len(b.weight)) for b in bases])
    fused = _pack(_cast((weight, bias), cast), pack)
    if not lora:
        return [fused]
    adapters, start = [], 0
    for x, b in zip(linears, bases, strict=True):
        if x is not b:
            adapters.append(_adapter(x, start, cast))
        start += len(b.weight)
    return [Lora(fused, _stacked(adapters, start))]


def _adapter(layer: torch.nn.Module, start: int, cast: torch.dtype | None = None) -> tuple:
    """peft LoRA ``layer``'s active adapter as ``(A, B, scaling, start, stop)``: it adds to the output
    columns ``[start, start + out_features)`` (of a fused base; 0 alone). Under autocast to ``cast``,
    A and B are copies in it, made once per call (small: the rank's rows and columns), the values
    autocast would give F.linear: so no weight is left to autocast (``sampler.sampling_mode`` can then
    run the call in inference mode, where autocast would cast them again at every step)."""
    (name,) = layer.active_adapters
    A, B = layer.lora_A[name].weight, layer.lora_B[name].weight
    if cast is not None:
        A, B = (x.detach().to(cast) if _autocast_would_cast(x, cast) else x for x in (A, B))
    return (A, B, layer.scaling[name], start, start + len(B))


def _stacked(adapters: list[tuple], width: int) -> tuple:
    """A fused projection's adapters as one: A's stacked and B's block-diagonal (zeros elsewhere),
    so two products per step instead of two per adapter, with the same terms (the other adapters'
    are exact zeros; the sums may round in another order). Left as they are when there is only one
    or their scalings or dtypes differ (peft scales each adapter's output). The stacked A and B are
    copies, made once per call (in the adapters' dtype: :func:`_adapter` has cast them already)."""
    A0, B0, scaling = adapters[0][:3]
    if len(adapters) == 1 or any(
        (a.dtype, b.dtype, s) != (A0.dtype, B0.dtype, scaling) for a, b, s, _, _ in adapters
    ):
        return tuple(adapters)
    A = torch.cat([a.detach() for a, *_ in adapters])
    B = B0.new_zeros((width, len(A)))
    rank = 0
    for a, b, _, start, stop in adapters:
        B[start:stop, rank : rank + len(a)] = b.detach()
        rank += len(a)
    return ((A, B, scaling, 0, width),)


def _autocast_casts(linear: Linear, dtype: torch.dtype) -> bool:
    """Whether F.linear under autocast to ``dtype`` casts a tensor of ``linear`` (a plain pair or a
    LoRA's base and adapters; a :class:`Packed` one takes its inputs cast by hand): one of another
    floating dtype than ``dtype`` (float64 excepted, which autocast leaves alone)."""
    if type(linear) is Packed:
        return False
    if type(linear) is Lora:
        adapters = linear.adapters
        return _autocast_casts(linear.base, dtype) or any(_autocast_casts(a[:2], dtype) for a in adapters)
    return any(_autocast_would_cast(x, dtype) for x in linear)


def _autocast_would_cast(x: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether autocast to ``dtype`` casts ``x`` as an F.linear argument: a floating tensor of
    another dtype, float64 excepted (autocast leaves it alone)."""
    return x is not None and x.is_floating_point() and x.dtype not in (torch.float64, dtype)


def _cast(linear: Linear, dtype: torch.dtype | None) -> Linear:
    """``linear`` with each tensor that autocast would cast to ``dtype`` at every call made in
    ``dtype`` once: a floating tensor (float64 excepted) that is not a trainable leaf. Trainable
    leaves (the policy's own weights) stay as they are: autocast casts them once per context and
    keeps the copy, which the train step's forward then reuses. None: as it is."""
    if dtype is None:
        return linear
    return tuple(
        x.to(dtype) if _autocast_would_cast(x, dtype) and not (x.is_leaf and x.requires_grad) else x
        for x in linear
    )


def _projection(layer: torch.nn.Module, cast: torch.dtype | None, pack: torch.dtype | None) -> Linear:
    """A plain ``Linear`` as (weight, bias), or :class:`Packed` as :func:`_pack` says; peft's LoRA
    ``Linear`` (:func:`_lora_reason`) as :class:`Lora`: its base layer as a plain one, and its
    active adapter. The base is cast as :func:`_cast` says (a frozen base under LoRA: once per
    call), A and B as :func:`_adapter` does (once per call too)."""
    if type(layer) is torch.nn.Linear:
        return _pack(_cast((layer.weight, layer.bias), cast), pack)
    base = _pack(_cast((layer.base_layer.weight, layer.base_layer.bias), cast), pack)  # as a plain layer
    return Lora(base, (_adapter(layer, 0, cast),))


def _pack_dtype(weight: torch.Tensor, cast: torch.dtype | None) -> torch.dtype | None:
    """The dtype in which projections of ``weight``'s device and dtype run packed for oneDNN
    (PACK_NUMEL), or None: not on a CPU, no oneDNN in this torch build, or a dtype other than
    float32 and (where the CPU computes it natively) bfloat16. ``cast``: autocast's dtype, if on."""
    if weight.device.type != "cpu" or not onednn_linear_available():
        return None
    dtype = cast if cast is not None else weight.dtype
    if dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return dtype
    return None


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and the two operators :class:`Packed` uses (they are
    PyTorch's internal ones, which its CPU compiler emits; without them every projection runs F.linear)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _pack(linear: Linear, dtype: torch.dtype | None) -> Linear:
    """(weight, bias) as :class:`Packed` in ``dtype`` when it is not None and the weight has at least
    PACK_NUMEL entries; else as it is. The reordered copy lives as long as the decoder (one sampler
    call): the policy's weights change between calls."""
    weight, bias = linear
    if dtype is None or weight.numel() < PACK_NUMEL:
        return linear
    weight = weight.detach().to(dtype)
    bias = None if bias is None else bias.detach().to(dtype)
    return Packed(torch.ops.mkldnn._reorder_linear_weight(weight), bias, dtype)


def _linear(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    if type(linear) is Packed:
        x = x.to(linear.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, linear.weight, linear.bias, "none", [], "")
    if type(linear) is not Lora:
        return F.linear(x, linear[0], linear[1])
    # peft's vanilla LoRA in its order: base(x) + (x A^T) B^T * scaling, cast to the base output's
    # dtype (an adapter kept in float32 over bfloat16 weights gives bfloat16 outputs), each adapter
    # on its columns of a fused base
    out = _linear(linear.base, x)
    for A, B, scaling, start, stop in linear.adapters:
        out[..., start:stop] += F.linear(F.linear(x if x.dtype == A.dtype else x.to(A.dtype), A), B) * scaling
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back, then scale. All float32 (no autocast):
    torch's one-operator ``rms_norm``, which computes the same products in the same order."""
    if x.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, so that HF's ``rotate_half(x) * sin`` (``rotate_half(x)
    = cat(-x2, x1)``) is ``roll(x, D / 2) * _signed(sin)``: the same products, bit for bit (only
    signs move), in one operator instead of three."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class HFDecoder:
    """The same interface over the model's own forward and Hugging Face cache (``sampler._step``)."""

    name = "hf"
    keep_finished = 0.0  # HF's cache copies itself on every step anyway: drop finished rows at once
    casts_weights = True  # under autocast, the model's linears leave their weights to autocast

    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, ids_PL, mask_PL, group_size: int, capacity: int):
        from grpokit.rollout.sampler import prompt_pass

        logits_bV, cache, attn_bL = prompt_pass(self.model, ids_PL, mask_PL, group_size, ids_PL.device)
        return logits_bV, [cache, attn_bL]

    def step(self, ids_b: torch.Tensor, state: list) -> torch.Tensor:
        from grpokit.rollout.sampler import _step

        cache, attn_bS = state
        attn_bS = torch.cat([attn_bS, attn_bS.new_ones(attn_bS.shape[0], 1)], dim=1)
        pos_b1 = attn_bS.sum(dim=1, keepdim=True) - 1
        logits_bV, state[0] = _step(self.model, ids_b[:, None], attn_bS, pos_b1, cache)
        state[1] = attn_bS
        return logits_bV

    def feed(self, ids_bw: torch.Tensor, real_bw: torch.Tensor, state: list) -> torch.Tensor:
        """:meth:`OwnDecoder.feed` on the HF forward: the chunk's padding masked in the attention
        mask, which the cache keeps for every later step."""
        b, w = ids_bw.shape
        if w == 1:
            return self.step(ids_bw[:, 0], state)
        from grpokit.rollout.sampler import cached_forward

        cache, attn_bS = state
        pos_bw = attn_bS.sum(dim=1, keepdim=True) + torch.arange(w, device=ids_bw.device)[None]
        attn_bS = torch.cat([attn_bS, real_bw.long()], dim=1)
        logits_bwV, state[0] = cached_forward(self.model, ids_bw, attn_bS, pos_bw, cache)
        state[1] = attn_bS
        return logits_bwV[torch.arange(b, device=ids_bw.device), real_bw.sum(dim=1) - 1]

    def select(self, state: list, keep_b: torch.Tensor) -> None:
        state[0].batch_select_indices(keep_b)
        state[1] = state[1][keep_b]


def decoder_for(
    model, decode: str, capacity: int, reorder: bool = True, share: bool = True
) -> OwnDecoder | HFDecoder:
    """``decode``: ``auto`` (grpokit's own path where :func:`own_decoder_reason` allows, else HF's)
    or ``hf`` (always the model's own forward). ``reorder``: the own path may pack projections for
    oneDNN; ``share``: it may keep each prompt's keys once (:class:`OwnDecoder`)."""
    if decode not in ("auto", "hf"):
        raise ValueError(f"decode must be 'auto' or 'hf', got {decode!r}")
    if decode == "auto" and own_decoder_reason(model, capacity) is None:
        return OwnDecoder(model, reorder, share)
    return HFDecoder(model)
