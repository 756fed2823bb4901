"""The dependency directions docs/architecture.md promises, checked on the source:

- each package in its table "Who may import what" imports, of pd_runtime, only itself and what
  its row names (a row's package or module, and anything inside it), at the top of a file or
  lazily inside a function, and none of them imports torch, transformers, Ray or Triton;
- importing every module of the serving packages (entrypoints, router, parsers, gateway) in a
  fresh interpreter loads no torch and no engine, model, kernel, worker or transfer module (block
  hashing aside: torch-free, shared by the router's prefix index and the engine);
- no modules of pd_runtime import each other in a circle, whether at the top of a file or
  inside a function.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

# The import walker is shared with the generator of docs/architecture.md's dependency block.
from tools.architecture_graph import import_graph, package_modules

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "pd_runtime"
ARCHITECTURE = REPO / "docs" / "architecture.md"
TABLE_HEADING = "### Who may import what"
FOREIGN = ("torch", "transformers", "ray", "triton")
SERVING = ("pd_runtime.entrypoints", "pd_runtime.router", "pd_runtime.parsers",
           "pd_runtime.gateway")
# What the serving packages may not load, even through what they import (of the engine, only
# block hashing and, with it, the __init__ of the packages above it: docstrings only).
BELOW = ("pd_runtime.engine", "pd_runtime.model", "pd_runtime.kernels", "pd_runtime.workers",
         "pd_runtime.kv_transfer")
BELOW_BUT = ("pd_runtime.engine", "pd_runtime.engine.kv_cache",
             "pd_runtime.engine.kv_cache.block_hash")


def import_table() -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's table: package -> (what it may import, its modules exempt)."""
    text = ARCHITECTURE.read_text()
    assert TABLE_HEADING in text, f"docs/architecture.md lost its table ({TABLE_HEADING!r})"
    table = {}
    for line in text.split(TABLE_HEADING, 1)[1].splitlines():
        if table and not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`pd_runtime"):
            continue
        package = cells[0].strip("`")
        allowed = set(re.findall(r"`(pd_runtime[\w.]*)`", cells[1]))
        exempt = set(re.findall(r"`(\w+)\.py`", cells[2])) if len(cells) > 2 else set()
        table[package] = (allowed, exempt)
    return table


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (absolute imports)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_table_names_every_serving_package_and_only_real_modules():
    table = import_table()
    modules = package_modules(PACKAGE)
    assert set(SERVING) | {"pd_runtime.planner"} <= set(table), sorted(table)
    for package, (allowed, exempt) in table.items():
        assert package in modules, f"the table names {package}, which is no package"
        for name in allowed:
            assert name in modules, f"{package}'s row names {name}, which is no module"
        for stem in exempt:
            assert f"{package}.{stem}" in modules, f"{package}'s row exempts {stem}.py, not there"


def test_each_package_imports_only_what_the_table_allows():
    table = import_table()
    modules = package_modules(PACKAGE)
    graph = import_graph(PACKAGE)
    bad = {}
    for package, (allowed, exempt) in table.items():
        for module in sorted(m for m in graph if inside(m, package)):
            if module.rpartition(".")[2] in exempt:
                continue
            # A package's __init__ comes with any module inside it: allowed too.
            wrong = sorted(dep for dep in graph[module] if not inside(dep, package) and not any(
                inside(dep, ok) or inside(ok, dep) for ok in allowed))
            wrong += sorted(m for m in imports(modules[module]) if m.split(".")[0] in FOREIGN)
            if wrong:
                bad[module] = wrong
    assert not bad, f"imports beyond docs/architecture.md's table: {bad}"


def test_importing_the_serving_packages_loads_no_torch_and_nothing_below_the_router():
    modules = [m for m in package_modules(PACKAGE)
               if any(inside(m, package) for package in SERVING)]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print('\\n'.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    assert "pd_runtime.router.core" in loaded and "pd_runtime.engine.kv_cache.block_hash" in loaded
    wrong = [m for m in loaded if m.split(".")[0] in FOREIGN
             or (any(inside(m, below) for below in BELOW) and m not in BELOW_BUT)]
    assert not wrong, f"importing the serving packages loaded {wrong}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another (through any others), as one circle through
    its first module."""
    reach = {module: reachable(graph, module) for module in graph}
    circles, placed = [], set()
    for module in sorted(graph):
        if module in reach[module] and module not in placed:
            placed |= {other for other in reach[module] if module in reach[other]}
            circles.append(circle_through(graph, module))
    return circles


def circle_through(graph: dict[str, set[str]], module: str) -> list[str]:
    """A shortest way from `module` through its imports back to itself (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [module]
    while frontier:
        later = []
        for at in frontier:
            for nxt in sorted(graph[at]):
                if nxt == module:
                    path = [at]
                    while path[0] != module:
                        path.insert(0, came_from[path[0]])
                    return path + [module]
                if nxt not in came_from:
                    came_from[nxt] = at
                    later.append(nxt)
        frontier = later
    raise ValueError(f"{module} does not import itself")


def test_the_package_imports_without_a_cycle():
    graph = import_graph(REPO / "pd_runtime")
    assert "pd_runtime.api" in graph["pd_runtime.router.core"], \
        "the graph misses a known import: the check would pass on anything"
    circles = import_cycles(graph)
    assert not circles, "import cycles (a shared base module both import breaks one):\n" + \
        "\n".join(" -> ".join(circle) for circle in circles)


def test_the_simulator_runs_the_routers_policy_without_the_runtime():
    """The planner's simulator imports the router's policy code (not a copy of it) and, like the
    router, nothing of the engine, the workers, the transfers or torch (the table's planner row);
    planning loads none of them."""
    sim = imports(PACKAGE / "planner" / "simulator.py")
    assert {"pd_runtime.router.policy", "pd_runtime.router.ledger",
            "pd_runtime.router.cost_model"} <= sim
    code = "import sys, pd_runtime.planner.plan\nprint('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    assert "pd_runtime.router.policy" in loaded and "torch" not in loaded and "ray" not in loaded
