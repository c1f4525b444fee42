"""The GRPO loop: sample -> score -> advantages -> mu inner epochs of micro-batched updates.

What it does: ``GRPOTrainer(config).train()`` runs ``train.max_steps`` steps. Each step takes
``prompts_per_step`` rows, samples ``group_size`` completions per prompt, scores them with the
configured rewards, turns rewards into group-relative advantages, and makes ``mu`` optimizer
steps on that batch with pi_old fixed to the sampling policy. Everything about the run goes to
the run directory (config.yaml, metrics.jsonl, samples.jsonl, summary.json, final/, report.html).

Decisions worth knowing:
- Dropout is off throughout (the model stays in eval mode): with it on, pi_theta would differ
  from pi_old at the very first inner step and the ratio would be noise, not 1.
- A step whose advantages are all zero with beta = 0 has no learning signal; its optimizer step
  is skipped, because Adam would turn leftover numerical noise into a full-size update.
- Sampling draws from its own ``torch.Generator``; evaluation is greedy and sample logging uses
  its own ``random.Random``: changing either never changes the training trajectory.

- Checkpoints every ``train.save_every`` steps (train/checkpoint.py); SIGINT / SIGTERM finish the
  current step, save, and raise ``TrainingInterrupted``; ``train(resume=...)`` continues exactly.

- Under torchrun (train/distributed.py) each rank samples, scores and trains on its own
  ``prompts_per_step / world_size`` groups; advantages, metrics and stop decisions are computed
  from the whole step's batch, gathered from every rank, so they equal a single process's. Only
  rank 0 writes the run directory.

What it deliberately does not do: launch processes (torchrun does) or decide the device layout
beyond one process per GPU.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from pathlib import Path

import torch

from grpokit.algo import decoupled_advantages, group_advantages, kl_shaped_rewards, zero_std_groups
from grpokit.config import GRPOConfig
from grpokit.data.datasets import FilteredSource, RowsSource, build_prompt, check_rows, load_rows
from grpokit.data.tasks import TaskSource
from grpokit.diagnostics.hacking import HackingMonitor
from grpokit.errors import CheckpointError, ConfigError, RunExistsError, TrainingInterrupted
from grpokit.models.loading import keep_head_float32, load_model, mixed_precision, reference_copy
from grpokit.report import write_report
from grpokit.rewards.registry import (
    ParallelReward,
    Scores,
    TrainerProgress,
    WeightedReward,
    check_reward_columns,
    concat_scores,
    conversational_prompts,
    get,
    is_verifier,
    reward_columns,
    score,
)
from grpokit.rollout.sampler import Rollout, SamplingParams, concat_rollouts, pad_token_id, sample
from grpokit.train.batch import TrainBatch, accumulate_policy_gradient, batch_logprobs, plan_micro_batches
from grpokit.train.checkpoint import TrainerState, find_checkpoint, load_checkpoint, save_checkpoint
from grpokit.train.distributed import (
    full_parameters,
    full_state_dict,
    gathered_state_dict,
    init_distributed,
    shard,
    wrap,
)
from grpokit.train.evaluate import combine_evaluations, evaluate
from grpokit.train.metrics import RunLogger, json_safe


class GRPOTrainer:
    """Train a causal LM with GRPO. Arguments left as None are built from ``config``.

    Args:
        config: the run's :class:`~grpokit.config.GRPOConfig`.
        model, tokenizer: a Hugging Face causal LM and its tokenizer (default: ``config.model``).
        rewards: reward callables ``(prompts, completions, **columns) -> list[float | None]`` or
            :class:`WeightedReward` (default: ``config.rewards``).
        dataset: training rows (dicts with the prompt column); default: ``config.data``.
        eval_dataset: held-out rows; default: ``data.eval_path`` or the task's held-out split.
    """

    def __init__(
        self, config: GRPOConfig, model=None, tokenizer=None, rewards=None, dataset=None, eval_dataset=None
    ) -> None:
        self.cfg = cfg = config
        self.dist = init_distributed(cfg.distributed.strategy, cfg.distributed.backend)
        W, P = self.dist.world_size, cfg.train.prompts_per_step
        if P % W or cfg.train.steps_per_generation > P // W:
            raise ConfigError(
                f"train.prompts_per_step={P} must be a multiple of the world size {W} with at least "
                f"train.steps_per_generation={cfg.train.steps_per_generation} prompts per rank "
                "(a group never spans ranks); change prompts_per_step or --nproc-per-node"
            )
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        self.train_source, self.eval_rows = _build_data(cfg, dataset, eval_dataset)
        self.rewards = _build_rewards(cfg, rewards)
        d = cfg.data
        check_reward_columns(
            self.rewards, self.train_source.row(0), d.prompt_column, d.answer_column, "training data"
        )
        if self.eval_rows:
            check_reward_columns(
                self.rewards, self.eval_rows[0], d.prompt_column, d.answer_column, "held-out data"
            )
        if cfg.train.eval_every and not self.eval_rows:
            raise ConfigError(
                "train.eval_every > 0 needs held-out rows: set data.eval_path or use a data.task"
            )
        device = self.dist.device()
        if model is None:
            model, tokenizer = load_model(
                cfg.model.name_or_path,
                cfg.model.dtype,
                device,
                lora=cfg.model.lora,
                gradient_checkpointing=cfg.model.gradient_checkpointing,
                gguf_file=cfg.model.gguf_file,
            )
        if tokenizer is None:
            raise ValueError("a model was given without its tokenizer; pass tokenizer= too")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device = next(model.parameters()).device
        if cfg.model.autocast is not None:
            keep_head_float32(model)  # before the reference copy, which then keeps it too
        self.pad_id = pad_token_id(tokenizer)
        self.num_filtered_prompts = self._filter_long_prompts()
        # With LoRA the reference is the base model itself, adapters switched off: no second copy.
        wants_ref = cfg.algo.beta > 0 or cfg.train.track_kl
        self.adapter_ref = wants_ref and hasattr(model, "disable_adapter")
        self.ref_model = reference_copy(model) if wants_ref and not self.adapter_ref else None
        if self.ref_model is not None and self.dist.fsdp:
            shard(self.ref_model)
        # train_module runs the update (a DDP wrapper, or the FSDP-sharded model itself); self.model
        # is the model underneath, for sampling, log-probs without gradients and saving.
        self.train_module = wrap(model, self.dist)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.generator = torch.Generator(self.device).manual_seed(cfg.train.seed)
        self.engine, self._engine_stale = _build_engine(cfg, tokenizer), True
        r = cfg.rollout
        self.sampling = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, tuple(r.stop))
        self.step, self.rows_consumed, self.num_skipped_steps = 0, 0, 0
        self.monitor = HackingMonitor(cfg.monitor) if cfg.monitor.enabled else None
        self._last_completions: list[str] = []
        self.stop_reason: str | None = None
        self.run_dir = Path(cfg.train.output_dir)

    # ---------------------------------------------------------------------------------------
    def train(self, resume: str | Path | None = None) -> dict:
        """Run to ``train.max_steps``; returns the summary (also written to summary.json).

        Args:
            resume: None for a new run; a run directory or checkpoint directory to continue from
                (a corrupt newest checkpoint is refused); or ``"auto"``: the newest *good*
                checkpoint in ``train.output_dir``, skipping corrupt ones, or a fresh start if
                there is none.

        Raises:
            TrainingInterrupted: after SIGINT / SIGTERM, once the current step is finished and a
                checkpoint is saved.
        """
        cfg, t0 = self.cfg, time.perf_counter()
        before, wall_before = self._start(resume)
        logger = (
            RunLogger(
                self.run_dir,
                cfg.train.max_steps,
                cfg.train.quiet,
                start_step=self.step,
                tensorboard=cfg.logging.tensorboard,
            )
            if self.dist.is_main
            else _NoLogger()
        )
        last: dict = {}
        with _StopOnSignal() as stop:
            try:
                while self.step < cfg.train.max_steps:
                    self.step += 1
                    with mixed_precision(self.device, cfg.model.autocast):
                        last, samples = self.train_step()
                    stop_reason = self.dist.broadcast(self._watch(last, logger))
                    if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                        ev = self._evaluate()
                        last.update(eval_reward_mean=ev["reward_mean"], eval_accuracy=ev["accuracy"])
                    logger.log_step(last)
                    logger.log_samples(samples)
                    wall = wall_before + time.perf_counter() - t0
                    due = cfg.train.save_every and (
                        self.step % cfg.train.save_every == 0 or self.step == cfg.train.max_steps
                    )
                    signum = int(self.dist.max(float(stop.signum or 0)))  # a signal to any rank stops all
                    if due or signum or stop_reason:  # these save even with save_every = 0
                        ckpt = self._save(before, wall)
                        if signum:
                            raise TrainingInterrupted(self.step, signum, ckpt, self.run_dir)
                    if stop_reason:
                        logger.print(f"grpokit: stopping after step {self.step}: {stop_reason}")
                        self.stop_reason = stop_reason
                        break
            finally:
                logger.close()
        after = self._evaluate() if self.eval_rows else None
        summary = self._summary(last, before, after, wall_before + time.perf_counter() - t0)
        weights = full_state_dict(self.model, self.dist) if self.dist.fsdp else None  # a collective
        if self.dist.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2))
            self.model.save_pretrained(self.run_dir / "final", state_dict=weights)
            self.tokenizer.save_pretrained(self.run_dir / "final")
            if cfg.logging.report:
                write_report(self.run_dir)
        self.dist.barrier()
        return summary

    def _start(self, resume: str | Path | None) -> tuple[dict | None, float]:
        """Prepare the run directory; on resume restore the state. Returns (eval before, wall so far)."""
        if resume is not None:
            auto = str(resume) == "auto"
            where = self.run_dir if auto else Path(resume)
            ckpt = find_checkpoint(where, fallback=auto, warn=lambda m: self._print(f"grpokit: {m}"))
            if ckpt is not None:
                self.run_dir = ckpt.parent.parent
                state = load_checkpoint(
                    ckpt, self.model, self.optimizer, self.generator, self.ref_model, self.dist
                )
                self.step, self.rows_consumed = state.step, state.rows_consumed
                self.num_skipped_steps = state.num_skipped_steps
                if self.dist.is_main:
                    truncate_logs(self.run_dir, state.step)  # drop steps logged after the checkpoint
                    self.cfg.save(self.run_dir / "config.yaml")
                self.dist.barrier()
                return state.before, state.wall_time_s
            if not auto:
                raise CheckpointError(f"{where}: no checkpoint to resume from")
            if self.dist.is_main:
                truncate_logs(self.run_dir, 0)  # auto with nothing saved yet: start over
        self._prepare_run_dir()
        return (self._evaluate() if self.eval_rows else None), 0.0

    def _save(self, before: dict | None, wall: float) -> Path:
        state = TrainerState(self.step, self.rows_consumed, self.num_skipped_steps, before, round(wall, 3))
        return save_checkpoint(
            self.run_dir,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.generator,
            state,
            self.cfg.train.keep_last,
            ref_model=self.ref_model if self.cfg.algo.ref_sync_every else None,
            dist=self.dist,
        )

    def train_step(self) -> tuple[dict, list[dict]]:
        """One generation step: the stages in order. Returns (metrics, sample rows)."""
        cfg, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        prompts_B, rollout, scores, gen = self._generate()
        t1 = time.perf_counter()
        loss_mask = (
            rollout.completion_mask & ~rollout.truncated[:, None] if a.mask_truncated_completions else None
        )
        batch = TrainBatch.from_rollout(rollout, torch.zeros(rollout.num_rows), loss_mask)
        plans = self._plans(batch)
        full_plan = [mb for plan in plans for mb in plan]
        tau = cfg.rollout.temperature
        ref_logp = self._ref_logprobs(batch, full_plan)
        needs_old = cfg.train.mu > 1 or cfg.train.steps_per_generation > 1 or a.kl_placement == "reward"
        old_logp = (
            batch_logprobs(self.model, batch, full_plan, self.pad_id, tau, self.dist) if needs_old else None
        )
        total_B = scores.total
        if a.kl_placement == "reward" and ref_logp is not None:  # r <- r - beta * sum_t KL_t
            total_B = kl_shaped_rewards(total_B, old_logp, ref_logp, batch.completion_mask, a.beta, a.kl)
        batch.advantages = self._advantages(total_B, scores)
        if cfg.train.dump_tensors and self.dist.is_main:  # what the advantages were computed from
            (self.run_dir / "tensors").mkdir(exist_ok=True)
            where = self.run_dir / "tensors" / f"step-{self.step:06d}-advantages.pt"
            torch.save(
                {"rewards": total_B, "advantages": batch.advantages, "group_size": rollout.group_size}, where
            )
        t2 = time.perf_counter()
        stats = self._update(batch, plans, old_logp, ref_logp)
        self._engine_stale = True
        self._maybe_sync_reference()
        t3 = time.perf_counter()
        times = (t0, t0 + gen["time_sampling_s"], t1, t2, t3)
        # the whole step's batch, gathered from every rank in rank order (itself in one process)
        parts = self.dist.all_gather_objects((prompts_B, rollout, scores, batch.advantages))
        if self.dist.enabled:
            prompts_B = [p for part in parts for p in part[0]]
            rollout = concat_rollouts([part[1] for part in parts], self.pad_id)
            scores = concat_scores([part[2] for part in parts])
            adv_B = torch.cat([part[3] for part in parts])
        else:
            adv_B = batch.advantages
        metrics = _step_metrics(self.step, rollout, scores, adv_B, stats, times)
        for name, value in scores.logged_metrics.items():  # the rewards' log_metric calls
            if name in metrics:
                raise ValueError(
                    f"a reward's log_metric({name!r}, ...) would overwrite grpokit's metric {name!r}"
                )
            metrics[name] = value
        metrics.update(num_skipped_steps=self.num_skipped_steps, generation_batches=gen["batches"])
        self._last_completions = rollout.completions
        return metrics, self._sample_rows(prompts_B, rollout, scores, adv_B)

    def _watch(self, metrics: dict, logger: RunLogger) -> str | None:
        """Feed the hacking monitor; log its alerts; return a reason to stop (``stop_on_hacking``)."""
        if self.monitor is None:
            return None
        alerts = self.monitor.observe(self.step, metrics, self._last_completions)
        metrics["hacking_alerts"] = [a.kind for a in alerts]
        for a in alerts:
            logger.print(f"[hacking monitor] step {a.step}: {a.kind}: {a.message}")
        if alerts and self.cfg.monitor.stop_on_hacking:
            return f"monitor.stop_on_hacking and the alert {alerts[0].kind!r}"
        return None

    def _ref_logprobs(self, batch: TrainBatch, plan: list[list[int]]) -> torch.Tensor | None:
        tau = self.cfg.rollout.temperature
        if self.ref_model is not None:
            return batch_logprobs(self.ref_model, batch, plan, self.pad_id, tau, self.dist)
        if self.adapter_ref:
            with self.model.disable_adapter():
                return batch_logprobs(self.model, batch, plan, self.pad_id, tau, self.dist)
        return None

    def _generate(self) -> tuple[list[str], Rollout, Scores, dict]:
        """Sample and score ``prompts_per_step`` groups. With DAPO's dynamic sampling, keep drawing
        batches (at most ``algo.dynamic_sampling_max_batches``) and keep only groups whose verifier
        accuracy (or, without a verifier, total reward) differs, until ``prompts_per_step`` of them
        are found; fewer if the cap is reached.

        Under torchrun each rank fills its own quota of ``prompts_per_step / world_size`` groups
        and keeps sampling (and discarding) until every rank's quota is full, so the ranks' random
        streams and batches stay in step."""
        cfg, G, W = self.cfg, self.cfg.rollout.group_size, self.dist.world_size
        P = cfg.train.prompts_per_step // W  # this rank's prompts
        kept: list[tuple[list[str], Rollout, Scores]] = []
        num_kept, sampling_s, batches = 0, 0.0, 0
        for batches in range(
            1, (cfg.algo.dynamic_sampling_max_batches if cfg.algo.dynamic_sampling else 1) + 1
        ):
            t = time.perf_counter()
            rows, prompts = self._next_prompts(cfg.train.prompts_per_step)
            rollout = self._sample(prompts, P)
            sampling_s += time.perf_counter() - t
            if num_kept < P:  # else this rank is full and only keeps in step with another still drawing
                prompts_B = [p for p in prompts for _ in range(G)]
                columns = reward_columns(rows, G, cfg.data.prompt_column, cfg.data.answer_column)
                scores = score(
                    self.rewards,
                    prompts_B,
                    rollout.completions,
                    columns,
                    rollout.completion_token_lists(),
                    messages=conversational_prompts(rows, G, cfg.data.prompt_column),
                    state=self._progress(),
                )
                if not cfg.algo.dynamic_sampling:
                    return prompts_B, rollout, scores, {"batches": 1, "time_sampling_s": sampling_s}
                num_kept += self._keep_informative(kept, prompts_B, rollout, scores, P - num_kept, batches)
            if self.dist.max(float(num_kept < P)) == 0:  # every rank's quota is full
                break
        rollout = concat_rollouts([k[1] for k in kept], self.pad_id)
        return (
            [p for k in kept for p in k[0]],
            rollout,
            concat_scores([k[2] for k in kept]),
            {"batches": batches, "time_sampling_s": sampling_s},
        )

    def _sample(self, prompts: list[str], P: int) -> Rollout:
        """This rank's G completions per prompt, from the built-in sampler or the vLLM engine."""
        G, W, r = self.cfg.rollout.group_size, self.dist.world_size, self.dist.rank
        if self.engine is None:
            with full_parameters(self.model, self.dist):
                return sample(
                    self.model,
                    self.tokenizer,
                    prompts,
                    G,
                    self.sampling,
                    self.generator,
                    row_offset=r * P * G,
                    num_rows_total=W * P * G,
                )
        if self._engine_stale:  # push the weights of the last update to vLLM
            self.engine.load_weights(gathered_state_dict(self.model, self.dist).items())
            self._engine_stale = False
        seed = int(torch.randint(2**31 - 1, (1,), generator=self.generator, device=self.device))
        return self.engine.sample(prompts, G, self.sampling, seed, first_prompt_index=r * P)

    def _progress(self) -> TrainerProgress:
        """``trainer_state`` for the rewards: the step, the epoch over a finite dataset, max_steps."""
        n = len(self.train_source) if isinstance(self.train_source, RowsSource) else 0
        epoch = self.rows_consumed / n if n else 0.0
        return TrainerProgress(self.step, epoch, self.cfg.train.max_steps)

    def _keep_informative(
        self, kept: list, prompts_B: list[str], rollout: Rollout, scores: Scores, room: int, batch: int
    ) -> int:
        """DAPO's filter: append to ``kept`` up to ``room`` groups whose accuracy (without a verifier:
        total reward) is not all-equal; on the last allowed batch with nothing kept yet, keep the
        whole batch. Returns how many groups were kept."""
        G, P = self.cfg.rollout.group_size, rollout.num_rows // self.cfg.rollout.group_size
        signal = scores.total if scores.verifier is None else torch.nan_to_num(scores.verifier)
        groups = (~zero_std_groups(signal, G)).nonzero().flatten().tolist()[:room]
        if not groups and not kept and batch == self.cfg.algo.dynamic_sampling_max_batches:
            groups = list(range(P))  # nothing informative at all: train on the last batch
        if groups:
            rows_B = [g * G + j for g in groups for j in range(G)]
            kept.append(([prompts_B[r] for r in rows_B], rollout.take_groups(groups), scores.take(rows_B)))
        return len(groups)

    def _advantages(self, total_B: torch.Tensor, scores: Scores) -> torch.Tensor:
        """Advantages of this rank's rows, computed from the whole step's rewards (gathered from
        every rank), so ``scale: batch`` sees the global batch as a single process would."""
        a, G = self.cfg.algo, self.cfg.rollout.group_size
        decoupled = a.reward_combination == "normalize_then_sum" and len(self.rewards) > 1
        per_KB = torch.stack([scores.per_reward[r.name] for r in self.rewards]) if decoupled else None
        parts = self.dist.all_gather_objects((total_B, per_KB))
        offset = sum(len(part[0]) for part in parts[: self.dist.rank])
        total_B, local = torch.cat([part[0] for part in parts]), slice(offset, offset + len(total_B))
        if decoupled:
            per_KB = torch.cat([part[1] for part in parts], dim=1)
            if torch.isnan(per_KB).any():
                raise ConfigError(
                    "algo.reward_combination=normalize_then_sum needs every reward to score every "
                    "completion, but a reward returned None"
                )
            adv_B = decoupled_advantages(
                per_KB, [r.weight for r in self.rewards], G, estimator=a.estimator, scale=a.scale, eps=a.eps
            )
        else:
            adv_B = group_advantages(total_B, G, estimator=a.estimator, scale=a.scale, eps=a.eps)
        return adv_B[local]

    def _plans(self, batch: TrainBatch) -> list[list[list[int]]]:
        """One micro-batch plan per optimizer step of an inner epoch (``train.steps_per_generation``
        parts of whole groups)."""
        t, G = self.cfg.train, self.cfg.rollout.group_size
        lengths = batch.total_lengths()
        groups = batch.num_rows // G
        parts = [
            list(
                range(
                    k * groups // t.steps_per_generation * G, (k + 1) * groups // t.steps_per_generation * G
                )
            )
            for k in range(t.steps_per_generation)
        ]
        plans = []
        # under torchrun an empty part stays (an empty plan, padded later): every rank must make
        # the same number of optimizer steps
        for rows in (p for p in parts if p or self.dist.enabled):
            local = plan_micro_batches([lengths[r] for r in rows], t.micro_batch_size, t.micro_batch_tokens)
            plans.append([[rows[i] for i in mb] for mb in local])
        return plans

    def _update(
        self, batch: TrainBatch, plans: list, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None
    ) -> dict:
        """``mu`` inner epochs x ``steps_per_generation`` optimizer steps on one batch."""
        cfg, a = self.cfg, self.cfg.algo
        per_gen = cfg.train.mu * len(plans)
        kl_in_loss = a.beta > 0 and a.kl_placement == "loss"
        all_zero = self.dist.max(float(bool((batch.advantages != 0).any()))) == 0  # on every rank
        if not kl_in_loss and all_zero:
            self.num_skipped_steps += 1
            lr = self._lr((self.step - 1) * per_gen)
            return {"loss": 0.0, "optimizer_step_skipped": 1, "grad_norm": 0.0, "lr": lr}
        loss_kwargs = dict(
            beta=a.beta if kl_in_loss else 0.0,
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
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        dump = None
        if cfg.train.dump_tensors and self.dist.is_main:  # the run directory is rank 0's
            (self.run_dir / "tensors").mkdir(exist_ok=True)
            dump = self.run_dir / "tensors" / f"step-{self.step:06d}.pt"
        steps = []
        for epoch in range(cfg.train.mu):
            for k, plan in enumerate(plans):
                lr = self._lr((self.step - 1) * per_gen + epoch * len(plans) + k)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.zero_grad(set_to_none=True)
                # train mode only so HF's gradient checkpointing engages; every dropout is already 0
                self.train_module.train(self.cfg.model.gradient_checkpointing)
                stats = accumulate_policy_gradient(
                    self.train_module,
                    batch,
                    plan,
                    self.pad_id,
                    temperature=cfg.rollout.temperature,
                    loss_kwargs=loss_kwargs,
                    old_logp=old_logp,
                    ref_logp=ref_logp,
                    entropy_top_q=a.entropy_top_q,
                    dump_path=dump if epoch == 0 and k == 0 else None,
                    dist=self.dist,
                )
                self.train_module.eval()
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm or math.inf)
                stats["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                self.optimizer.step()
                steps.append(stats)
        self.optimizer.zero_grad(set_to_none=True)
        out = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0] if key != "ratio_max"}
        out.update(ratio_max=max(s["ratio_max"] for s in steps), optimizer_step_skipped=0, lr=lr)
        return out

    def _maybe_sync_reference(self) -> None:
        """DeepSeekMath's iterative GRPO: every ``ref_sync_every`` steps,
        ref <- mix * policy + (1 - mix) * ref."""
        a = self.cfg.algo
        if self.ref_model is None or not a.ref_sync_every or self.step % a.ref_sync_every:
            return
        with torch.no_grad():
            for p_ref, p in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                p_ref.mul_(1.0 - a.ref_sync_mix).add_(p.detach(), alpha=a.ref_sync_mix)

    def _lr(self, k: int) -> float:
        """Learning rate of optimizer step k (0-based): linear warm-up, then constant or cosine to 0."""
        t = self.cfg.train
        total = t.max_steps * t.mu * t.steps_per_generation
        if k < t.warmup_steps:
            return t.lr * (k + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return t.lr
        progress = (k - t.warmup_steps) / max(1, total - t.warmup_steps)
        return t.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    # ---------------------------------------------------------------------------------------
    def _next_prompts(self, n: int) -> tuple[list[dict], list[str]]:
        """The next ``n`` rows of the stream; under torchrun, this rank's contiguous share of them."""
        share = n // self.dist.world_size
        start = self.rows_consumed + self.dist.rank * share
        rows = [self.train_source.row(start + i) for i in range(share)]
        self.rows_consumed += n
        return rows, [self._prompt(r) for r in rows]

    def _prompt(self, row: dict) -> str:
        d = self.cfg.data
        return build_prompt(
            row,
            self.tokenizer,
            prompt_column=d.prompt_column,
            template=d.template,
            system_prompt=d.system_prompt,
            chat_template=d.chat_template,
        )

    def _filter_long_prompts(self) -> int:
        """Drop rows whose prompt is longer than ``data.max_prompt_length`` tokens, from the training
        rows and the held-out rows alike; return how many were dropped (of a built-in task's endless
        stream: of its first 500 rows). A limit that leaves no prompt is refused."""
        limit = self.cfg.data.max_prompt_length
        if limit is None:
            return 0

        def length(row: dict) -> int:
            return len(self.tokenizer(self._prompt(row))["input_ids"])

        def refuse(which: str, rows: list[dict]) -> None:
            lengths = [length(r) for r in rows]
            longest = self._prompt(rows[lengths.index(max(lengths))])
            raise ConfigError(
                f"data.max_prompt_length={limit} drops every {which} prompt: they are {min(lengths)}-"
                f"{max(lengths)} tokens long (the longest: {longest!r}); set it to at least "
                f"{max(lengths)} to keep them all, or null"
            )

        dropped = 0
        if isinstance(self.train_source, RowsSource):
            kept = [r for r in self.train_source.rows if length(r) <= limit]
            dropped += len(self.train_source.rows) - len(kept)
            if not kept:
                refuse("training", self.train_source.rows)
            self.train_source = RowsSource(kept, seed=self.cfg.train.seed, shuffle=self.cfg.data.shuffle)
        else:  # an endless built-in task: filter the stream itself
            sample = [self.train_source.row(i) for i in range(500)]
            num_short = sum(length(r) <= limit for r in sample)
            if num_short == 0:
                refuse("training", sample)
            dropped += len(sample) - num_short
            self.train_source = FilteredSource(self.train_source, lambda r: length(r) <= limit)
        kept_eval = [r for r in self.eval_rows if length(r) <= limit]
        if self.eval_rows and not kept_eval:
            refuse("held-out", self.eval_rows)
        dropped += len(self.eval_rows) - len(kept_eval)
        self.eval_rows = kept_eval
        if dropped:
            self._print(
                f"grpokit: dropped {dropped} prompts longer than data.max_prompt_length={limit} tokens"
                + (
                    ""
                    if isinstance(self.train_source, RowsSource)
                    else " (training: of the task's first 500)"
                )
            )
        return dropped

    def _print(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)

    def _evaluate(self) -> dict:
        """Greedy held-out evaluation; under torchrun each rank decodes a contiguous share of the
        prompts and the results are combined (rank 0's share holds the first examples)."""
        d, rows = self.cfg.data, self.eval_rows[: self.cfg.train.eval_max_prompts]
        W, r = self.dist.world_size, self.dist.rank
        rows = rows[r * len(rows) // W : (r + 1) * len(rows) // W]
        result = {"reward_mean": 0.0, "accuracy": None, "num_prompts": 0, "num_verified": 0, "examples": []}
        if rows:
            with (
                full_parameters(self.model, self.dist),
                mixed_precision(self.device, self.cfg.model.autocast),
            ):
                result = evaluate(
                    self.model,
                    self.tokenizer,
                    rows,
                    [self._prompt(row) for row in rows],
                    self.rewards,
                    max_new_tokens=self.cfg.rollout.max_new_tokens,
                    stop=tuple(self.cfg.rollout.stop),
                    prompt_column=d.prompt_column,
                    answer_column=d.answer_column,
                )
        return combine_evaluations(self.dist.all_gather_objects(result)) if self.dist.enabled else result

    def _sample_rows(self, prompts_B: list[str], rollout: Rollout, scores, adv_B: torch.Tensor) -> list[dict]:
        rng = random.Random(f"{self.cfg.train.seed}:samples:{self.step}")
        picks = sorted(rng.sample(range(rollout.num_rows), min(self.cfg.train.log_samples, rollout.num_rows)))
        return [
            {
                "step": self.step,
                "prompt": prompts_B[i],
                "completion": rollout.completions[i],
                "reward": float(scores.total[i]),
                "advantage": float(adv_B[i]),
                "rewards": {k: float(v[i]) for k, v in scores.per_reward.items()},
                **(
                    {"extra": {k: json_safe(v[i]) for k, v in scores.extra_columns.items()}}
                    if scores.extra_columns
                    else {}
                ),
            }
            for i in picks
        ]

    def _prepare_run_dir(self) -> None:
        if (self.run_dir / "metrics.jsonl").exists():
            raise RunExistsError(
                f"{self.run_dir} already holds a run (metrics.jsonl); continue it with --resume "
                f"{self.run_dir}, choose another train.output_dir (--output-dir), or delete it"
            )
        self.dist.barrier()  # every rank has looked before rank 0 writes
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.cfg.save(self.run_dir / "config.yaml")

    def _summary(self, last: dict, before: dict | None, after: dict | None, wall: float) -> dict:
        s = {
            "steps": self.step,
            "wall_time_s": round(wall, 3),
            "world_size": self.dist.world_size,
            "num_skipped_steps": self.num_skipped_steps,
            "num_filtered_prompts": self.num_filtered_prompts,
            "alerts": [] if self.monitor is None else [vars(a) for a in self.monitor.alerts],
            "stopped_early": self.stop_reason,
            "final_step_metrics": last,
        }
        if self.cfg.data.task is not None:
            s["task"] = self.cfg.data.task
        for tag, ev in (("before", before), ("after", after)):
            if ev is not None:
                s[f"reward_{tag}"], s[f"accuracy_{tag}"] = ev["reward_mean"], ev["accuracy"]
                s[f"eval_examples_{tag}"] = ev["examples"]
        return s


# -------------------------------------------------------------------------------------------
# Stage helpers: pure functions of their inputs.
# -------------------------------------------------------------------------------------------


def _build_data(cfg: GRPOConfig, dataset, eval_dataset) -> tuple:
    d, seed = cfg.data, cfg.train.seed
    if dataset is not None:
        rows = list(dataset)
        check_rows(rows, d.prompt_column)
        train = RowsSource(rows, seed=seed, shuffle=d.shuffle)
    elif d.task is not None:
        train = TaskSource(d.task, seed=seed)
    else:
        train = RowsSource(load_rows(d.path, d.prompt_column, d.split), seed=seed, shuffle=d.shuffle)
    if eval_dataset is not None:
        eval_rows = list(eval_dataset)
        check_rows(eval_rows, d.prompt_column, "eval dataset")
    elif d.eval_path is not None:
        eval_rows = load_rows(d.eval_path, d.prompt_column, d.eval_split)
    elif d.task is not None and dataset is None:
        source = TaskSource(d.task, split="eval")
        eval_rows = [source.row(i) for i in range(len(source))]
    else:
        eval_rows = []
    return train, eval_rows


def _build_engine(cfg: GRPOConfig, tokenizer):
    """The vLLM engine for ``rollout.engine: vllm`` (None: the built-in sampler)."""
    if cfg.rollout.engine != "vllm":
        return None
    from grpokit.models.loading import resolve_model_path
    from grpokit.rollout.vllm_engine import VLLMEngine

    r = cfg.rollout
    return VLLMEngine(
        str(resolve_model_path(cfg.model.name_or_path, cfg.model.gguf_file)),
        tokenizer,
        dtype=cfg.model.dtype,
        max_new_tokens=r.max_new_tokens,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        sleep=r.vllm_sleep,
        seed=cfg.train.seed,
    )


def _build_rewards(cfg: GRPOConfig, rewards) -> list[WeightedReward]:
    """The step's rewards: the ones given (callables or WeightedReward) or ``cfg.rewards``, plus
    DAPO's overlong penalty when ``algo.overlong_penalty`` is on (max_len = rollout.max_new_tokens)."""
    out = []
    if rewards is not None:
        for r in rewards:
            out.append(
                r if isinstance(r, WeightedReward) else WeightedReward(getattr(r, "__name__", "reward"), r)
            )
    else:
        for spec in cfg.rewards:
            options = dict(spec.options)
            if spec.name == "task_verifier" and "task" not in options:
                if cfg.data.task is None:
                    raise ConfigError("reward task_verifier needs data.task (or rewards[].options.task)")
                options["task"] = cfg.data.task
            verifier = is_verifier(spec.name) if spec.verifier is None else spec.verifier
            if spec.workers:
                fn = ParallelReward(spec.name, options, spec.workers, spec.timeout_s, spec.error)
            else:
                fn = get(spec.name, **options)
            out.append(WeightedReward(spec.name.split(":")[-1], fn, spec.weight, verifier, spec.error))
    if cfg.algo.overlong_penalty and not any(r.name == "overlong" for r in out):
        penalty = get("overlong", max_len=cfg.rollout.max_new_tokens, cache_len=cfg.algo.overlong_cache_len)
        out.append(WeightedReward("overlong", penalty, 1.0))
    return _unique_names(out)


def _unique_names(rewards: list[WeightedReward]) -> list[WeightedReward]:
    """Metric names (``reward_<name>_mean``) must not collide: a repeated name gets ``_2``, ``_3``..."""
    seen: dict[str, int] = {}
    for r in rewards:
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name}_{seen[r.name]}"
    return rewards


def _step_metrics(step: int, rollout: Rollout, scores, adv_B: torch.Tensor, stats: dict, times) -> dict:
    t0, t_sampled, t1, _, t3 = times  # start, sampling done (summed), generation done, advantages, update
    total, lengths = scores.total, rollout.completion_lengths.float()
    nan = float("nan")
    m = {
        "step": step,
        "loss": stats["loss"],
        "reward_mean": float(total.mean()),
        "reward_std": float(total.std()),
        **{f"reward_{k}_mean": float(v.nanmean()) for k, v in scores.per_reward.items()},
        "accuracy": None if scores.verifier is None else float(scores.verifier.nanmean()),
        "advantage_mean": float(adv_B.mean()),
        "advantage_std": float(adv_B.std()),
        "advantage_abs_mean": float(adv_B.abs().mean()),
        "zero_std_fraction": float(zero_std_groups(total, rollout.group_size).float().mean()),
        "kl": stats.get("kl", nan),
        "clip_fraction": stats.get("clip_fraction", 0.0),
        "clip_fraction_low": stats.get("clip_fraction_low", 0.0),
        "clip_fraction_high": stats.get("clip_fraction_high", 0.0),
        "ratio_mean": stats.get("ratio_mean", nan),
        "ratio_max": stats.get("ratio_max", nan),
        "entropy": stats.get("entropy", nan),
        "completion_length_mean": float(lengths.mean()),
        "completion_length_max": int(lengths.max()),
        "truncated_fraction": float(rollout.truncated.float().mean()),
        "grad_norm": stats["grad_norm"],
        "lr": stats["lr"],
        "optimizer_step_skipped": stats["optimizer_step_skipped"],
        "num_unscored": scores.num_unscored,
        "reward_failures": scores.num_failed,
        "time_sampling_s": t_sampled - t0,
        "time_scoring_s": t1 - t_sampled,
        "time_training_s": t3 - t1,
        "tokens_per_s": float(lengths.sum()) / max(t3 - t0, 1e-9),
    }
    return m


class _NoLogger:
    """Ranks other than 0 write nothing: the run directory is rank 0's."""

    def log_step(self, metrics: dict) -> None: ...

    def log_samples(self, rows: list[dict]) -> None: ...

    def print(self, text: str) -> None: ...

    def close(self) -> None: ...


class _StopOnSignal:
    """While active, SIGINT / SIGTERM only set ``signum``: the loop stops at the end of the step.

    A second signal while stopping restores the default behaviour (a second Ctrl-C kills).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
        self.signum = signum

    def __enter__(self) -> _StopOnSignal:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self._old = {}
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def truncate_logs(run_dir: Path, step: int) -> None:
    """Keep only the metrics.jsonl / samples.jsonl lines of steps <= ``step`` (atomic rewrite).

    After a crash the logs may run past the checkpoint being resumed; those steps are re-run, so
    their old lines go, and every step ends up logged exactly once.
    """
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if not path.exists():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a line cut by the crash: nothing after it is trustworthy
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
