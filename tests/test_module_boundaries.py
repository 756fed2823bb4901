"""The dependency directions docs/architecture.md promises, checked on the source:

- the router (the HTTP package) imports from the runtime only the contract (pd_runtime.api,
  the tokenizer and chat template it shares with the workers, the config models), block
  hashing and beam search's algorithm (torch-free, shared with the offline LLM): no engine, model, worker or transfer module, and no torch, at import time or lazily
  inside a function;
- kv_transfer's modules import each other without a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUTER = REPO / "pd_runtime" / "router"
PLANNER = REPO / "pd_runtime" / "planner"
ROUTER_MAY_IMPORT = {"pd_runtime", "pd_runtime.api", "pd_runtime.tokenizer",
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


def test_kv_transfer_modules_import_no_cycle():
    package = REPO / "pd_runtime" / "kv_transfer"
    names = {p.stem for p in package.glob("*.py")}
    graph = {stem: {m.split(".")[2] for m in imports(package / f"{stem}.py")
                    if m.startswith("pd_runtime.kv_transfer.")
                    and m.split(".")[2] in names} - {stem}
             for stem in names}
    assert graph["agent"], "the graph is empty: the check would pass on anything"
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


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
