"""The dependency directions docs/architecture.md promises, checked on the source:

- the router (the HTTP package) imports from the runtime only the contract (pd_runtime.api and
  the errors it exports, the tokenizer and chat template it shares with the workers, the config
  models), block hashing and beam search's algorithm (torch-free, shared with the offline LLM):
  no engine, model, worker or transfer module, and no torch, at import time or lazily inside a
  function;
- no modules of pd_runtime import each other in a circle, whether at the top of a file or
  inside a function.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUTER = REPO / "pd_runtime" / "router"
PLANNER = REPO / "pd_runtime" / "planner"
ROUTER_MAY_IMPORT = {"pd_runtime", "pd_runtime.api", "pd_runtime.errors", "pd_runtime.tokenizer",
                     "pd_runtime.chat_template", "pd_runtime.config", "pd_runtime.structured",
                     "pd_runtime.config_loading", "pd_runtime.engine.block_hash",
                     "pd_runtime.beam_search"}
FOREIGN = ("torch", "transformers", "ray", "triton")
# The router's own package, the run-record store beside it, and (for the planner) the router.
ROUTER_SIDE = ("pd_runtime.router", "pd_runtime.gateway", "pd_runtime.planner")


def beyond_the_contract(module: str) -> bool:
    """Whether the router (or the planner's simulator) may not import `module`."""
    if module.split(".")[0] in FOREIGN:
        return True
    if module in ROUTER_MAY_IMPORT or module.startswith(tuple(p + "." for p in ROUTER_SIDE)) \
            or module in ROUTER_SIDE:
        return False
    return module.startswith("pd_runtime")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (absolute imports)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_the_router_imports_only_the_contract_and_block_hashing():
    bad = {}
    for path in sorted((ROUTER).glob("*.py")):
        wrong = sorted(m for m in imports(path) if beyond_the_contract(m))
        if wrong:
            bad[path.name] = wrong
    assert not bad, f"router modules importing beyond the contract: {bad}"


def test_importing_the_router_loads_no_engine_and_no_torch():
    modules = [f"pd_runtime.router.{p.stem}" for p in sorted((ROUTER).glob("*.py"))
               if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print('\\n'.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    assert "pd_runtime.router.core" in loaded and "pd_runtime.engine.block_hash" in loaded
    wrong = [m for m in loaded if m.split(".")[0] in ("torch", "transformers")
             or (beyond_the_contract(m)
                 and m not in ("pd_runtime.engine", "pd_runtime.config_base",
                               "pd_runtime.config_router"))]
    assert not wrong, f"importing the router loaded {wrong}"


def package_modules(package: Path) -> dict[str, Path]:
    """Every module under `package` by its dotted name (an __init__.py by its package's)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, at the top or inside functions. `import a.b`
    names a.b; `from a import b` names a and a.b (b may be a module); a relative import counts
    from the module's package; a name that is no module stands for the nearest module above it.
    A module's own packages are left out: importing it has imported them already."""
    modules = package_modules(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package_name = module if path.name == "__init__.py" else \
                        module.rpartition(".")[0]
                    parts = package_name.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
    return graph


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
    router, nothing of the engine, the workers, the transfers or torch; only `profile.py`
    (which drives real pools), `profile_tp.py` (which reads the model's config and times the
    runtime's own all-reduce) and the command line reach the runtime."""
    sim = imports(PLANNER / "simulator.py")
    assert {"pd_runtime.router.policy", "pd_runtime.router.ledger", "pd_runtime.router.cost_model"} <= sim
    bad = {}
    for path in sorted((PLANNER).glob("*.py")):
        if path.stem in ("profile", "profile_tp", "cli"):
            continue
        wrong = sorted(m for m in imports(path) if beyond_the_contract(m))
        if wrong:
            bad[path.name] = wrong
    assert not bad, f"planner modules importing the runtime: {bad}"
    code = "import sys, pd_runtime.planner.plan\nprint('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    assert "pd_runtime.router.policy" in loaded and "torch" not in loaded and "ray" not in loaded
