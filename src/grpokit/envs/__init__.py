"""Multi-turn environments and tools: the interface (``base``), tools from Python functions and their
call formats (``tools``), conversation rendering for token-exact episodes (``render``)."""

from grpokit.envs.base import Environment, StepResult, ToolEnv, make_env_factory
from grpokit.envs.tools import Tool, ToolBox, ToolCall, parse_calls

__all__ = [
    "Environment",
    "StepResult",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolEnv",
    "make_env_factory",
    "parse_calls",
]
