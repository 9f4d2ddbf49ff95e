"""The docs run and name real things.

* Every ``>>>`` example in docs/*.md and README.md runs as a doctest, in the repository root, each
  example kept small (accountant calls, samplers, a Ledger, config validation; no training run
  but the README's few-lot PrivateTrainer example; no wall-clock limit is asserted, since a loaded
  machine would fail it). Examples of one page share their globals, in page order.
* Every code reference in the docs exists: ``path/to/file.py`` and other repository paths,
  ``file.py:function`` / ``file.py:Class.method`` (checked with ``ast``, nothing imported),
  dotted ``dpsgd.module.name`` (imported), ``python -m module`` (a module or package with
  ``__main__``), ``make target`` (a Makefile target) and relative markdown links.

Why a test module rather than ``--doctest-glob='*.md'`` in pytest.ini: one place holds both checks,
examples run from the repository root whatever pytest's
working directory, and pytest.ini (shared with every test file) stays as it is. The pages run under
``make test`` because this file is in ``tests/``.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported once here, so no example pays for importing torch)

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Pages that must keep executable examples (an accidental reformat would otherwise drop them
# silently).
EXECUTABLE = ("ACCOUNTING.md", "ARCHITECTURE.md", "CONFIGURATION.md")

# ------------------------------------------------------------------------------------------------
# doctests


def run_page(path: Path) -> tuple[int, list[str]]:
    """(examples run, failure reports) for one markdown page; examples share globals in page
    order."""
    # a closing ``` fence would read as expected output: blank the fence lines (line numbers kept)
    text = "\n".join(
        "" if ln.lstrip().startswith("```") else ln
        for ln in path.read_text(encoding="utf-8").split("\n")
    )
    parser = doctest.DocTestParser()
    examples = parser.get_examples(text, name=path.name)
    globs: dict = {"__name__": f"docs.{path.stem}"}
    failures: list[str] = []
    for ex in examples:
        out: list[str] = []
        runner = doctest.DocTestRunner(optionflags=OPTIONS)
        test = doctest.DocTest([ex], globs, path.name, str(path), 0, None)
        res = runner.run(test, out=out.append, clear_globs=False)
        globs = test.globs  # DocTest copies its globals: carry them on
        line = ex.lineno + 1
        if res.failed:
            failures.append(f"{path.name}:{line}: {''.join(out).strip()}")
    return len(examples), failures


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_examples_pass(page, monkeypatch):
    monkeypatch.chdir(REPO)
    n, failures = run_page(page)
    assert not failures, "\n\n".join(failures)
    if page.name in EXECUTABLE:
        assert n > 0, f"{page.name}: no >>> examples found"


# ------------------------------------------------------------------------------------------------
# names

TOP_DIRS = ("dpsgd", "experiments", "bench", "tests", "conf", "results", "docs", ".ci")
SPAN = re.compile(r"`([^`\n]+)`")
PATH_REF = re.compile(
    r"^((?:%s)/[\w./-]*|Makefile|pytest\.ini|requirements[\w.-]*)(?::([A-Za-z_][\w.]*))?$"
    % "|".join(re.escape(d) for d in TOP_DIRS)
)
DOTTED = re.compile(r"^((?:dpsgd|experiments|bench)(?:\.[A-Za-z_]\w*)+)(?:\(\))?$")
MODULE_RUN = re.compile(r"python -m ([A-Za-z_][\w.]*)")
MAKE = re.compile(r"(?<![\w-])make ([a-z][\w-]*)(?![\w<-])")
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _members(node) -> dict[str, ast.AST]:
    """Names defined directly in a module or class body: functions, classes, assignments, fields."""
    out: dict[str, ast.AST] = {}
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Name):
                        out[e.id] = n
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out[n.target.id] = n
        elif isinstance(n, (ast.ImportFrom, ast.Import)):
            for a in n.names:
                out[(a.asname or a.name).split(".")[0]] = n
    return out


def check_py_name(file: Path, dotted: str) -> str | None:
    """None when ``dotted`` (``func``, ``Class``, ``Class.method``) is defined in ``file``; a method
    may come from a base class defined in the same file."""
    module = ast.parse(file.read_text(encoding="utf-8"))
    top = _members(module)
    rel = file.relative_to(REPO) if file.is_relative_to(REPO) else file
    node: ast.AST = module
    where = str(rel)
    for part in dotted.split("."):
        if not isinstance(node, (ast.ClassDef, ast.Module)):
            return f"{where} is not a class, so {dotted!r} cannot be checked"
        scope, found = [node], None
        while scope and found is None:  # the class, then its bases from this file
            cls = scope.pop(0)
            found = _members(cls).get(part)
            if isinstance(cls, ast.ClassDef):
                scope += [
                    top[b.id]
                    for b in cls.bases
                    if isinstance(b, ast.Name) and isinstance(top.get(b.id), ast.ClassDef)
                ]
        if found is None:
            return f"{part!r} is not defined in {where}"
        node, where = found, f"{rel}:{part}" if where == str(rel) else f"{where}.{part}"
    return None


def check_dotted(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(mod)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{name}: {mod} has no {'.'.join(parts[i:])!r}"
            obj = getattr(obj, attr)
        return None
    return f"{name}: no such module"


def check_module_run(mod: str) -> str | None:
    path = REPO.joinpath(*mod.split("."))
    if path.with_suffix(".py").is_file() or (path / "__main__.py").is_file():
        return None
    if mod.split(".")[0] not in TOP_DIRS:  # a third-party module (pytest, pip, venv)
        try:
            if importlib.util.find_spec(mod) is not None:
                return None
        except (ImportError, ValueError):
            pass
    return f"python -m {mod}: no {path.relative_to(REPO)}.py"


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][\w-]*):", text, flags=re.M))
    targets |= {f"sweep-{p.stem}" for p in (REPO / "conf" / "sweep").glob("*.yaml")}
    return targets


def name_problems(text: str, where: str, base: Path = REPO / "docs") -> list[str]:
    """Every reference in one markdown text that does not resolve, as 'where: reference: why'."""
    problems: list[str] = []
    for span in SPAN.findall(text):
        span = span.strip()
        if "<" in span or "*" in span or "{" in span:
            continue  # a pattern, not a name
        m = PATH_REF.match(span)
        if m:
            path, name = REPO / m.group(1).rstrip("/"), m.group(2)
            if not path.exists():
                problems.append(f"{where}: `{span}`: no such file or folder")
            elif name is not None:
                if path.suffix != ".py":
                    problems.append(
                        f"{where}: `{span}`: names inside non-Python files are not checkable"
                    )
                elif (why := check_py_name(path, name)) is not None:
                    problems.append(f"{where}: `{span}`: {why}")
            continue
        m = DOTTED.match(span)
        if m and (why := check_dotted(m.group(1))) is not None:
            problems.append(f"{where}: `{span}`: {why}")
    code = "\n".join(SPAN.findall(text) + FENCE.findall(text))  # commands only count inside code
    for mod in set(MODULE_RUN.findall(code)):
        if (why := check_module_run(mod)) is not None:
            problems.append(f"{where}: {why}")
    targets = make_targets()
    for t in set(MAKE.findall(code)):
        if t not in targets:
            problems.append(f"{where}: make {t}: no such Makefile target")
    for link in set(LINK.findall(text)):
        if "://" in link or link.startswith("mailto:"):
            continue
        if not (base / link).exists():
            problems.append(f"{where}: link ({link}): no such file")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_names_exist(page):
    problems = name_problems(page.read_text(encoding="utf-8"), page.name, base=page.parent)
    assert not problems, "\n".join(problems)


def test_architecture_traces_the_pipeline():
    """ARCHITECTURE.md names the functions a lot passes through, config to figure."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for ref in (
        "dpsgd/config/schema.py:validate",
        "dpsgd/data/readers.py:load_dataset",
        "dpsgd/mechanism/pca.py:fit_projection",
        "dpsgd/mechanism/sampling.py:PoissonSampler.epoch",
        "dpsgd/train.py:run_epoch",
        "dpsgd/mechanism/clipping/engine.py:PerExampleClipper.clipped_sum",
        "dpsgd/mechanism/optim.py:DPSGD.step",
        "dpsgd/accountant/ledger.py:Ledger.record",
        "dpsgd/run/report.py:metrics_row",
        "experiments/figures.py:main",
    ):
        assert f"`{ref}`" in text, ref


