"""Tools: schemas from plain functions, the two call formats (including broken calls), execution with
errors and hangs cut off by the tool's own timeout, and the tool environment's turn."""

from __future__ import annotations

import time

import pytest

from grpokit.envs import Tool, ToolBox, ToolEnv, parse_calls
from grpokit.envs.base import make_env_factory
from grpokit.envs.tools import calculator, load_tool
from grpokit.errors import ConfigError


def weather(city: str, days: int = 1, metric: bool | None = None) -> str:
    """Forecast for a city.

    More text that is not the description.

    Args:
        city: the city's name
        days (int): how many days ahead
    """
    return f"{city}: sunny for {days} days"


def explode(x: int) -> int:
    """Always fails."""
    raise ValueError(f"no {x}")


def hang(x: int) -> int:
    """Never returns."""
    time.sleep(60)
    return x


def untyped(x) -> int:
    """No hint."""
    return x


def test_schema_from_type_hints_and_docstring():
    schema = Tool.from_function(weather).schema
    assert schema == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name"},
                    "days": {"type": "integer", "description": "how many days ahead"},
                    "metric": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    }


@pytest.mark.parametrize(
    ("fn", "match"),
    [(untyped, "needs a type hint"), (lambda x: x, "module-level"), (time.sleep, "module-level")],
)
def test_functions_that_cannot_be_tools_are_refused(fn, match):
    with pytest.raises(ConfigError, match=match):
        Tool.from_function(fn)


def test_hermes_calls():
    text = (
        'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
        "<tool_call>{name: broken}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    calls = parse_calls(text, "hermes")
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "2*3"}, True),
        ("weather", {"city": "Oslo"}, True),
    ]
    assert "not valid JSON" in calls[2].error and "JSON object" in calls[3].error
    assert parse_calls("no call here </tool_call>", "hermes") == []


def test_pythonic_calls():
    calls = parse_calls("<call>calculator('12*3')</call> <call>weather('Oslo', days=2)</call>", "pythonic")
    assert [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"__positional__": ["12*3"]}),
        ("weather", {"__positional__": ["Oslo"], "days": 2}),
    ]
    assert "literals" in parse_calls("<call>f(x)</call>", "pythonic")[0].error
    assert "function call" in parse_calls("<call>12*3</call>", "pythonic")[0].error
    assert "function call" in parse_calls("<call>f(</call>", "pythonic")[0].error


@pytest.fixture(scope="module")
def box():
    return ToolBox([Tool.from_function(f) for f in (weather, explode, hang, calculator)], timeout_s=1.5)


def test_toolbox_runs_calls_and_reports_each_failure(box):
    calls = parse_calls(
        "<call>weather('Oslo', days=3)</call><call>calculator('1234*5678')</call><call>explode(4)</call>"
        "<call>nosuch(1)</call><call>weather()</call><call>weather('a', hours=2)</call>"
        "<call>calculator('1/0')</call><call>bad(</call>",
        "pythonic",
    )
    results = box.run(calls)
    assert [r.ok for r in results] == [True, True, False, False, False, False, False, False]
    assert results[0].content == "Oslo: sunny for 3 days"
    assert results[1].content == str(1234 * 5678)
    assert results[2].content == "error: explode raised ValueError: no 4"
    assert "no tool named 'nosuch'" in results[3].content and "calculator" in results[3].content
    assert "missing the argument 'city'" in results[4].content
    assert "no argument 'hours'" in results[5].content
    assert "cannot evaluate" in results[6].content
    assert results[7].content.startswith("error: the tool call is not a function call")


def test_a_hanging_tool_is_cut_off_by_its_timeout_and_the_next_call_works(box):
    t = time.monotonic()
    (hung,) = box.run(parse_calls("<call>hang(1)</call>", "pythonic"))
    assert not hung.ok and hung.content == "error: hang took longer than 1.5 s"
    assert time.monotonic() - t < 10
    (ok,) = box.run(parse_calls("<call>calculator('6*7')</call>", "pythonic"))
    assert ok.ok and ok.content == "42"


def test_tool_env_turn(box):
    env = ToolEnv(box, "hermes")
    assert env.reset({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert env.tool_schemas == box.schemas and env.stop == ()
    res = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "7*6"}}</tool_call>'
                   "<tool_call>{oops}</tool_call>")  # fmt: skip
    assert res.observation == [
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "tool", "name": "unknown", "content": res.observation[1]["content"]},
    ]
    assert res.observation[1]["content"].startswith("error: the tool call is not valid JSON")
    assert res.info == {"tool_calls": 2, "tool_errors": 1}  # the episode goes on with the error shown
    assert env.step("The answer is 42.").observation is None  # no call: the episode is over
    assert ToolEnv(box, "pythonic").stop == ("</call>",)


def test_env_factory_and_tool_loading():
    make = make_env_factory("calculator", tools=[], tool_format="pythonic", tool_timeout_s=3)
    env = make()
    assert env is not make() and list(env.toolbox.tools) == ["calculator"]
    assert load_tool("tests.envs.test_tools:weather").name == "weather"
    with pytest.raises(ConfigError, match="unknown tool 'abacus'"):
        load_tool("abacus")
    with pytest.raises(ConfigError, match=r"needs rollout\.tools"):
        make_env_factory("tools", tools=[], tool_format="hermes", tool_timeout_s=3)
    with pytest.raises(ConfigError, match="not a subclass"):
        make_env_factory("tests.envs.test_tools:weather", tools=[], tool_format="hermes", tool_timeout_s=3)
    custom = make_env_factory(
        "tests.rollout.test_episodes:Echo", tools=[], tool_format="hermes", tool_timeout_s=3
    )
    assert custom().reset({"prompt": "x"}) == [{"role": "user", "content": "x"}]


def test_python_tool_runs_in_the_sandbox():
    from pathlib import Path

    from grpokit.envs.tools import python

    assert python("print(6 * 7)") == "42"
    readme = Path(__file__).resolve().parents[2] / "README.md"  # the checkout: not visible inside
    assert readme.is_file()
    out = python(f"print(open({str(readme)!r}).read()[:20])")
    assert "FileNotFoundError" in out, out
