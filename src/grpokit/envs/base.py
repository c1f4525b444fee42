"""The environment interface, the tool-using environment, and how a config names one.

What it does: an :class:`Environment` starts an episode from a data row (``reset(row)`` -> the
first messages) and answers each model turn (``step(completion)`` -> observation messages, or
None when the episode is over, an optional reward, and info). The sampler
(``rollout.episodes``) runs one environment per completion and keeps the episode's tokens exact.
:class:`ToolEnv` is the common case: the row's prompt as the user message; each turn's tool calls
are parsed, run (``tools.ToolBox``) and answered with one tool message per call; a turn without
a call ends the episode. ``make_env_factory`` turns ``rollout.env`` (``tools``, ``calculator`` or
``module:Class``) into a function that makes a fresh environment per episode.

What it deliberately does not do: sample, tokenize or score. Rewards come from the reward
functions, which receive the whole conversation (``conversation``) and the sum of the
environment's rewards (``env_reward``) as columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from grpokit.envs.tools import FORMATS, STOP, ToolBox, import_spec, load_tool, parse_calls
from grpokit.errors import ConfigError


@dataclass
class StepResult:
    observation: list[dict] | None  # messages to append, or None: the episode is over
    reward: float | None = None
    info: dict = field(default_factory=dict)  # numbers under "tool_calls" / "tool_errors" are counted


class Environment:
    """Subclass and implement ``reset`` and ``step``. One instance runs one episode.

    ``stop``: strings that end a model turn besides EOS (a tool call's closing tag), so the
    environment can answer mid-message. ``tool_schemas``: JSON schemas the chat template shows."""

    stop: tuple[str, ...] = ()
    tool_schemas: list[dict] | None = None

    def reset(self, row: dict) -> list[dict]:
        raise NotImplementedError

    def step(self, completion: str) -> StepResult:
        raise NotImplementedError


class ToolEnv(Environment):
    """The row's prompt as the user message; the model's tool calls answered until it makes none."""

    def __init__(
        self,
        toolbox: ToolBox,
        tool_format: str = "hermes",
        prompt_column: str = "prompt",
        system_prompt: str | None = None,
    ) -> None:
        if tool_format not in FORMATS:
            raise ConfigError(f"unknown tool-call format {tool_format!r}; formats: {', '.join(FORMATS)}")
        self.toolbox, self.tool_format = toolbox, tool_format
        self.prompt_column, self.system_prompt = prompt_column, system_prompt
        self.stop = STOP[tool_format]
        self.tool_schemas = toolbox.schemas

    def reset(self, row: dict) -> list[dict]:
        prompt = row[self.prompt_column]
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, completion: str) -> StepResult:
        calls = parse_calls(completion, self.tool_format)
        if not calls:
            return StepResult(None)
        results = self.toolbox.run(calls)
        observation = [{"role": "tool", "name": r.name or "unknown", "content": r.content} for r in results]
        errors = sum(not r.ok for r in results)
        return StepResult(observation, None, {"tool_calls": len(calls), "tool_errors": errors})


BUILTIN_ENVS = ("tools", "calculator")


def make_env_factory(
    env: str,
    *,
    tools: list[str],
    tool_format: str,
    tool_timeout_s: float,
    prompt_column: str = "prompt",
    system_prompt: str | None = None,
    env_args: dict | None = None,
) -> Callable[[], Environment]:
    """``rollout.env`` as a function that makes a fresh environment for each episode.

    ``tools``: the ToolEnv's tools (built-in names or ``module:function``; ``calculator`` adds
    the calculator when not listed). ``module:Class`` is called with ``env_args`` as keywords."""
    if env in BUILTIN_ENVS:
        names = list(tools) + (["calculator"] if env == "calculator" and "calculator" not in tools else [])
        if not names:
            raise ConfigError(
                "rollout.env=tools needs rollout.tools (e.g. [calculator, python, 'module:function'])"
            )
        box = ToolBox([load_tool(n) for n in names], timeout_s=tool_timeout_s)
        return lambda: ToolEnv(box, tool_format, prompt_column, system_prompt)
    if ":" not in env:
        raise ConfigError(
            f"unknown rollout.env {env!r}; built-in: {', '.join(BUILTIN_ENVS)}, or 'module:Class'"
        )
    cls = import_spec(env, "rollout.env")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"rollout.env {env!r} is not a subclass of grpokit.envs.Environment")
    kwargs = dict(env_args or {})
    return lambda: cls(**kwargs)