def test_names_checker_catches_wrong_names():
    """The checker fails on names that do not exist (so a passing page means something)."""
    assert name_problems("make it fast, python -m dpsgd.nope in prose", "prose") == []
    bad = (
        "`dpsgd/mechanism/sampling.py:PoissonSampler.iter` `dpsgd/nope.py` "
        "`dpsgd/mechanism/optim.py:SGD` "
        "`dpsgd.accountant.Ledger.no_such` `python -m dpsgd.nope` `make no-such-target` "
        "[x](NOPE.md)"
    )
    problems = name_problems(bad, "synthetic")
    assert len(problems) == 7, problems
    good = (
        "`dpsgd/mechanism/sampling.py:PoissonSampler.epoch` "
        "`dpsgd/mechanism/sampling.py:PoissonSampler.state_dict` `dpsgd/mechanism/optim.py` "
        "`dpsgd/config/schema.py:PrivacyConfig.sigma` "
        "`dpsgd.accountant.Ledger.steps_within` `python -m dpsgd.privacy` `make test` [r](RUNS.md)"
    )
    assert name_problems(good, "synthetic") == []


def test_configuration_lists_every_key():
    """docs/CONFIGURATION.md has a row for every key of the typed config."""
    from dataclasses import fields

    from dpsgd.config.schema import GROUPS, Config

    text = (REPO / "docs" / "CONFIGURATION.md").read_text(encoding="utf-8")
    keys = [f"{g}.{f.name}" for g, cls in GROUPS.items() for f in fields(cls)]
    keys += [f.name for f in fields(Config) if f.name not in GROUPS]
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"docs/CONFIGURATION.md lacks a row for {missing}"
