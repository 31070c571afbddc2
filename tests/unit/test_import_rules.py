"""Imports point one way: each core module imports only its own layer and the layers before it, by the table in
docs/code.md (read from there, so the rule and its documentation cannot drift apart), and no import circle exists.
Imports inside functions and under TYPE_CHECKING count too: a lazy import is still a dependency."""

import ast
import re
from pathlib import Path

import pytest

import grpoflow

CORE = Path(grpoflow.__file__).parent
DOC = CORE.parent / "docs" / "code.md"
EMBEDDED = "grpoflow.embedded"
# what the stand-ins may import beyond the base: the engine's protocol and the sandbox contract
EMBEDDED_MAY = ("grpoflow.engine", "grpoflow.rollout.environments")


def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """(layer, module prefixes) per row of the `| layer | modules |` table, in order."""
    rows = re.findall(r"^\| (\w+) \| (grpoflow[^|]*) \|$", text, re.M)
    return [(name, [m.strip() for m in mods.split(",")]) for name, mods in rows]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(CORE.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m == "grpoflow" or m.startswith("grpoflow.")]


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def place(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """The row of the most specific prefix naming `module` (None: the stand-ins)."""
    best = None
    for i, (_, prefixes) in enumerate(table):
        for p in prefixes:
            if within(module, p) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def forbidden_edges(graph: dict[str, list[str]], table: list[tuple[str, list[str]]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        for target in targets:
            if within(module, EMBEDDED):
                ok = (
                    within(target, EMBEDDED)
                    or place(target, table) == 0
                    or any(within(target, p) for p in EMBEDDED_MAY)
                )
            elif within(target, EMBEDDED):
                ok = False
            else:
                ok = place(target, table) <= place(module, table)
            if not ok:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, list[str]]:
    return {module_name(p): sorted(set(imports(p))) for p in CORE.rglob("*.py")}


def test_the_table_places_every_core_module(graph):
    table = layer_table(DOC.read_text(encoding="utf-8"))
    assert [name for name, _ in table] == ["base", "engine", "prepare", "rollout", "scoring", "train", "run"]
    unplaced = [m for m in graph if place(m, table) is None and not within(m, EMBEDDED)]
    assert unplaced == []


def test_no_core_module_imports_a_later_layer_or_the_stand_ins(graph):
    assert forbidden_edges(graph, layer_table(DOC.read_text(encoding="utf-8"))) == []


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_the_rule_catches_an_upward_edge_and_a_circle():
    table = layer_table(DOC.read_text(encoding="utf-8"))
    upward = {"grpoflow.prepare.model": ["grpoflow.rollout.trials"], "grpoflow.rollout.trials": []}
    assert forbidden_edges(upward, table) == ["grpoflow.prepare.model -> grpoflow.rollout.trials"]
    assert forbidden_edges({"grpoflow.run.loop": ["grpoflow.embedded.engine.server"]}, table)
    assert forbidden_edges({"grpoflow.embedded.sandbox.local": ["grpoflow.rollout.environments"]}, table) == []
    assert circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


FLOWS = CORE.parent / "flows"
# The one flow that runs another: a rerun is the train flow again, on the recorded config, as its subflow.
SUBFLOWS = {("flows.rerun", "flows.train")}


def flow_modules() -> set[str]:
    """The modules of flows/ that define a Prefect flow (the others, common and report, are their helpers)."""
    return {f"flows.{p.stem}" for p in FLOWS.glob("*.py") if "@flow(" in p.read_text(encoding="utf-8")}


def test_a_flow_calls_tasks_and_the_core_not_another_flow():
    flows = flow_modules()
    assert {"flows.train", "flows.resume", "flows.evaluate"} <= flows
    edges = set()
    for p in FLOWS.glob("*.py"):
        if f"flows.{p.stem}" not in flows:
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in flows:
                edges.add((f"flows.{p.stem}", node.module))
    assert edges == SUBFLOWS
    assert [p.name for p in FLOWS.glob("*.py") if "@task(" in p.read_text(encoding="utf-8")] == []  # tasks/ has them
