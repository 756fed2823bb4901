"""The dependency block of docs/architecture.md (section 2), made from the code.

Walks every module of pd_runtime with `ast` (imports at the top of a file, inside functions and
under `if TYPE_CHECKING`, relative ones resolved), groups the modules into units (a sub-package
such as `router` or `engine`; a top-level module such as `config`, `api` or `cli` by its name),
and writes one line per unit: the units it imports, by how many module-to-module edges, most
first.

    python tools/architecture_graph.py                               # print the block
    python tools/architecture_graph.py --check docs/architecture.md  # exit 1, with a diff, if stale
    python tools/architecture_graph.py --write [docs/architecture.md]  # rewrite the block in place

tests/test_module_boundaries.py checks the same graph (`import_graph`) against the doc's table.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "pd_runtime"
ARCHITECTURE = REPO / "docs" / "architecture.md"
SECTION = "## 2. Dependency directions"
FENCE = "```"
# Where an import sits: run with its file, inside a function (lazy), or only for type checkers.
TOP, LAZY, TYPE_ONLY = "top", "lazy", "type-only"
# The rows in the order the layers go (docs/architecture.md: cli -> entrypoints -> router ->
# workers -> engine -> model -> kernels); any other sub-package follows them, then the
# top-level modules by name.
ORDER = ("cli", "entrypoints", "router", "parsers", "gateway", "planner", "workers", "engine",
         "model", "kernels", "kv_transfer")


def package_modules(package: Path) -> dict[str, Path]:
    """Every module under `package` by its dotted name (an __init__.py by its package's)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, place: str = TOP):
    """(import statement, where it sits) for every import in `tree`; type-only wins over lazy
    (an import under `if TYPE_CHECKING` never runs, wherever it is)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, place
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _import_nodes(node, place if place == TYPE_ONLY else LAZY)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]), TYPE_ONLY)
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]), place)
        else:
            yield from _import_nodes(node, place)


def import_edges(package: Path) -> dict[str, dict[str, dict[str, set[str]]]]:
    """Module -> the modules of `package` it imports -> {"named": places, "implied": places}.

    `import a.b` names a.b; `from a import b` names a.b where b is a module, else a, and implies
    a (importing a.b runs a's __init__ first). A relative import counts from the module's
    package; a name that is no module stands for the nearest module above it. A module's own
    packages are left out: importing it has imported them already. The places say where the
    imports behind an edge sit: TOP, LAZY (inside a function) or TYPE_ONLY."""
    modules = package_modules(package)

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, dict[str, dict[str, set[str]]]] = {}
    for module, path in modules.items():
        out: dict[str, dict[str, set[str]]] = defaultdict(
            lambda: {"named": set(), "implied": set()})
        for node, place in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named, implied = [alias.name for alias in node.names], []
            else:
                base = node.module or ""
                if node.level:
                    package_name = module if path.name == "__init__.py" else \
                        module.rpartition(".")[0]
                    parts = package_name.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                named, implied = [f"{base}.{alias.name}" for alias in node.names], [base]
            for kind, names in (("named", named), ("implied", implied)):
                for name in map(resolve, names):
                    if name and name != module and not module.startswith(name + "."):
                        out[name][kind].add(place)
        edges[module] = dict(out)
    return edges


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, at the top, inside functions or for type
    checkers, named or implied (see `import_edges`)."""
    return {module: set(deps) for module, deps in import_edges(package).items()}


def unit_of(module: str) -> str:
    """The unit a module belongs to: its sub-package of pd_runtime, or its own name for a
    top-level module (`pd_runtime` itself for the package's __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_edges(package: Path = PACKAGE) -> dict[str, dict[str, dict[str, dict[str, set[str]]]]]:
    """Unit -> unit it imports -> module it imports there -> module of the unit importing it ->
    the places of the imports behind that module-to-module edge (named imports only: `from pkg
    import sub` is an edge to pkg.sub, not also to pkg)."""
    units: dict[str, dict[str, dict[str, dict[str, set[str]]]]] = {}
    for module, deps in import_edges(package).items():
        source = unit_of(module)
        row = units.setdefault(source, {})
        for dep, places in deps.items():
            target = unit_of(dep)
            if target != source and places["named"]:
                row.setdefault(target, {}).setdefault(dep, {})[module] = places["named"]
    return units


def _label(target: str, deps: dict[str, dict[str, set[str]]]) -> tuple[int, str]:
    """(edges, `unit (n)`): the unit, or the one module below its top that every edge goes to;
    `, lazy` / `, type-only` where every import behind the edges sits there."""
    only = next(iter(deps)) if len(deps) == 1 else ""
    name = only.split(".", 1)[1] if only.count(".") > 1 else target
    count = sum(map(len, deps.values()))
    places = set().union(*(places for sources in deps.values() for places in sources.values()))
    note = f", {next(iter(places))}" if len(places) == 1 and TOP not in places else ""
    return count, f"{name} ({count}{note})"


def render(package: Path = PACKAGE) -> str:
    """The block: a line per unit, its targets by edge count, most first (ties by name); the
    layers first (ORDER, then any other sub-package), then the other top-level modules."""
    units = unit_edges(package)
    rank = {name: i for i, name in enumerate(ORDER)}
    key = lambda unit: (rank.get(unit, len(rank)), unit)  # noqa: E731
    layers = sorted((u for u in units if u in rank or (package / u).is_dir()), key=key)
    rest = sorted((u for u in units if u not in layers and u != package.name), key=key)
    lines: list[str] = []
    for group in (layers, rest + [package.name] * (package.name in units)):
        if not group:
            continue
        width = max(map(len, group)) + 2
        lines += [""] * bool(lines)
        for unit in group:
            labels = sorted(_label(target, deps) for target, deps in units[unit].items())
            labels.sort(key=lambda label: -label[0])  # stable: by name within a count
            body = " · ".join(text for _, text in labels) or "nothing of ours"
            lines.append(f"{unit} {'─' * (width - len(unit))}> {body}")
    return "\n".join(lines) + "\n"


def _block_span(text: str) -> tuple[int, int]:
    """Character offsets of the fenced block's contents under SECTION."""
    at = text.index(SECTION)
    start = text.index(FENCE + "\n", at) + len(FENCE) + 1
    end = text.index("\n" + FENCE, start) + 1
    return start, end


def documented(doc: Path = ARCHITECTURE) -> str:
    text = doc.read_text()
    start, end = _block_span(text)
    return text[start:end]


def diff(doc: Path = ARCHITECTURE, package: Path = PACKAGE) -> str:
    """A unified diff from the doc's block to the code's, empty when they agree."""
    return "".join(difflib.unified_diff(
        documented(doc).splitlines(keepends=True), render(package).splitlines(keepends=True),
        f"{doc.name} (section 2)", "from the code"))


def write(doc: Path = ARCHITECTURE, package: Path = PACKAGE) -> bool:
    """Rewrite the doc's block from the code; whether anything changed."""
    text = doc.read_text()
    start, end = _block_span(text)
    new = text[:start] + render(package) + text[end:]
    if new != text:
        doc.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", metavar="DOC", type=Path,
                      help="exit 1 with a diff when DOC's block differs from the code")
    mode.add_argument("--write", metavar="DOC", type=Path, nargs="?", const=ARCHITECTURE,
                      help=f"rewrite DOC's block from the code (default {ARCHITECTURE.name})")
    args = parser.parse_args(argv)
    if args.check:
        stale = diff(args.check)
        if stale:
            sys.stdout.write(stale)
            print(f"{args.check}: stale; run python tools/architecture_graph.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if args.write:
        changed = write(args.write)
        print(f"{args.write.name}: {'rewritten' if changed else 'already up to date'}")
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
