"""The GRPO loop: sample -> score -> advantages -> mu inner epochs of micro-batched updates.

What it does: ``GRPOTrainer(config).train()`` runs ``train.max_steps`` steps. Each step takes
``prompts_per_step`` rows, samples ``group_size`` completions per prompt, scores them with the
configured rewards, turns rewards into group-relative advantages, and makes ``mu`` optimizer
steps on that batch with pi_old fixed to the sampling policy. Everything about the run goes to
the run directory (config.yaml, metrics.jsonl, samples.jsonl, summary.json, final/, report.html).

The step is a sequence of named stages (``train_step``), each decided in its own place: the
generation loop with DAPO's dynamic sampling (train/generate.py), rewards (rewards/), advantages
(algo/), the update stages -- pi_old / pi_ref, corrections, optimizer steps (train/update.py) --
and the step's metrics (train/metrics.py).

Decisions worth knowing:
- Dropout is off throughout (the model stays in eval mode): with it on, pi_theta would differ
  from pi_old at the very first inner step and the ratio would be noise, not 1.
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
import random
import time
from pathlib import Path

import torch

from grpokit.algo import decoupled_advantages, group_advantages
from grpokit.config import GRPOConfig, rollout_env
from grpokit.data.datasets import RowsSource, build_prompt, build_sources, filter_long_prompts
from grpokit.diagnostics.hacking import HackingMonitor
from grpokit.errors import CheckpointError, ConfigError, RunExistsError, TrainingInterrupted
from grpokit.models.fused_layers import fuse_layers
from grpokit.models.loading import (
    keep_head_float32,
    load_model,
    lora_merge_reason,
    merged_state_dict,
    mixed_precision,
)
from grpokit.report import write_report
from grpokit.rewards.registry import (
    Scores,
    TrainerProgress,
    build_rewards,
    check_reward_columns,
    concat_scores,
    conversational_prompts,
    reward_columns,
    score,
)
from grpokit.rollout.decode import own_decoder_reason
from grpokit.rollout.episodes import episode_columns, episodes_from_config, rollout_prompts, rollout_rows
from grpokit.rollout.sampler import Rollout, SamplingParams, concat_rollouts, pad_token_id
from grpokit.rollout.vllm_engine import engine_from_config
from grpokit.train.batch import (
    TrainBatch,
    plan_optimizer_steps,
)
from grpokit.train.checkpoint import (
    StopOnSignal,
    TrainerState,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from grpokit.train.distributed import (
    full_parameters,
    full_state_dict,
    init_distributed,
)
from grpokit.train.evaluate import evaluate_sharded
from grpokit.train.generate import collect_groups
from grpokit.train.metrics import (
    NoLogger,
    RunLogger,
    json_safe,
    run_summary,
    sample_rows,
    step_metrics,
    truncate_logs,
)
from grpokit.train.update import Learner


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
        a, d, t = cfg.algo, cfg.data, cfg.train
        self.dist = init_distributed(cfg.distributed.strategy, cfg.distributed.backend)
        W, P = self.dist.world_size, t.prompts_per_step
        if P % W or t.steps_per_generation > P // W:
            raise ConfigError(
                f"train.prompts_per_step={P} must be a multiple of the world size {W} with at least "
                f"train.steps_per_generation={t.steps_per_generation} prompts per rank "
                "(a group never spans ranks); change prompts_per_step or --nproc-per-node"
            )
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        # data and rewards first: a missing column fails here, before any model loads
        self.train_source, self.eval_rows = build_sources(d, t.seed, dataset, eval_dataset)
        overlong = (cfg.rollout.max_new_tokens, a.overlong_cache_len) if a.overlong_penalty else None
        self.rewards = build_rewards(cfg.rewards, d.task, given=rewards, overlong=overlong)
        first_rows = [(self.train_source.row(0), "training data")] + [
            (r, "held-out data") for r in self.eval_rows[:1]
        ]
        env_columns = {"conversation": None, "env_reward": None} if rollout_env(cfg) else {}
        for row, where in first_rows:
            check_reward_columns(self.rewards, row | env_columns, d.prompt_column, d.answer_column, where)
        if t.eval_every and not self.eval_rows:
            raise ConfigError("train.eval_every > 0 needs held-out rows: set data.eval_path or a data.task")
        if model is None:
            model, tokenizer = load_model(
                cfg.model.name_or_path,
                cfg.model.dtype,
                self.dist.device(),
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
        if cfg.model.fused_layers and (why := fuse_layers(model)):
            self._print(f"grpokit: norms and MLPs keep their own autograd: {why}")
        self.pad_id = pad_token_id(tokenizer)
        self.num_filtered_prompts = 0
        if d.max_prompt_length is not None:
            self.train_source, self.eval_rows, self.num_filtered_prompts, note = filter_long_prompts(
                self.train_source, self.eval_rows, d.max_prompt_length,
                lambda row: len(tokenizer(self._prompt(row))["input_ids"]), self._prompt,
                seed=t.seed, shuffle=d.shuffle,
            )  # fmt: skip
            if note:
                self._print(note)
        self.learner = Learner(cfg, model, self.dist, self.pad_id)
        if cfg.model.fused_logprobs and not self.learner.fused_head:
            self._print(f"grpokit: training log-probs use the full logits: {self.learner.fused_head_off}")
        if t.packing and not self.learner.packed:
            self._print(f"grpokit: micro-batches are padded, not packed: {self.learner.packing_off}")
        if t.share_prompts and self.learner.share is None:
            self._print(f"grpokit: each row computes its own prompt: {self.learner.sharing_off}")
        self.generator = torch.Generator(self.device).manual_seed(t.seed)
        if cfg.rollout.engine == "vllm" and (why := lora_merge_reason(model)):
            raise ConfigError(
                f"rollout.engine=vllm pushes plain weights with the LoRA adapters merged in, and {why}; "
                "use rollout.engine=builtin for this model"
            )
        self.engine, self._engine_stale = engine_from_config(cfg, tokenizer), True
        self.episodes = episodes_from_config(cfg, tokenizer, rollout_env(cfg))  # None: single turns
        r = cfg.rollout
        self.sampling = SamplingParams(
            r.max_new_tokens, r.temperature, r.top_p, r.top_k, tuple(r.stop), r.decode, r.reorder_weights,
            r.share_prompts,
        )  # fmt: skip
        longest = None if d.max_prompt_length is None else d.max_prompt_length + r.max_new_tokens
        own = self.engine is None and r.decode == "auto"  # FSDP: the sampler decodes with shards gathered
        if own and (why := own_decoder_reason(model, longest, gathered=self.dist.fsdp)):
            self._print(f"grpokit: the sampler runs the model's Hugging Face forward: {why}")
        if self.engine is not None and (why := self.engine.logprobs_reason(self.sampling)):
            self._print(f"grpokit: vLLM rollouts carry no sampler log-probs (logprob_mismatch null): {why}")
        self.step, self.rows_consumed = 0, 0
        self.monitor = HackingMonitor(cfg.monitor) if cfg.monitor.enabled else None
        self._last_completions: list[str] = []
        self.stop_reason: str | None = None
        self.run_dir = Path(t.output_dir)

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
            else NoLogger()
        )
        last: dict = {}
        with StopOnSignal() as stop:
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
        """One generation step, as its stages in order. Returns (metrics, sample rows)."""
        t0 = time.perf_counter()
        prompts_B, rollout, scores, gen = self._generate()  # sample and score (DAPO: keep drawing)
        t1 = time.perf_counter()
        batch, plans = self._batch(rollout)  # the loss mask, micro-batch plans per optimizer step
        learner = self.learner
        old_logp, ref_logp = learner.logprobs(batch, plans)  # pi_old (when it differs from pi_theta), pi_ref
        total_B = learner.shaped_rewards(scores.total, batch, old_logp, ref_logp)  # KL in the reward (rloo)
        batch.advantages = self._advantages(total_B, scores)
        self._dump_advantages(total_B, batch.advantages, rollout.group_size)
        behaviour, is_weights = learner.off_policy(rollout, batch, old_logp)  # top-k/p pi_old, IS weights
        t2 = time.perf_counter()
        # the sampler's log-probs are compared with pi_old: here when it was recomputed, else in the update
        in_update = old_logp is None and rollout.sampler_logp is not None
        stats, lr, skipped = learner.update(
            batch, plans, self.step, behaviour, ref_logp, is_weights,
            rollout.sampler_logp if in_update else None, self._dump_path(),
        )  # fmt: skip
        if stats.nonfinite_grad_steps:
            self._print(
                f"grpokit: step {self.step}: {stats.nonfinite_grad_steps} optimizer step(s) skipped, the "
                f"gradient norm was {stats.grad_norm} (the weights are unchanged by them; a lower "
                "train.lr, or model.autocast: null, if it recurs)"
            )
        self._engine_stale = True
        learner.sync_reference(self.step)
        times = (t0, t0 + gen["time_sampling_s"], t1, t2, time.perf_counter())
        extra = dict(lr=lr, optimizer_step_skipped=int(skipped), generation_batches=gen["batches"])
        extra.update(learner.mismatch(rollout, batch, old_logp, stats, is_weights))
        return self._step_record(prompts_B, rollout, scores, batch.advantages, stats, times, extra)

    def _batch(self, rollout: Rollout) -> tuple[TrainBatch, list[list[list[int]]]]:
        loss_mask = None
        if self.cfg.algo.mask_truncated_completions:  # truncated completions get no loss (DAPO)
            loss_mask = rollout.trained_mask & ~rollout.truncated[:, None]
        batch = TrainBatch.from_rollout(rollout, torch.zeros(rollout.num_rows), loss_mask)
        t = self.cfg.train
        plans = plan_optimizer_steps(
            batch.total_lengths(), self.cfg.rollout.group_size, t.steps_per_generation,
            t.micro_batch_size, t.micro_batch_tokens, keep_empty=self.dist.enabled,
            keep_groups=self.learner.share is not None,
        )  # fmt: skip
        return batch, plans

    def _dump_path(self) -> Path | None:
        """Where the update dumps its first micro-batch (``train.dump_tensors``; rank 0's directory)."""
        if not (self.cfg.train.dump_tensors and self.dist.is_main):
            return None
        (self.run_dir / "tensors").mkdir(exist_ok=True)
        return self.run_dir / "tensors" / f"step-{self.step:06d}.pt"

    # the learner's state, as before (checkpoints, tests and users read these)
    optimizer = property(lambda self: self.learner.optimizer)
    ref_model = property(lambda self: self.learner.ref_model)
    adapter_ref = property(lambda self: self.learner.adapter_ref)
    train_module = property(lambda self: self.learner.train_module)

    @property
    def num_skipped_steps(self) -> int:
        return self.learner.num_skipped_steps

    @num_skipped_steps.setter
    def num_skipped_steps(self, value: int) -> None:
        self.learner.num_skipped_steps = value

    def _dump_advantages(self, total_B: torch.Tensor, adv_B: torch.Tensor, group_size: int) -> None:
        if self.cfg.train.dump_tensors and self.dist.is_main:  # what the advantages were computed from
            (self.run_dir / "tensors").mkdir(exist_ok=True)
            where = self.run_dir / "tensors" / f"step-{self.step:06d}-advantages.pt"
            torch.save({"rewards": total_B, "advantages": adv_B, "group_size": group_size}, where)

    def _step_record(self, prompts_B, rollout, scores, adv_B, stats, times, extra) -> tuple[dict, list[dict]]:
        """The step's metrics and sample rows, over the whole step's batch (gathered from every rank
        in rank order; itself in one process)."""
        if self.dist.enabled:
            parts = self.dist.all_gather_objects((prompts_B, rollout, scores, adv_B))
            prompts_B = [p for part in parts for p in part[0]]
            rollout = concat_rollouts([part[1] for part in parts], self.pad_id)
            scores = concat_scores([part[2] for part in parts])
            adv_B = torch.cat([part[3] for part in parts])
        metrics = step_metrics(self.step, rollout, scores, adv_B, stats, times)
        for name, value in scores.logged_metrics.items():  # the rewards' log_metric calls
            if name in metrics:
                raise ValueError(
                    f"a reward's log_metric({name!r}, ...) would overwrite grpokit's metric {name!r}"
                )
            metrics[name] = value
        metrics.update(extra, num_skipped_steps=self.num_skipped_steps)
        self._last_completions = rollout.completions
        t = self.cfg.train
        return metrics, sample_rows(t.seed, self.step, t.log_samples, prompts_B, rollout, scores, adv_B)

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

    def _generate(self) -> tuple[list[str], Rollout, Scores, dict]:
        """Sample and score this rank's ``prompts_per_step / world_size`` groups (with DAPO's dynamic
        sampling: only informative ones, drawing up to ``algo.dynamic_sampling_max_batches``)."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        P, d = cfg.train.prompts_per_step // self.dist.world_size, cfg.data

        def draw(score_it: bool):
            t = time.perf_counter()
            rows, prompts = self._next_prompts(cfg.train.prompts_per_step)
            rollout = self._sample(rows, prompts, P)
            if self.episodes is None:
                prompts_B = [p for p in prompts for _ in range(G)]
            else:  # the prompts as the environment rendered them
                prompts_B = rollout_prompts(rollout, self.tokenizer)
            seconds = time.perf_counter() - t
            if not score_it:
                return prompts_B, rollout, None, seconds
            scores = score(
                self.rewards,
                prompts_B,
                rollout.completions,
                reward_columns(rows, G, d.prompt_column, d.answer_column) | episode_columns(rollout),
                rollout.completion_token_lists(),
                messages=conversational_prompts(rows, G, d.prompt_column),
                state=self._progress(),
            )
            return prompts_B, rollout, scores, seconds

        a = cfg.algo
        return collect_groups(
            draw, P, G, dynamic=a.dynamic_sampling, max_batches=a.dynamic_sampling_max_batches,
            dist=self.dist, pad_id=self.pad_id,
        )  # fmt: skip

    def _sample(self, rows: list[dict], prompts: list[str], P: int) -> Rollout:
        """This rank's G completions (or episodes) per prompt, from the built-in sampler or vLLM."""
        G, W, r = self.cfg.rollout.group_size, self.dist.world_size, self.dist.rank
        if self.engine is None:
            with full_parameters(self.model, self.dist):
                return rollout_rows(
                    self.model, self.tokenizer, rows, prompts, G, self.sampling, self.generator,
                    episodes=self.episodes, row_offset=r * P * G, num_rows_total=W * P * G,
                    policy_version=self.step - 1,
                )  # fmt: skip
        if self._engine_stale:  # push the weights of the last update to vLLM (a collective under FSDP)
            self.engine.load_weights(merged_state_dict(self.model).items())
            self._engine_stale = False
        seed = int(torch.randint(2**31 - 1, (1,), generator=self.generator, device=self.device))
        at = dict(first_prompt_index=r * P, policy_version=self.step - 1)
        if self.episodes is not None:
            e = self.episodes
            return self.engine.sample_episodes(
                rows, e.make_env, G, self.sampling, seed,
                max_turns=e.max_turns, max_episode_tokens=e.max_episode_tokens, **at,
            )  # fmt: skip
        return self.engine.sample(prompts, G, self.sampling, seed, **at)

    def _progress(self) -> TrainerProgress:
        """``trainer_state`` for the rewards: the step, the epoch over a finite dataset, max_steps."""
        n = len(self.train_source) if isinstance(self.train_source, RowsSource) else 0
        epoch = self.rows_consumed / n if n else 0.0
        return TrainerProgress(self.step, epoch, self.cfg.train.max_steps)

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

    def _print(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)

    def _evaluate(self) -> dict:
        """Greedy held-out evaluation of the first ``train.eval_max_prompts`` rows (evaluate.py)."""
        rows = self.eval_rows[: self.cfg.train.eval_max_prompts]
        with full_parameters(self.model, self.dist), mixed_precision(self.device, self.cfg.model.autocast):
            return evaluate_sharded(
                self.model,
                self.tokenizer,
                rows,
                self._prompt,
                self.rewards,
                self.cfg,
                self.dist,
                self.episodes,
            )

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
        alerts = [] if self.monitor is None else [vars(a) for a in self.monitor.alerts]
        counts = dict(
            num_skipped_steps=self.num_skipped_steps, num_filtered_prompts=self.num_filtered_prompts
        )
        return run_summary(self.step, wall, self.dist.world_size, counts, alerts, self.stop_reason, last,
                           self.cfg.data.task, before, after)  # fmt: skip
