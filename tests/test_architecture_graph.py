"""docs/architecture.md's dependency block (section 2) is the one tools/architecture_graph.py
makes from the code: a stale diagram fails here, with the diff and the command that rewrites it.
"""

from __future__ import annotations

import textwrap

from tools import architecture_graph as graph


def test_the_documented_block_is_the_one_the_code_makes():
    stale = graph.diff()
    assert not stale, ("docs/architecture.md's dependency block is stale; run "
                       "`python tools/architecture_graph.py --write`:\n" + stale)


def test_known_edges():
    units = graph.unit_edges()
    # The leaves: parsers and kernels import nothing of ours, at the top or lazily.
    assert units["parsers"] == {} and units["kernels"] == {}
    # gateway knows the router only by its Backend contract.
    assert set(units["gateway"]["router"]) == {"pd_runtime.router.backend"}
    # A lazy edge: the Ray router replicas import the HTTP entrypoint inside a function.
    replicas = units["workers"]["entrypoints"]["pd_runtime.entrypoints.openai.replicas"]
    assert replicas == {"pd_runtime.workers.router_replicas": {graph.LAZY}}
    lines = graph.render().splitlines()
    assert "kernels ──────> nothing of ours" in lines
    assert any(line.startswith("gateway ──────> router.backend (") for line in lines)


def test_the_walker_sorts_imports_by_where_they_sit(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "sub/leaf.py", "other.py", "typed.py"):
        (package / name).write_text("")
    (package / "sub" / "user.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING
        from .. import other
        from . import leaf
        if TYPE_CHECKING:
            from pkg import typed
        def f():
            import pkg.other
            from pkg.sub.leaf import name
    """))
    edges = graph.import_edges(package)["pkg.sub.user"]
    assert edges == {
        "pkg.other": {"named": {graph.TOP, graph.LAZY}, "implied": set()},
        # `from pkg.sub.leaf import name`: a name, not a module, so it stands for leaf, which
        # that import also implies.
        "pkg.sub.leaf": {"named": {graph.TOP, graph.LAZY}, "implied": {graph.LAZY}},
        "pkg.typed": {"named": {graph.TYPE_ONLY}, "implied": set()},
    }
    # `from pkg import typed` implies pkg itself, but a module's own packages are left out.
    assert "pkg" not in edges and "pkg.sub" not in edges


def test_check_and_write_round_trip(tmp_path, capsys):
    doc = tmp_path / "architecture.md"
    doc.write_text(f"# A\n\n{graph.SECTION}\n\nText.\n\n```\nold ──> stale (1)\n```\n\n"
                   "After.\n")
    assert graph.main(["--check", str(doc)]) == 1
    assert "-old ──> stale (1)" in capsys.readouterr().out
    assert graph.main(["--write", str(doc)]) == 0
    assert graph.main(["--check", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"# A\n\n{graph.SECTION}\n\nText.\n\n```\n")
    assert text.endswith("```\n\nAfter.\n") and graph.render() in text
