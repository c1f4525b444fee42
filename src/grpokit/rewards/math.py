r"""``math_accuracy``: extract the final answer of a completion and check it against the reference.

What it does:
- extraction, in order: the last ``\boxed{...}`` / ``\fbox{...}`` (nested braces), a GSM8K
  ``#### N`` line, the last ``<answer>...</answer>``, else the last number in the text;
- refusal of hedges: an answer with "or" / "either" in it, or several different boxed answers,
  scores 0 (a policy that lists candidates must not collect the reward);
- equivalence: both sides are first parsed exactly (integers, decimals, fractions, ``\frac``,
  thousands separators, ``\$``, ``%``, ``\text{units}``) and compared as Fractions. What that
  cannot parse goes to math-verify (the ``math`` extra) in worker processes with a hard
  per-answer timeout, with two guards for weak spots measured on math-verify 0.9: an "equal"
  verdict between two exact expressions is re-checked exactly with sympy (math-verify's numeric
  tolerance calls 1/2004! and 1/2006! equal), and an inequality is compared as the set it
  describes (``x<3`` equals ``(-\infty, 3)``). Without math-verify, what the exact parser cannot
  read is compared as whitespace-normalised text.

What it deliberately does not do: partial credit, or judge the reasoning -- only the final answer.
"""

from __future__ import annotations

import importlib.util
import re
from fractions import Fraction

from grpokit.data.answers import boxed_contents, extract_answer, is_hedged
from grpokit.errors import ConfigError
from grpokit.rewards.registry import register
from grpokit.rewards.workers import shared_pool

__all__ = ["boxed_contents", "extract_answer", "is_hedged", "math_accuracy"]

# ----------------------------------------------------------------------------------------------
# Exact numbers
# ----------------------------------------------------------------------------------------------

_STRIP = [
    r"\$",
    "$",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\ ",
    r"\left",
    r"\right",
    r"^\circ",
    r"^{\circ}",
    r"\%",
    "%",
]


def parse_number(s: str) -> Fraction | None:
    r"""An exact number from ``s``, or None: ``-12``, ``1,234``, ``0.50``, ``3/4``, ``\frac{3}{4}``,
    ``\dfrac34``, ``-\frac{1}{2}``, ``\$18``, ``50\%``, ``5 \text{ cm}``, ``18 dollars``."""
    s = s.strip()
    s = re.sub(r"\\(?:text|mbox|mathrm)\{[^{}]*\}", "", s)
    for token in _STRIP:
        s = s.replace(token, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac").replace(" ", "").rstrip(".")
    s = re.sub(r"(?<=\d)[a-zA-Z]+$", "", s) if re.fullmatch(r"-?[\d.,]+[a-zA-Z]{2,}", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * Fraction(num, den)
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        return None if int(m.group(2)) == 0 else Fraction(int(m.group(1)), int(m.group(2)))
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?(?:\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def _normalise_text(s: str) -> str:
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    for token in ("$", r"\left", r"\right", r"\!", r"\,", " "):
        s = s.replace(token, "")
    return s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac").rstrip(".")


# ----------------------------------------------------------------------------------------------
# Equivalence (runs in worker processes)
# ----------------------------------------------------------------------------------------------


def has_math_verify() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def symbolic_equal(pair: tuple[str, str]) -> bool:
    """math-verify's verdict on ``(prediction, gold)`` with the exactness and set guards. Worker-side."""
    import sympy
    from math_verify import parse, verify

    pred, gold = pair
    wrap = lambda s: s if "$" in s else f"${s}$"  # noqa: E731  (latex extraction wants math mode)
    g, p = parse(wrap(gold)), parse(wrap(pred))
    if not g or not p:
        return False
    g0, p0 = g[0], p[0]
    if isinstance(g0, sympy.Basic) and isinstance(p0, sympy.Basic):
        g0, p0 = _as_set(g0), _as_set(p0)
        if isinstance(g0, sympy.Set) and isinstance(p0, sympy.Set):
            return bool(g0 == p0)
    if not verify(g, p):
        return False
    if isinstance(g0, sympy.Expr) and isinstance(p0, sympy.Expr) and _exact(g0) and _exact(p0):
        # math-verify compares numbers with a tolerance; between exact expressions insist on equality
        return bool(sympy.simplify(g0 - p0) == 0)
    return True


def _as_set(e):
    import sympy

    if isinstance(e, sympy.core.relational.Relational) and len(e.free_symbols) == 1:
        try:
            return e.as_set()
        except (NotImplementedError, TypeError, ValueError):
            return e
    return e


def _exact(e) -> bool:
    import sympy

    return not e.free_symbols and not e.atoms(sympy.Float)


# ----------------------------------------------------------------------------------------------
# The reward
# ----------------------------------------------------------------------------------------------


def gold_answer(answer: str) -> str:
    """The reference as given, or its final answer when it is a worked solution (``####`` / boxed)."""
    answer = str(answer)
    if "####" in answer or boxed_contents(answer):
        return extract_answer(answer) or answer
    return answer.strip()


@register("math_accuracy", verifier=True)
def math_accuracy(timeout_s: float = 5.0, num_workers: int = 2, use_math_verify: bool | None = None):
    """1.0 if the completion's final answer equals the ``answer`` column, else 0.0.

    Args:
        timeout_s: wall-clock limit per symbolic check (a timed-out check scores 0 and is counted
            in ``reward.last_failures``).
        num_workers: worker processes for math-verify (started on first need).
        use_math_verify: None: when installed; False: exact numbers and normalised text only.
    """
    symbolic = has_math_verify() if use_math_verify is None else use_math_verify
    if symbolic and not has_math_verify():
        raise ConfigError(
            "math_accuracy: use_math_verify=true needs math-verify: pip install 'grpokit[math]'"
        )

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
        scores: list[float | None] = []
        pending: list[tuple[int, tuple[str, str]]] = []
        for i, (completion, gold_raw) in enumerate(zip(completions, answer, strict=True)):
            pred, gold = extract_answer(completion), gold_answer(gold_raw)
            if pred is None or is_hedged(completion, pred):
                scores.append(0.0)
                continue
            exact_pred, exact_gold = parse_number(pred), parse_number(gold)
            if exact_pred is not None and exact_gold is not None:
                scores.append(float(exact_pred == exact_gold))
            elif not symbolic:
                scores.append(float(_normalise_text(pred) == _normalise_text(gold)))
            else:
                scores.append(None)
                pending.append((i, (pred, gold)))
        reward.last_failures = 0
        if pending:
            results = shared_pool(num_workers, timeout_s).map(symbolic_equal, [p for _, p in pending])
            for (i, _pair), result in zip(pending, results, strict=True):
                scores[i] = float(result.value) if result.ok else 0.0
                reward.last_failures += 0 if result.ok else 1
        return scores  # type: ignore[return-value]

    reward.__name__ = "math_accuracy"
    reward.last_failures = 0
    return reward
