r"""``code_tests``: run a completion's code against the sample's tests, inside ``rewards.sandbox``.

What it does: takes the last fenced code block of the completion and the ``tests`` column --
Python asserts of the form ``assert CALL == LITERAL`` (one per line, MBPP style), or a list of
``{"input": ..., "output": ...}`` stdin/stdout cases -- and scores the fraction of tests passed
(or 1.0 only when all pass, ``mode="all"``).

Why it is hard to fool: the expected values never enter the sandbox. For asserts, the parent
splits each into the call (sent in) and the expected literal (kept out); the sandboxed harness only
prints ``repr`` of each call's result, and the parent parses it with ``ast.literal_eval`` and
compares. So exiting early (``sys.exit(0)``, ``os._exit(0)``) reports nothing and passes nothing;
an object whose ``__eq__`` always returns True never reaches a comparison; patching ``assert`` or
the harness changes nothing the parent trusts; printing "all tests passed" is just text; and the
test file is not there to read. Asserts of any other shape are refused with an error, not run.

What it deliberately does not do: languages other than Python, or partial credit within a test.
"""

from __future__ import annotations

import ast
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

from grpokit.errors import ConfigError, DataError
from grpokit.rewards.registry import register
from grpokit.rewards.sandbox import Limits, Sandbox, default_python

MARK = "\x1egrpokit-result "

HARNESS = r"""
import json, os, sys
_write, _repr = os.write, repr
calls = json.loads(open("calls.json").read())
namespace = {"__name__": "solution"}
source = open("solution.py").read()
try:
    exec(compile(source, "solution.py", "exec"), namespace)
except BaseException as e:
    _write(2, ("solution failed to load: %s: %s\n" % (type(e).__name__, e)).encode())
    raise SystemExit(1)
for i, call in enumerate(calls):
    try:
        text = _repr(eval(call, namespace))
    except BaseException as e:
        text = None
    _write(1, (MARK + json.dumps({"i": i, "repr": text}) + "\n").encode())
""".replace("MARK", repr(MARK))


def extract_code(completion: str) -> str | None:
    """The last ```python (or bare ```) fenced block, or None."""
    blocks = re.findall(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", completion, flags=re.S)
    return blocks[-1] if blocks else None


def split_asserts(tests: str | list[str]) -> list[tuple[str, object]]:
    """``assert CALL == LITERAL`` lines -> [(CALL source, expected value)]; anything else raises."""
    source = tests if isinstance(tests, str) else "\n".join(tests)
    cases = []
    for node in ast.parse(source).body:
        ok = (
            isinstance(node, ast.Assert)
            and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)
        )
        if not ok:
            raise DataError(
                f"code_tests: unsupported test {ast.unparse(node)!r}; write `assert CALL == LITERAL`"
            )
        try:
            expected = ast.literal_eval(node.test.comparators[0])
        except ValueError:
            raise DataError(
                f"code_tests: the expected side of {ast.unparse(node)!r} must be a literal"
            ) from None
        cases.append((ast.unparse(node.test.left), expected))
    return cases


def same(value: object, expected: object) -> bool:
    """Equality of two plain literals; floats to 1e-9, tuples and lists alike."""
    if isinstance(value, float) or isinstance(expected, float):
        return (
            isinstance(value, int | float)
            and isinstance(expected, int | float)
            and math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-9)
        )
    if isinstance(value, list | tuple) and isinstance(expected, list | tuple):
        return len(value) == len(expected) and all(same(a, b) for a, b in zip(value, expected, strict=True))
    if isinstance(value, dict) and isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k]) for k in value)
    return type(value) is type(expected) and value == expected


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


class CodeJudge:
    """Scores code against tests in a :class:`Sandbox`."""

    def __init__(self, sandbox: Sandbox, python: str | None = None) -> None:
        self.sandbox, self.python = sandbox, python or default_python()

    def passed_asserts(self, code: str, cases: list[tuple[str, object]]) -> int:
        files = {"solution.py": code, "harness.py": HARNESS, "calls.json": json.dumps([c for c, _ in cases])}
        res = self.sandbox.run(files, [self.python, "-I", "-S", "harness.py"])
        seen: dict[int, str | None] = {}
        duplicated = set()
        for line in res.stdout.split("\n"):  # not splitlines(): it also splits at the \x1e marker
            if not line.startswith(MARK):
                continue
            try:
                record = json.loads(line[len(MARK) :])
                i, text = int(record["i"]), record["repr"]
            except (ValueError, KeyError, TypeError):
                continue
            if i in seen:
                duplicated.add(i)  # two reports for one test: someone else is printing results
            seen[i] = text
        passed = 0
        for i, (_, expected) in enumerate(cases):
            if i in duplicated or seen.get(i) is None:
                continue
            try:
                value = ast.literal_eval(seen[i])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            passed += same(value, expected)
        return passed

    def passed_stdio(self, code: str, cases: list[dict]) -> int:
        passed = 0
        for case in cases:
            res = self.sandbox.run(
                {"solution.py": code}, [self.python, "-I", "-S", "solution.py"], stdin=str(case["input"])
            )
            if not res.timed_out and res.returncode == 0:
                passed += _normalise_output(res.stdout) == _normalise_output(str(case["output"]))
        return passed


@register("code_tests", verifier=True)
def code_tests(
    mode: str = "fraction",
    sandbox: str = "bwrap",
    wall_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 1024,
    num_parallel: int = 4,
):
    """Fraction of the sample's ``tests`` its code passes (``mode="all"``: 1.0 only if all pass).

    Args:
        mode: ``fraction`` | ``all``.
        sandbox: ``bwrap`` (default; refuses with the fix if it cannot run) | ``none`` (unsafe, warns).
        wall_s, cpu_s, memory_mb: limits of one sandboxed run.
        num_parallel: completions judged at once.
    """
    if mode not in ("fraction", "all"):
        raise ConfigError(f"code_tests: mode must be 'fraction' or 'all', got {mode!r}")
    limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_mb << 20)
    judge = CodeJudge(Sandbox(sandbox, limits, slots=max(num_parallel, 1)))

    def one(completion: str, tests) -> float:
        code = extract_code(completion)
        if code is None:
            return 0.0
        if isinstance(tests, str) and tests.strip().startswith("["):
            tests = json.loads(tests)
        if isinstance(tests, list) and tests and isinstance(tests[0], dict):
            total, passed = len(tests), judge.passed_stdio(code, tests)
        else:
            cases = split_asserts(tests)
            total, passed = len(cases), judge.passed_asserts(code, cases)
        if total == 0:
            raise DataError("code_tests: a sample has no tests")
        return passed / total if mode == "fraction" else float(passed == total)

    def reward(prompts, completions, tests, **_):
        with ThreadPoolExecutor(max_workers=max(num_parallel, 1)) as pool:
            return list(pool.map(one, completions, tests))

    reward.__name__ = "code_tests"
    return reward
