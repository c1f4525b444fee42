"""The rooms of the layout (DEVELOPERS.md): who may import whom, read from the source (every import,
function-level ones included), so a circle or a reach upstream fails here, not in a user's import."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "grpokit"


def unit(module: str) -> str:
    """grpokit.rewards.math -> rewards; grpokit.config -> config; grpokit -> grpokit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "grpokit"


def imports() -> dict[str, set[tuple[str, str]]]:
    """unit -> {(importing module, imported module)} over every import statement in src/grpokit."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out.setdefault(unit(module), set()).update((module, n) for n in names)
    return out


GRAPH = imports()


def grpokit_units(u: str) -> set[str]:
    return {unit(t) for _, t in GRAPH.get(u, ()) if t.startswith("grpokit")} - {u}


def test_algo_imports_only_torch_and_the_standard_library():
    third_party = {t.split(".")[0] for _, t in GRAPH["algo"]} - set(sys.stdlib_module_names) - {"grpokit"}
    assert third_party == {"torch"}
    assert grpokit_units("algo") == set()


@pytest.mark.parametrize(
    ("room", "allowed"),
    [
        ("errors", set()),
        ("data", {"errors"}),
        ("models", {"errors"}),
        ("rollout", {"errors", "models", "envs"}),
        ("envs", {"errors", "data", "rewards"}),
        ("rewards", {"errors", "data"}),
        ("diagnostics", {"config", "errors"}),
    ],
)
def test_each_room_imports_only_what_is_upstream_of_it(room, allowed):
    assert grpokit_units(room) <= allowed, sorted(
        (m, t) for m, t in GRAPH[room] if t.startswith("grpokit") and unit(t) not in allowed | {room}
    )


def test_no_circles_between_rooms():
    units = set(GRAPH)
    reach = {u: grpokit_units(u) for u in units}
    changed = True
    while changed:  # transitive closure
        changed = False
        for u in units:
            more = set().union(*(reach.get(v, set()) for v in reach[u])) - reach[u]
            if more:
                reach[u] |= more
                changed = True
    assert [u for u in sorted(units) if u in reach[u]] == []


def test_the_torch_floor_has_what_grpokit_imports():
    # train/distributed.py imports fully_shard from torch.distributed.fsdp, public from torch 2.6 on
    # (before: torch.distributed._composable.fsdp); the floor in pyproject must not promise older
    import re
    import tomllib

    pyproject = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())
    (spec,) = [d for d in pyproject["project"]["dependencies"] if re.match(r"torch\b", d)]
    floor = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split(".")[:2])
    assert floor >= (2, 6), spec
    assert any(t == "torch.distributed.fsdp" for _, t in GRAPH["train"])  # the import that sets the floor
