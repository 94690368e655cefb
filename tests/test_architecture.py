"""The arrows between the five packages, read from the source with ``ast`` only (no imports):

* a package imports only the packages below it: ``striped_fs`` at the bottom; ``ckpt``,
  ``snapshot`` and ``prefetch`` on it, none of them importing another; ``bootseer`` on top;
* a package takes from another only what that package's ``__init__.py`` exports in
  ``__all__``, and from the package itself (``from striped_fs import redact``, not
  ``from striped_fs.redact import redact``: the submodules are not the contract), never a
  ``_``-private name; a submodule taken whole (``from striped_fs import fuse``) passes;
* no import cycle among the modules of ``bootseer/``: every import counts, deferred into a
  function too (that hides a cycle, it does not end it), except under ``if TYPE_CHECKING``;
  importing ``a.b.c`` imports the package ``a.b`` first, so that counts as an import of it.

What is already there is listed in ``tests/architecture_known.json``. That list may only get
shorter: a new finding fails, and so does a listed one that is gone, so that the list stays true.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KNOWN_FILE = Path(__file__).with_name("architecture_known.json")
#: the level of each package: a package may import only packages of a lower level
LEVELS = {"striped_fs": 0, "ckpt": 1, "snapshot": 1, "prefetch": 1, "bootseer": 2}
CYCLE_PACKAGE = "bootseer"


@dataclass
class Findings:
    upward: set[str] = field(default_factory=set)  # "importer -> imported"
    unexported: set[str] = field(default_factory=set)  # "importer: module.name"
    cycles: set[str] = field(default_factory=set)  # "a <-> b <-> c" (sorted)

    def as_json(self) -> dict[str, list[str]]:
        return {k: sorted(getattr(self, k)) for k in ("upward", "unexported", "cycles")}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run, at module level or deferred into a function (a deferred
    import hides a cycle, it does not end it); those under ``if TYPE_CHECKING`` never run."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _exports(root: Path, package: str) -> set[str]:
    """The names in ``package/__init__.py``'s ``__all__``, which must be a literal list of
    strings: a name the check cannot read would pass unseen."""
    init = root / package / "__init__.py"
    if not init.exists():
        return set()
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                elts = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
                    raise ValueError(
                        f"{init}: __all__ must be a literal list of strings (the check reads "
                        "it without importing the package); write the names out"
                    )
                return {e.value for e in elts if isinstance(e, ast.Constant)}
    return set()


def check(root: Path, levels: dict[str, int], cycle_package: str) -> Findings:
    """The findings of the three rules over the packages ``levels`` names under ``root``."""
    findings = Findings()
    modules: dict[str, tuple[Path, ast.Module]] = {}
    for package in levels:
        for path in sorted((root / package).rglob("*.py")):
            modules[_module_name(root, path)] = (path, ast.parse(path.read_text("utf-8")))
    exports = {package: _exports(root, package) for package in levels}
    edges: dict[str, set[str]] = {}
    for module, (path, tree) in modules.items():
        own = module.split(".")[0]
        is_package = path.name == "__init__.py"
        for node in _all_imports(tree):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            else:
                base = _absolute(module, is_package, node)
                targets = [(base, alias.name) for alias in node.names]
            for target, name in targets:
                other = target.split(".")[0]
                if other not in levels or other == own:
                    continue
                if levels[other] >= levels[own]:
                    findings.upward.add(f"{module} -> {target}")
                if name is not None and name != "*":
                    submodule = f"{target}.{name}"
                    if submodule in modules:  # ``from pkg import submodule``
                        name = None
                if name is not None and (
                    name.startswith("_") or name not in exports[other] or target != other
                ):
                    findings.unexported.add(f"{module}: {target}.{name}")
        if own != cycle_package:
            continue
        deps = edges.setdefault(module, set())
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _absolute(module, is_package, node)
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for name in [*names, *(a for n in names for a in _parents(n, module))]:
                if name in modules and name.split(".")[0] == cycle_package and name != module:
                    deps.add(name)
    findings.cycles = {" <-> ".join(sorted(c)) for c in _cycles(edges)}
    return findings


def _parents(name: str, importer: str) -> list[str]:
    """The packages Python imports before ``name`` (``a.b`` for ``a.b.c``), leaving out the
    top-level one (every module would depend on it) and the importer's own packages (already
    being imported when it runs)."""
    parts = name.split(".")
    return [
        p
        for p in (".".join(parts[:i]) for i in range(2, len(parts)))
        if not importer.startswith(p + ".")
    ]


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.add(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_arrows_are_as_known_and_only_known() -> None:
    known = json.loads(KNOWN_FILE.read_text())
    got = check(ROOT, LEVELS, CYCLE_PACKAGE).as_json()
    for rule in ("upward", "unexported", "cycles"):
        new = sorted(set(got[rule]) - set(known[rule]))
        gone = sorted(set(known[rule]) - set(got[rule]))
        assert not new, f"{rule}: new findings (fix them; do not list them): {new}"
        assert not gone, f"{rule}: fixed, remove from {KNOWN_FILE.name}: {gone}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


LEVELS_FAKE = {"low": 0, "top": 1}


def test_the_checker_finds_an_upward_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "import top.b\n",
            "top/__init__.py": "",
            "top/b.py": "",
        },
    )
    assert check(root, LEVELS_FAKE, "top").upward == {"low.a -> top.b"}


def test_the_checker_finds_private_and_unexported_names(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "__all__ = ['ok']\nfrom .m import ok\n",
            "low/m.py": "ok = 1\n_secret = 2\nother = 3\n",
            "top/__init__.py": "",
            "top/b.py": "from low.m import _secret, other\nfrom low import ok\nfrom low import m\n",
        },
    )
    found = check(root, LEVELS_FAKE, "top")
    assert found.unexported == {"top.b: low.m._secret", "top.b: low.m.other"}
    assert not found.upward


def test_the_checker_finds_an_exported_name_taken_from_a_submodule(tmp_path: Path) -> None:
    """``low.m.ok`` is exported, but the contract is ``low``: ``from low.m import ok``
    reaches past it (and breaks when ``ok`` moves to another module of ``low``)."""
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "__all__ = ['ok']\nfrom .sub.m import ok\n",
            "low/sub/__init__.py": "",
            "low/sub/m.py": "ok = 1\n",
            "top/__init__.py": "",
            "top/b.py": "from low.sub.m import ok\nfrom low.sub import m\nimport low.sub.m\n",
            "top/c.py": "from low.sub import ok\n",
        },
    )
    assert check(root, LEVELS_FAKE, "top").unexported == {
        "top.b: low.sub.m.ok",
        "top.c: low.sub.ok",
    }


def test_the_checker_refuses_an_all_it_cannot_read(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "_LAZY = {'ok': 'm'}\n__all__ = ['PrefetchError', *_LAZY]\n",
            "top/__init__.py": "",
        },
    )
    with pytest.raises(ValueError, match="__all__ must be a literal list of strings"):
        check(root, LEVELS_FAKE, "top")


def test_the_checker_finds_cycles_deferred_ones_too_but_not_type_checking_ones(
    tmp_path: Path,
) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "top/__init__.py": "",
            "top/a.py": "from . import b\n",
            "top/b.py": "from .c import x\n",
            "top/c.py": "from top.a import y\nx = 1\n",
            "top/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n",
            "top/e.py": "import top.d\n",
            "top/f.py": "import top.g\n",
            "top/g.py": "def later():\n    from . import f\n",
        },
    )
    assert check(root, LEVELS_FAKE, "top").cycles == {
        "top.a <-> top.b <-> top.c",
        "top.f <-> top.g",
    }
