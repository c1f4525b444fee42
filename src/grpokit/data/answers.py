r"""Reading the final answer out of a completion's text: the last ``\boxed{...}`` / ``\fbox{...}``
(nested braces), a GSM8K ``#### N`` line, the last ``<answer>...</answer>``, else the last number.

Used by the built-in tasks' verifiers (data/tasks.py) and by ``math_accuracy`` (rewards/math.py,
which also re-exports these names); here, upstream of both, so data/ never imports rewards/.
"""

from __future__ import annotations

import re


def boxed_contents(text: str) -> list[str]:
    r"""Contents of every ``\boxed{...}`` / ``\fbox{...}``, braces balanced, in order."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1].strip())
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    r"""The final answer of ``text`` (see the module docstring for the order), or None."""
    boxed = boxed_contents(text)
    if boxed:
        return boxed[-1]
    gsm = re.findall(r"####\s*([^\n]+)", text)
    if gsm:
        return gsm[-1].strip()
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    if tagged:
        inner = tagged[-1].strip()
        return boxed_contents(inner)[-1] if boxed_contents(inner) else inner
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(".,") if numbers else None


def is_hedged(text: str, answer: str) -> bool:
    """Several candidate answers: "3 or 4", "either 3 or 4", or different boxed answers."""
    if re.search(r"\bor\b|\beither\b|\\lor\b", answer, flags=re.I):
        return True
    return len({b.replace(" ", "") for b in boxed_contents(text)}) > 1
