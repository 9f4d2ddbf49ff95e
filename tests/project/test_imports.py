"""The import graph of ``dpsgd``: no circles, no private names used across packages, no import from
a higher layer, and no folder of more than ten modules.

Read with ``ast`` (nothing imported), function-level imports included: a circle hidden inside a
function is still a circle. Only the body of an ``if __name__ == "__main__":`` guard is left out: it
is the command line of ``python -m`` (the program on top of every layer), never run on import. The
modules of one package may share private names (``accountant/privacy_loss/``:
``pld_lot._step_pmf``); across packages only public names are used (shared helpers become public
names of one module, e.g. ``dpsgd/core/errors.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "dpsgd"


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _target(mods: dict[str, Path], name: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from."""
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if mods[name].name == "__init__.py" else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_main_guard(node) -> bool:
    t = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(t, ast.Compare)
        and isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and len(t.comparators) == 1
        and isinstance(t.comparators[0], ast.Constant)
        and t.comparators[0].value == "__main__"
    )


def _walk(tree):
    """``ast.walk`` without the bodies of ``if __name__ == "__main__":`` guards."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_main_guard(c))


def _imports(mods: dict[str, Path]):
    """(importer, imported module, [names]) for every import of a dpsgd module inside dpsgd."""
    for name, path in mods.items():
        for node in _walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                target = _target(mods, name, node)
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                if len(subs) == len(node.names):  # from pkg import submodule, ...
                    yield from ((name, s, []) for s in subs)
                elif target in mods:
                    yield name, target, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                yield from ((name, a.name, []) for a in node.names if a.name in mods)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    mods = _modules()
    graph = {m: set() for m in mods}
    for a, b, _ in _imports(mods):
        if a != b:
            graph[a].add(b)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _package(mods: dict[str, Path], m: str) -> str:
    return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]


def test_modules_use_only_public_names_of_other_packages():
    """A package may share private names inside itself; across packages only public names are
    used."""
    mods = _modules()
    bad = []
    for a, b, names in _imports(mods):
        if _package(mods, a) == _package(mods, b):
            continue
        private = [n for n in names if n.startswith("_")]
        if private or any(part.startswith("_") for part in b.split(".")[1:]):
            bad.append(f"{a} imports {private or b} from {b}")
    for m in mods:  # module._name: an attribute of a dpsgd module of another package
        tree = ast.parse(mods[m].read_text(encoding="utf-8"))
        aliases = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if _target(mods, m, n) + "." + a.name in mods
            and _package(mods, _target(mods, m, n) + "." + a.name) != _package(mods, m)
        }
        bad += [
            f"{m} uses {n.value.id}.{n.attr}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id in aliases
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
        ]
    assert bad == []


# The layers of dpsgd, bottom to top (docs/ARCHITECTURE.md walks them): a module imports only from
# its own layer or the ones below. Algorithm 1 (train) sits under the command line (launch), which
# runs it; the other commands (privacy, audit, tune, pretrain) sit on top.
LAYERS = [
    ("dpsgd.core", "dpsgd.accountant"),
    ("dpsgd.data",),
    ("dpsgd.models",),
    ("dpsgd.mechanism",),
    ("dpsgd.config",),
    ("dpsgd.workbench",),
    ("dpsgd.run",),
    ("dpsgd.train",),
    ("dpsgd.launch",),
    (
        "dpsgd.privacy",
        "dpsgd.privacy_correlated",
        "dpsgd.audit",
        "dpsgd.tune",
        "dpsgd.report",
        "dpsgd.crosscheck",
    ),
    ("dpsgd.pretrain",),
]


def _layer(m: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(m == p or m.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{m}: in no layer of LAYERS (add its package there)")


def test_every_module_has_a_layer():
    for m in _modules():
        if m != "dpsgd":
            _layer(m)


def test_no_import_from_a_higher_layer():
    mods = _modules()
    up = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, b, _ in _imports(mods)
        if a != "dpsgd" and b != "dpsgd" and _layer(b) > _layer(a)
    ]
    assert up == []


def test_no_function_longer_than_80_lines():
    """One idea per function: none in dpsgd/ runs past 80 lines (docstring included)."""
    long = [
        f"{p.relative_to(ROOT.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for p in ROOT.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > 80
    ]
    assert long == []


# The accountant inside: the method families (renyi/, privacy_loss/) sit below what composes and
# records them (compose, calibrate, ledger, ...), and use only the accountant's limits from above.
METHODS = ("dpsgd.accountant.renyi", "dpsgd.accountant.privacy_loss")


def test_accountant_methods_import_nothing_above_them():
    mods = _modules()
    up = [
        f"{a} imports {b}"
        for a, b, _ in _imports(mods)
        if a.startswith(METHODS)
        and b.startswith("dpsgd.accountant")
        and not b.startswith(METHODS)
        and b != "dpsgd.accountant.limits"
    ]
    assert up == []


# The house rule: at most ten modules (``__init__.py`` aside) in a folder of dpsgd/. A folder better
# left whole is named here with its reason, which docs/ARCHITECTURE.md gives too.
MODULES_MAX = 10
LEFT_WHOLE: dict[str, str] = {}


def test_no_folder_holds_more_than_ten_modules():
    crowded = {}
    for folder in [ROOT, *(d for d in ROOT.rglob("*") if d.is_dir())]:
        n = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        name = str(folder.relative_to(ROOT.parent))
        if n > MODULES_MAX and name not in LEFT_WHOLE:
            crowded[name] = n
    assert crowded == {}, (
        f"split these folders, or say in LEFT_WHOLE and docs/ARCHITECTURE.md why not: {crowded}"
    )
