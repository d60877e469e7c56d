"""The docs name only what exists: linked files, anchors, repository paths, kbit_core modules and the module map.

A doc (README.md, docs/*.md) fails when it links a file or a heading that does not exist, names a repository path
(`kbit_core/bench/stats.py`, `tests/unit/`, `deployments/train-smoke.yaml`, `bench/report.py` inside kbit_core) or
a dotted `kbit_core.x.y` name that the code no longer has, or lists a module in architecture.md's module map that
is not there. Markdown is parsed with markdown-it (the CommonMark parser rich already uses), so link syntax inside
code is not taken for a link; paths are matched in text, inline code and code blocks alike.
"""

import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Top-level folders whose paths a doc may name; a path under any other word is prose (`train/val/test`, `<workdir>/`).
REPO_FOLDERS = ("kbit_core", "tests", "scripts", "deployments", "tasks", "flows", "requirements", "docs", ".ci")
_PATH = re.compile(
    r"(?<![\w./<>:-])"  # not the tail of a longer path, a URL or a <placeholder>/
    rf"((?:{'|'.join(map(re.escape, REPO_FOLDERS))})/[\w./-]*[\w/]"  # a path under a repository folder ...
    r"|[a-z_]\w*(?:/\w+)*/\w+\.py)"  # ... or a .py path relative to the root or kbit_core (`bench/report.py`)
    r"(?![\w/-])"
)
_DOTTED = re.compile(r"(?<![\w.])kbit_core(?:\.\w+)+")
_TEST_FILE = re.compile(r"(?<![\w./-])test_\w+\.py\b")  # a test file named without its folder
_TEST_ID = re.compile(r"(?<![\w./-])(tests/[\w./-]+\.py)((?:::\w+)+)")  # a pytest node id: file::Class::test
_MAP_HEADING = "Modules, one sentence each"
_MAP_NAME = re.compile(r"[\w*]+(?:\.py|/)")


class Problem(NamedTuple):
    """One name a doc gets wrong, where."""

    doc: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.what}"


def heading_slugs(tokens) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation dropped, spaces as hyphens, -N repeats."""
    slugs: set[str] = set()
    for opening, inline in zip(tokens, tokens[1:], strict=False):
        if opening.type != "heading_open":
            continue
        text = "".join(child.content for child in inline.children if child.type in ("text", "code_inline"))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        unique, repeat = slug, 0
        while unique in slugs:
            repeat += 1
            unique = f"{slug}-{repeat}"
        slugs.add(unique)
    return slugs


def _top_level_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def dotted_name_exists(root: Path, dotted: str) -> bool:
    """`kbit_core.a.b.c`: the longest prefix that is a module, then (if more follows) a name defined at its top."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return cut == len(parts) or parts[cut] in _top_level_names(module)
    return False


def path_exists(root: Path, path: str) -> bool:
    """A file or folder under the root or kbit_core; `tasks/config.load_run_config` is a name in tasks/config.py."""
    if (root / path).exists() or (root / "kbit_core" / path).exists():
        return True
    module, dot, name = path.partition(".")
    file = root / f"{module}.py"
    return bool(dot) and file.is_file() and name.split(".")[0] in _top_level_names(file)


def _module_map_names(fence: str) -> list[tuple[int, str]]:
    """(line offset, kbit_core-relative path) of every module the map's tree lists; folders nest by indentation."""
    names: list[tuple[int, str]] = []
    folders: list[tuple[int, str]] = []
    for offset, line in enumerate(fence.splitlines()):
        indent = len(line) - len(line.lstrip())
        entries = [e.strip() for e in re.split(r"\s{2,}", line.strip())[0].split(",")]
        if not line.strip() or not all(_MAP_NAME.fullmatch(entry) for entry in entries):
            continue  # a group label, or a description carried onto its own line
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = "".join(folder for _, folder in folders)
        names.extend((offset, parent + entry) for entry in entries)
        if len(entries) == 1 and entries[0].endswith("/"):
            folders.append((indent, entries[0]))
    return names


def _module_exists(root: Path, path: str) -> bool:
    return any(root.joinpath("kbit_core").glob(path.rstrip("/"))) if "*" in path else path_exists(root, path)


def _check_link(root: Path, doc: Path, href: str, slugs: dict[Path, set[str]], md) -> str | None:
    if re.match(r"[a-z][a-z+.-]*:", href):
        return None  # http:, https:, mailto:
    target, _, anchor = href.partition("#")
    file = (doc.parent / target).resolve() if target else doc
    if target.startswith("/") or not file.is_relative_to(root):
        return f"link {href!r} leaves the repository"
    if not file.exists():
        return f"link {href!r}: no file {file.relative_to(root)}"
    if anchor and file.suffix == ".md":
        if file not in slugs:
            slugs[file] = heading_slugs(md.parse(file.read_text()))
        if anchor not in slugs[file]:
            return f"link {href!r}: no heading #{anchor} in {file.relative_to(root)}"
    return None


def node_id_exists(root: Path, path: str, names: str) -> bool:
    """Whether every ``::``-separated name of a pytest node id is a class or function defined in ``path``."""
    source = (root / path).read_text()
    return all(re.search(rf"^\s*(?:async def|def|class) {name}\b", source, re.M) for name in names.split("::")[1:])


