"""Tools from plain Python functions: a JSON schema, tool calls parsed from the model's text, execution
with a hard timeout.

What it does: ``Tool.from_function(fn)`` reads ``fn``'s type hints and docstring (first paragraph:
the description; ``name: text`` lines under ``Args:``: the parameters) into the OpenAI/Hugging Face
function schema that chat templates take as ``tools=``. ``parse_calls(text, fmt)`` finds the calls a
completion makes, in one of two formats:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, SmolLM3
  and the templates that follow them);
- ``pythonic``: ``<call>name('text', 3, key=1)</call>`` with literal arguments only (the Llama 3.2
  style, in ASCII the embedded character-level model can write).

``ToolBox.run(calls)`` executes them in worker processes (``rewards.workers``), each with its own
wall-clock timeout: a tool that raises, hangs or is called wrongly returns an error text to the
model (the episode goes on) and is counted, never an exception in the trainer.

What it deliberately does not do: run model-written code in the trainer's process. The ``python``
tool runs it in ``rewards.sandbox`` (bubblewrap); ``calculator`` parses arithmetic without ``eval``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

from grpokit.errors import ConfigError
from grpokit.rewards.workers import shared_pool

FORMATS = ("hermes", "pythonic")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_PYTHONIC = re.compile(r"<call>(.*?)</call>", re.S)
# where a call ends: the model's turn stops there (pythonic) so the result can be inserted
STOP = {"hermes": (), "pythonic": ("</call>",)}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., object]  # module-level, so a worker process can import it
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

    @classmethod
    def from_function(cls, fn: Callable[..., object]) -> Tool:
        """The tool of a plain function with type hints on every parameter and a docstring."""
        name = fn.__name__
        if not inspect.isfunction(fn) or "<locals>" in fn.__qualname__ or name == "<lambda>":
            raise ConfigError(
                f"tool {name!r} must be a module-level function (it runs in a worker process that imports it)"
            )
        doc = inspect.getdoc(fn)
        if not doc:
            raise ConfigError(
                f"tool {name!r} needs a docstring: its first paragraph tells the model what it does"
            )
        hints = typing.get_type_hints(fn)
        described = _arg_descriptions(doc)
        props, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ConfigError(f"tool {name!r}: *args / **kwargs cannot be described to the model")
            if p.name not in hints:
                raise ConfigError(
                    f"tool {name!r}: parameter {p.name!r} needs a type hint (str, int, float, ...)"
                )
            props[p.name] = {"type": _json_type(hints[p.name], name, p.name)}
            if p.name in described:
                props[p.name]["description"] = described[p.name]
            if p.default is p.empty:
                required.append(p.name)
        description = doc.split("\n\n")[0].replace("\n", " ").strip()
        params = {"type": "object", "properties": props, "required": required}
        schema = {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": params},
        }
        return cls(name, fn, schema)


def _json_type(hint, tool: str, param: str) -> str:
    origin = typing.get_origin(hint) or hint
    if origin in (typing.Union, types.UnionType):  # Optional[X]: describe X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0], tool, param)
    if origin in _JSON_TYPES:
        return _JSON_TYPES[origin]
    raise ConfigError(
        f"tool {tool!r}: parameter {param!r} has type {hint!r}; use str, int, float, bool, list or dict"
    )


def _arg_descriptions(doc: str) -> dict[str, str]:
    """``name: text`` lines of a Google-style ``Args:`` section."""
    out, in_args = {}, False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith(" "):
                in_args = False
    return out


@dataclass
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be parsed (the model is told)


def parse_calls(text: str, fmt: str) -> list[ToolCall]:
    """Every tool call in ``text``, in order; a malformed one comes back with ``error`` set."""
    if fmt == "hermes":
        return [_parse_hermes(body) for body in _HERMES.findall(text)]
    if fmt == "pythonic":
        return [_parse_pythonic(body) for body in _PYTHONIC.findall(text)]
    raise ConfigError(f"unknown tool-call format {fmt!r}; formats: {', '.join(FORMATS)}")


def _parse_hermes(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"the tool call is not valid JSON ({e.msg} at position {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="the tool call's arguments are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="the tool call's arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def _parse_pythonic(body: str) -> ToolCall:
    try:
        node = ast.parse(body.strip(), mode="eval").body
    except SyntaxError:
        return ToolCall(None, error="the tool call is not a function call like name('text', 3)")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall(None, error="the tool call is not a function call like name('text', 3)")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return ToolCall(node.func.id, error="tool arguments must be literals (strings, numbers)")
    return ToolCall(node.func.id, {"__positional__": args, **kwargs} if args else kwargs)


@dataclass
class ToolResult:
    name: str | None
    content: str  # what the model reads: the value, or the error
    ok: bool


def _invoke(task: tuple[str, str, dict]) -> object:
    """Worker side: import the tool's function and call it (module-level, for the worker pool)."""
    module, qualname, arguments = task
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    positional = arguments.pop("__positional__", [])
    return fn(*positional, **arguments)


