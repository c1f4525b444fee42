"""The policy side of a GRPO step: pi_old and pi_ref log-probs, the off-policy corrections, and the
``mu x steps_per_generation`` optimizer steps on one batch.

What it does: ``Learner(cfg, model, dist, pad_id)`` holds what the update needs -- the module that
trains (DDP / FSDP wrapped), the reference (a frozen copy, or the LoRA base with the adapters off),
the fused AdamW and the loss options built once (``LossSpec``) -- and the trainer calls its stages
in order: ``logprobs`` -> ``shaped_rewards`` (KL in the reward) -> ``off_policy`` (top-k/p pi_old,
rollout-correction weights) -> ``update`` -> ``mismatch`` (sampler vs trainer log-probs) ->
``sync_reference``.

Decisions worth knowing:
- pi_old is recomputed only when the update is not the first step on the batch (``mu > 1``,
  ``steps_per_generation > 1``), the KL goes into the reward, or a rollout correction needs it;
  otherwise the first forward pass's own detached log-probs are pi_old.
- A step whose advantages are all zero with beta = 0 (in the loss) has no learning signal; its
  optimizer step is skipped, because Adam would turn leftover numerical noise into a full-size update.

What it deliberately does not do: sample, score or compute advantages (the trainer does).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from grpokit.algo import LossSpec, kl_shaped_rewards
from grpokit.algo.correction import correction_weights, mismatch_stats
from grpokit.models.loading import (
    DTYPES,
    fused_head_reason,
    packing_reason,
    prompt_sharing_costs,
    prompt_sharing_reason,
    reference_copy,
)
from grpokit.rollout.sampler import Rollout
from grpokit.train.batch import TrainBatch, UpdateStats, accumulate_policy_gradient, batch_logprobs
from grpokit.train.distributed import Dist, shard, wrap
from grpokit.train.optim import build_optimizer, learning_rate


class Learner:
    """The update stages of one generation step (see the module docstring)."""

    def __init__(self, cfg, model, dist: Dist, pad_id: int) -> None:
        self.cfg, self.model, self.dist, self.pad_id = cfg, model, dist, pad_id
        # With LoRA the reference is the base model itself, adapters switched off: no second copy.
        wants_ref = cfg.algo.beta > 0 or cfg.train.track_kl
        self.adapter_ref = wants_ref and hasattr(model, "disable_adapter")
        # A frozen reference that always runs under autocast stores its Linear weights in autocast's
        # dtype (the values autocast computes with). A sharded (FSDP2) one keeps the policy's dtype:
        # mixed dtypes in one sharded group are not tested here.
        frozen_cast = cfg.model.autocast is not None and not cfg.algo.ref_sync_every and not dist.fsdp
        ref_dtype = DTYPES[cfg.model.autocast] if frozen_cast else None
        self.ref_model = reference_copy(model, ref_dtype) if wants_ref and not self.adapter_ref else None
        if self.ref_model is not None and dist.fsdp:
            shard(self.ref_model)
        # train_module runs the update (a DDP wrapper, or the FSDP-sharded model itself); model is
        # the model underneath, for log-probs without gradients.
        self.train_module = wrap(model, dist)
        self.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.train)
        self.loss_spec = loss_spec(cfg)
        self.num_skipped_steps = 0
        # log-probs from hidden states + head (no full logits) where the model family allows it
        self.fused_head_off = (
            fused_head_reason(model) if cfg.model.fused_logprobs else "model.fused_logprobs is off"
        )
        self.fused_head = self.fused_head_off is None
        # padding-free micro-batches where the model's mask builder keeps packed sequences apart
        self.packing_off = packing_reason(model) if cfg.train.packing else "train.packing is off"
        self.packed = self.packing_off is None
        # each prompt once per micro-batch (where that saves FLOPs), by the model's own costs
        self.sharing_off = (
            prompt_sharing_reason(model) if cfg.train.share_prompts else "train.share_prompts is off"
        )
        self.share = prompt_sharing_costs(model) if self.sharing_off is None else None
        self.layout = dict(fused_head=self.fused_head, packed=self.packed, share=self.share)

    def logprobs(self, batch: TrainBatch, plans: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """pi_ref's log-probs (when a reference is loaded) and pi_old's, which are needed only when
        the update is not the first step on the batch or the KL goes into the reward."""
        cfg, plan = self.cfg, [mb for p in plans for mb in p]
        tau = cfg.rollout.temperature
        ref_logp = None
        if self.ref_model is not None:
            ref_logp = batch_logprobs(self.ref_model, batch, plan, self.pad_id, tau, self.dist, **self.layout)
        elif self.adapter_ref:
            with self.model.disable_adapter():
                ref_logp = batch_logprobs(self.model, batch, plan, self.pad_id, tau, self.dist, **self.layout)
        t, a = cfg.train, cfg.algo
        needs_old = t.mu > 1 or t.steps_per_generation > 1 or a.kl_placement == "reward"
        needs_old = needs_old or a.rollout_correction is not None
        old_logp = (
            batch_logprobs(self.model, batch, plan, self.pad_id, tau, self.dist, **self.layout)
            if needs_old
            else None
        )
        return old_logp, ref_logp

    def shaped_rewards(self, total_B, batch: TrainBatch, old_logp, ref_logp) -> torch.Tensor:
        """``algo.kl_placement: reward``: r <- r - beta * sum_t KL_t (estimator ``algo.kl``)."""
        a = self.cfg.algo
        if a.kl_placement != "reward" or ref_logp is None:
            return total_B
        return kl_shaped_rewards(total_B, old_logp, ref_logp, batch.completion_mask, a.beta, a.kl)

    def off_policy(self, rollout: Rollout, batch: TrainBatch, old_logp):
        """The ratio's pi_old and the rollout-correction weights. ``algo.rollout_correction`` weights
        each token by the trainer's pi_old over the sampler's, and the ratio is against the trainer's
        pi_old (decoupled PPO: the weight carries the whole sampler-trainer gap, top-k / top-p's
        truncation included, so the ratio must not carry it again). Without a correction, with top-k
        / top-p, the tokens came from the truncated, renormalised distribution, and the sampler's own
        log-probs are pi_old."""
        a, r, sampler = self.cfg.algo, self.cfg.rollout, rollout.sampler_logp
        if a.rollout_correction is not None:
            weights = correction_weights(
                old_logp, sampler, batch.completion_mask, a.rollout_correction, a.rollout_correction_cap
            )
            return old_logp, weights
        truncated = r.top_k > 0 or r.top_p < 1.0
        return (sampler if truncated and sampler is not None else old_logp), None

    def mismatch(self, rollout: Rollout, batch: TrainBatch, old_logp, stats: UpdateStats, weights) -> dict:
        """``logprob_mismatch`` (mean |log pi_old - log pi_sampler|) and ``logprob_ratio_outside``
        (share of tokens with pi_old / pi_sampler outside [0.9, 1.1]) over the whole step's tokens;
        NaN without sampler log-probs (vLLM) or on a skipped step that recomputed nothing."""
        if old_logp is not None and rollout.sampler_logp is not None:
            abs_sum, outside, n = mismatch_stats(old_logp, rollout.sampler_logp, batch.completion_mask)
            abs_sum, outside, n = self.dist.sum([float(abs_sum), float(outside), float(n)])
        else:
            abs_sum, outside, n = stats.mismatch_abs_sum, stats.mismatch_outside, stats.mismatch_tokens
        out = {
            "logprob_mismatch": abs_sum / n if n else float("nan"),
            "logprob_ratio_outside": outside / n if n else float("nan"),
        }
        if weights is not None:
            mask = batch.completion_mask
            w, m = self.dist.sum([float(weights[mask].sum()), float(mask.sum())])
            out["is_weight_mean"] = w / m if m else float("nan")
        return out

    def update(
        self,
        batch: TrainBatch,
        plans: list,
        step: int,
        old_logp,
        ref_logp,
        is_weights,
        mismatch_logp,
        dump: Path | None = None,
    ) -> tuple[UpdateStats, float, bool]:
        """``mu`` inner epochs x ``steps_per_generation`` optimizer steps on one batch; returns the
        combined statistics, the last learning rate, and whether the update was skipped."""
        cfg = self.cfg
        per_gen = cfg.train.mu * len(plans)
        first = (step - 1) * per_gen
        all_zero = self.dist.max(float(bool((batch.advantages != 0).any()))) == 0  # on every rank
        if all_zero and self.loss_spec.beta == 0:  # no signal: Adam would turn leftover noise into a step
            self.num_skipped_steps += 1
            zero = dict(clip_fraction=0.0, clip_fraction_low=0.0, clip_fraction_high=0.0)
            return UpdateStats(loss=0.0, num_tokens=0, **zero), learning_rate(first, cfg.train), True
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        steps = []
        for epoch in range(cfg.train.mu):
            for k, plan in enumerate(plans):
                lr = learning_rate(first + epoch * len(plans) + k, cfg.train)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.zero_grad(set_to_none=True)
                # train mode only so HF's gradient checkpointing engages; every dropout is already 0
                self.train_module.train(cfg.model.gradient_checkpointing)
                stats = accumulate_policy_gradient(
                    self.train_module,
                    batch,
                    plan,
                    self.pad_id,
                    temperature=cfg.rollout.temperature,
                    loss=self.loss_spec,
                    old_logp=old_logp,
                    ref_logp=ref_logp,
                    entropy_top_q=cfg.algo.entropy_top_q,
                    is_weights=is_weights,
                    mismatch_logp=mismatch_logp if epoch == 0 else None,
                    dump_path=dump if epoch == 0 and k == 0 else None,
                    dist=self.dist,
                    **self.layout,
                )
                self.train_module.eval()
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm or math.inf)
                norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                # a NaN or inf gradient would write itself into the weights and AdamW's moments for
                # good: that step is skipped (every rank sees the same reduced norm)
                finite = math.isfinite(norm)
                if finite:
                    self.optimizer.step()
                # autocast keeps its casts of the weights until its context (the whole train step)
                # ends; the next optimizer step's forward must see the weights this one wrote
                torch.clear_autocast_cache()
                steps.append(
                    UpdateStats(**{**vars(stats), "grad_norm": norm, "nonfinite_grad_steps": int(not finite)})
                )
        self.optimizer.zero_grad(set_to_none=True)
        return UpdateStats.combine(steps), lr, False

    def sync_reference(self, step: int) -> None:
        """DeepSeekMath's iterative GRPO: every ``ref_sync_every`` steps,
        ref <- mix * policy + (1 - mix) * ref."""
        a = self.cfg.algo
        if self.ref_model is None or not a.ref_sync_every or step % a.ref_sync_every:
            return
        with torch.no_grad():
            for p_ref, p in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                p_ref.mul_(1.0 - a.ref_sync_mix).add_(p.detach(), alpha=a.ref_sync_mix)


def loss_spec(cfg) -> LossSpec:
    """The run's loss options, built once: KL in the loss only with ``kl_placement: loss``."""
    a = cfg.algo
    return LossSpec(
        beta=a.beta if a.kl_placement == "loss" else 0.0,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        ratio_level=a.ratio_level,
        aggregation=a.aggregation,
        max_completion_length=cfg.rollout.max_new_tokens,
        kl_kind=a.kl,
        surrogate=a.surrogate,
        delta=a.delta,
        cispo_max_ratio=a.cispo_max_ratio,
        sapo_tau_pos=a.sapo_tau_pos,
        sapo_tau_neg=a.sapo_tau_neg,
    )