def _names_in(root: Path, text: str) -> list[str]:
    missing = [f"names {p!r}, which does not exist" for p in _PATH.findall(text) if not path_exists(root, p)]
    missing += [
        f"names {name!r}, which no folder of tests/ holds"
        for name in _TEST_FILE.findall(text)
        if not any((root / "tests").rglob(name))
    ]
    missing += [
        f"names {path + names!r}, which is not a test there"
        for path, names in _TEST_ID.findall(text)
        if (root / path).is_file() and not node_id_exists(root, path, names)
    ]
    return missing + [
        f"names {d!r}, which kbit_core does not have" for d in _DOTTED.findall(text) if not dotted_name_exists(root, d)
    ]


def check_doc(root: Path, doc: Path, slugs: dict[Path, set[str]] | None = None) -> list[Problem]:
    """Every broken link, anchor, path, dotted kbit_core name and module-map entry in one markdown file."""
    md = MarkdownIt("commonmark")
    slugs = {} if slugs is None else slugs
    tokens = md.parse(doc.read_text())
    name = str(doc.relative_to(root))
    problems: list[Problem] = []
    in_map = False
    for previous, token in zip([None, *tokens], tokens, strict=False):
        line = token.map[0] + 1 if token.map else 0
        if previous is not None and previous.type == "heading_open":
            in_map = token.content.strip() == _MAP_HEADING
        if token.type in ("fence", "code_block"):
            problems += [Problem(name, line, what) for what in _names_in(root, token.content)]
            if in_map:
                problems += [
                    Problem(name, line + 1 + offset, f"module map lists {path!r}, which kbit_core does not have")
                    for offset, path in _module_map_names(token.content)
                    if not _module_exists(root, path)
                ]
        for child in token.children or ():
            line += child.type in ("softbreak", "hardbreak")
            if child.type == "link_open":
                broken = _check_link(root, doc, child.attrs["href"], slugs, md)
                problems += [Problem(name, line, broken)] if broken else []
            elif child.type in ("text", "code_inline"):
                problems += [Problem(name, line, what) for what in _names_in(root, child.content)]
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_doc_names_only_what_exists(doc: Path) -> None:
    problems = check_doc(ROOT, doc)
    assert not problems, "\n".join(map(str, problems))


def test_the_readme_links_every_doc() -> None:
    tokens = MarkdownIt("commonmark").parse((ROOT / "README.md").read_text())
    links = {
        child.attrs["href"].partition("#")[0]
        for token in tokens
        for child in token.children or ()
        if child.type == "link_open"
    }
    assert not {f"docs/{doc.name}" for doc in DOCS[1:]} - links


SYNTHETIC_DOC = """# A doc

## Real heading (2026-11-25 23:12–23:23 UTC)

See [the real one](#real-heading-2026-11-25-23122323-utc), [a gone one](#gone-heading),
[a real file](other.md#other-heading), [a gone anchor](other.md#nowhere), [a gone file](missing.md),
[outside](/work/main/x.py), and [the web](https://example.com/kbit_core/gone.py).
`kbit_core/pkg/mod.py` is real, `kbit_core/pkg/gone.py` is not; `pkg/mod.py` is real, `pkg/gone.py` is not;
`kbit_core.pkg.mod.thing` and `kbit_core/pkg/mod.thing` are real, `kbit_core/pkg/mod.gone` is not, `kbit_core.pkg.mod.gone` and `kbit_core.pkg.gone` are not.
`tests/unit/test_x.py::TestX::test_real[case]` runs, `tests/unit/test_x.py::test_gone` does not;
`test_x.py` is a test file, `test_y.py` is not.
Prose is no path: train/val/test, <workdir>/manifests/x.json, tasks and flows.

## Modules, one sentence each

```
ground
  mod_top.py            real
pkg/
  mod.py, gone_too.py   one real, one not
  *_codec.py            a glob that matches
  sub/
    deep.py             real
  description carried onto a line of its own: gone.py is prose here
```
"""


def test_the_checker_finds_each_kind_of_broken_name(tmp_path: Path) -> None:
    (tmp_path / "kbit_core" / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "kbit_core" / "pkg" / "mod.py").write_text("def thing():\n    pass\n")
    (tmp_path / "kbit_core" / "pkg" / "json_codec.py").write_text("")
    (tmp_path / "kbit_core" / "pkg" / "sub" / "deep.py").write_text("")
    (tmp_path / "kbit_core" / "mod_top.py").write_text("")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_x.py").write_text("class TestX:\n    def test_real(self):\n        pass\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other heading\n")
    doc = tmp_path / "docs" / "doc.md"
    doc.write_text(SYNTHETIC_DOC)

    found = sorted(problem.what for problem in check_doc(tmp_path, doc))

    assert found == sorted(
        [
            "link '#gone-heading': no heading #gone-heading in docs/doc.md",
            "link 'other.md#nowhere': no heading #nowhere in docs/other.md",
            "link 'missing.md': no file docs/missing.md",
            "link '/work/main/x.py' leaves the repository",
            "names 'kbit_core/pkg/gone.py', which does not exist",
            "names 'pkg/gone.py', which does not exist",
            "names 'kbit_core/pkg/mod.gone', which does not exist",
            "names 'kbit_core.pkg.mod.gone', which kbit_core does not have",
            "names 'kbit_core.pkg.gone', which kbit_core does not have",
            "module map lists 'pkg/gone_too.py', which kbit_core does not have",
            "names 'tests/unit/test_x.py::test_gone', which is not a test there",
            "names 'test_y.py', which no folder of tests/ holds",
        ]
    )


def test_repeated_headings_get_numbered_anchors() -> None:
    tokens = MarkdownIt("commonmark").parse("# Results\n\n## Results\n\n## `reader.workers` × 2: *fast*\n")
    assert heading_slugs(tokens) == {"results", "results-1", "readerworkers--2-fast"}