class ToolBox:
    """The tools an environment offers, run in worker processes with ``timeout_s`` each."""

    def __init__(self, tools: list[Tool], timeout_s: float = 10.0, num_workers: int = 2) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"two tools share a name: {names}")
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.num_workers = timeout_s, num_workers

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; the valid calls run in parallel."""
        results: list[ToolResult | None] = [None] * len(calls)
        tasks, where = [], []
        for i, call in enumerate(calls):
            problem = call.error or self._check(call)
            if problem:
                results[i] = ToolResult(call.name, f"error: {problem}", False)
                continue
            fn = self.tools[call.name].fn
            tasks.append((fn.__module__, fn.__qualname__, dict(call.arguments)))
            where.append(i)
        if tasks:
            pool = shared_pool(self.num_workers, self.timeout_s)
            for i, res in zip(where, pool.map(_invoke, tasks), strict=True):
                name = calls[i].name
                if res.ok:
                    results[i] = ToolResult(name, _as_text(res.value), True)
                elif res.timed_out:
                    results[i] = ToolResult(name, f"error: {name} took longer than {self.timeout_s} s", False)
                else:
                    results[i] = ToolResult(name, f"error: {name} raised {res.error}", False)
        return results  # type: ignore[return-value]

    def _check(self, call: ToolCall) -> str | None:
        if call.name not in self.tools:
            return f"no tool named {call.name!r}; tools: {', '.join(self.tools)}"
        params = self.tools[call.name].schema["function"]["parameters"]
        given = dict(call.arguments)
        positional = given.pop("__positional__", [])
        names = list(params["properties"])
        if len(positional) > len(names):
            return f"{call.name} takes {len(names)} arguments, got {len(positional)}"
        bound = set(names[: len(positional)]) | set(given)
        unknown = sorted(set(given) - set(names))
        if unknown:
            return f"{call.name} has no argument {unknown[0]!r}; arguments: {', '.join(names)}"
        missing = [n for n in params["required"] if n not in bound]
        if missing:
            return f"{call.name} is missing the argument {missing[0]!r}"
        return None


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


# --- built-in tools -------------------------------------------------------------------------------


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * / and parentheses.

    Args:
        expression: the expression, for example '1234*567'
    """
    from grpokit.data.tasks import evaluate_arithmetic

    value = evaluate_arithmetic(expression)
    if value is None:
        raise ValueError(f"cannot evaluate {expression!r}: use integers, + - * / and parentheses")
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


_SANDBOX = None


def python(code: str) -> str:
    """Run a Python program in an isolated sandbox and return what it prints (stdout, then stderr).

    Args:
        code: the program's source
    """
    from grpokit.rewards.sandbox import Limits, Sandbox, default_python

    global _SANDBOX
    if _SANDBOX is None:  # one per worker process: its start-up check runs once
        _SANDBOX = Sandbox(limits=Limits(wall_s=4.0, cpu_s=3))
    res = _SANDBOX.run({"main.py": code}, [default_python(), "main.py"])
    if res.timed_out:
        return "error: the program ran out of time"
    out = (res.stdout + res.stderr).strip()
    return out[-2000:] if out else f"(no output, exit status {res.returncode})"


BUILTIN_TOOLS: dict[str, Callable[..., object]] = {"calculator": calculator, "python": python}


def load_tool(spec: str) -> Tool:
    """A built-in tool's name or ``module:function``."""
    if spec in BUILTIN_TOOLS:
        return Tool.from_function(BUILTIN_TOOLS[spec])
    if ":" not in spec:
        raise ConfigError(
            f"unknown tool {spec!r}; built-in tools: {', '.join(BUILTIN_TOOLS)}, or 'module:function'"
        )
    return Tool.from_function(import_spec(spec, "tool"))


def import_spec(spec: str, what: str):
    """The object a user's ``module:name`` names; a ConfigError naming ``what`` when it cannot be had."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load {what} {spec!r}: {e}") from e
