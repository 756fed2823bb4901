"""The docs point at things that exist.

- Every relative link in README.md and docs/*.md resolves: the file (or folder) is there, and a
  `#anchor` into a markdown file names one of its headings by GitHub's slug.
- Every repository path docs/architecture.md names in backticks (`pd_runtime/router/policy.py`,
  `workers/pool.py: build_pools`, `bench/goodput.py`, `tests/...`) exists; a path that starts
  at a pd_runtime subpackage (`workers/`, `engine/`, ...) is read from pd_runtime/.
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title") or ")".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path):
    """(line number, target) for every link in a markdown file, code left out."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _REF_DEF.match(line)
        if m:
            yield number, m.group(1)
            continue
        prose = _CODE_SPAN.sub("", line)
        for m in _LINK.finditer(prose):
            yield number, m.group(1)


def broken_links(path: Path) -> list[str]:
    bad = []
    for number, target in links(path):
        if _EXTERNAL.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        where = f"{name}:{number}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            bad.append(f"{where} (no heading with that anchor)")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    bad = broken_links(doc)
    assert not bad, "broken links:\n" + "\n".join(bad)


def _repo_roots() -> set[str]:
    """First segments a backticked repository path may start with: the repository's own
    top-level folders, and pd_runtime's subpackages (the docs name `workers/pool.py` for
    `pd_runtime/workers/pool.py`)."""
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    top -= {"__pycache__", "build", "dist"} | {p for p in top if p.endswith(".egg-info")}
    sub = {p.name for p in (ROOT / "pd_runtime").iterdir() if p.is_dir() and p.name != "__pycache__"}
    return top | sub


def repo_paths(text: str, roots: set[str]):
    """(line number, path) for each backticked span that looks like a repository path."""
    for number, line in _prose_lines(text):
        for m in _CODE_SPAN.finditer(line):
            span = m.group(2).strip()
            path = span.split(":", 1)[0].strip()  # `file.py: Class.method`
            if " " in path or "/" not in path or path.startswith(("/", "~", ".")):
                continue
            if path.split("/", 1)[0] not in roots:
                continue
            yield number, path


def path_exists(path: str) -> bool:
    path = path.rstrip("/")
    if path.endswith("..."):  # `tests/...`: the folder it names
        path = path[:-3].rstrip("/")
    for base in (ROOT, ROOT / "pd_runtime"):
        if any(ch in path for ch in "*?["):
            if list(base.glob(path)):
                return True
        elif (base / path).exists():
            return True
    return False


def test_architecture_paths_exist():
    doc = ROOT / "docs" / "architecture.md"
    roots = _repo_roots()
    found = list(repo_paths(doc.read_text(encoding="utf-8"), roots))
    assert found, "no repository paths found in docs/architecture.md: the pattern broke"
    bad = [f"docs/architecture.md:{n}: `{p}`" for n, p in found if not path_exists(p)]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


def test_checks_can_fail(tmp_path):
    """The checkers see a broken link, a bad anchor and a missing path."""
    (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Twice\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md#a-heading-with-code) [ok](there.md#twice-1) [ok](#local)\n"
        "# Local\n"
        "[gone](missing.md) [bad anchor](there.md#nope) `[not a link](x.md)`\n"
        "```\n[in code](also-missing.md)\n```\n"
    )
    bad = broken_links(doc)
    assert len(bad) == 2 and "missing.md" in bad[0] and "#nope" in bad[1], bad
    assert not path_exists("pd_runtime/no_such_module.py")
    assert path_exists("workers/pool.py") and path_exists("tests/...")
    assert path_exists("cluster_configs/*.yaml")
