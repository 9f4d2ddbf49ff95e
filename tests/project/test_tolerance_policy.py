"""The tolerance policy of the tests (docs/DEVELOPMENT.md, "Tolerances"), enforced on every .py file
under tests/.

* A tolerance of 1e-9 or tighter (``rel=``, ``rtol=``, ``abs=``, ``atol=`` with a literal in
  (0, 1e-9], or ``rtol`` and ``atol`` both 0) is allowed only with a comment saying why the
  comparison is exact: ``exact``, ``bit-identical`` or ``integer`` in a comment on that statement or
  the line above it. Anything computed through exp/log/FFT/BLAS/root-finding takes its tolerance
  from tests/tolerances.py instead.
* No wall-clock time decides a test: no ``assert`` (and no ``if`` that records a failure) on a value
  measured with time.time / perf_counter / monotonic.
* The root-finder tolerances copied into tests/tolerances.py are the ones in dpsgd.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

import tolerances

TESTS = Path(__file__).resolve().parents[1]
TIGHT = 1e-9
KWARG = re.compile(
    r"\b(rel|rtol|abs|atol)\s*=\s*([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?)(?![\w.])"
)
BOTH_ZERO = re.compile(r"\brtol\s*=\s*0(?:\.0*)?\s*,\s*atol\s*=\s*0(?:\.0*)?(?![\w.])")
EXACT = re.compile(r"exact|bit-identical|bit for bit|integer", re.IGNORECASE)
CLOCKS = {
    "time",
    "perf_counter",
    "monotonic",
    "process_time",
    "perf_counter_ns",
    "time_ns",
    "monotonic_ns",
}


def _comments(source: str) -> dict[int, str]:
    """Comment text per line number (1-based), from the tokenizer (strings are not comments)."""
    out: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = out.get(tok.start[0], "") + tok.string
    except (tokenize.TokenError, IndentationError):
        pass
    return out


def _code(line: str) -> str:
    """The line without a trailing comment (good enough for the kwargs looked for here)."""
    return line.split("#", 1)[0]


def _statement_spans(source: str) -> dict[int, tuple[int, int]]:
    """Line -> (first, last) line of the innermost statement holding it (a compound statement: its
    header only), so a comment anywhere on a call the formatter split over lines is found."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    spans: dict[int, tuple[int, int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        last = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
        for line in range(node.lineno, max(last, node.lineno) + 1):
            old = spans.get(line)
            if old is None or old[1] - old[0] > last - node.lineno:
                spans[line] = (node.lineno, max(last, node.lineno))
    return spans


def tight_tolerances(source: str, name: str = "<source>") -> list[str]:
    """Lines with a tolerance <= 1e-9 (or rtol and atol both 0) and no exactness comment on their
    statement or on the line above it."""
    comments = _comments(source)
    spans = _statement_spans(source)
    problems = []
    for i, line in enumerate(source.splitlines(), start=1):
        code = _code(line)
        tight = [f"{k}={v}" for k, v in KWARG.findall(code) if 0.0 < float(v) <= TIGHT]
        if BOTH_ZERO.search(code):
            tight.append("rtol and atol 0")
        if not tight:
            continue
        first, last = spans.get(i, (i, i))
        near = {i - 1, *range(first - 1, last + 1)}
        if EXACT.search(" ".join(comments.get(j, "") for j in sorted(near))):
            continue
        problems.append(
            f"{name}:{i}: {', '.join(tight)} without an exactness comment "
            f"(use tests/tolerances.py, or say why it is exact): {line.strip()}"
        )
    return problems


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _timed_names(target: ast.AST, value: ast.AST, timed: set[str]) -> set[str]:
    """Names in ``target`` that receive a clock reading (``a, b = x, time.time()`` pairs
    elementwise)."""
    if (
        isinstance(target, ast.Tuple)
        and isinstance(value, ast.Tuple)
        and len(target.elts) == len(value.elts)
    ):
        out: set[str] = set()
        for t, v in zip(target.elts, value.elts):
            if any(
                _is_clock_call(n) or (isinstance(n, ast.Name) and n.id in timed)
                for n in ast.walk(v)
            ):
                out |= _timed_names(t, v, timed)
        return out
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def timing_asserts(source: str, name: str = "<source>") -> list[str]:
    """``assert``s (and ``if`` tests) that read a clock or a value derived from one."""
    tree = ast.parse(source)
    problems = []
    for scope in [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]:
        timed: set[str] = set()
        body = list(ast.walk(scope)) if scope is not tree else [n for n in tree.body]
        for node in body:  # names assigned from a clock
            if (
                isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                and node.value is not None
            ):
                reads = any(
                    _is_clock_call(n) or (isinstance(n, ast.Name) and n.id in timed)
                    for n in ast.walk(node.value)
                )
                if reads:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        timed |= _timed_names(t, node.value, timed)
        for node in body:
            test = node.test if isinstance(node, (ast.Assert, ast.If)) else None
            if test is None:
                continue
            if isinstance(node, ast.If) and not any(
                isinstance(n, ast.Compare) for n in ast.walk(test)
            ):
                continue
            if any(
                _is_clock_call(n) or (isinstance(n, ast.Name) and n.id in timed)
                for n in ast.walk(test)
            ):
                kind = "assert" if isinstance(node, ast.Assert) else "if"
                problems.append(
                    f"{name}:{node.lineno}: {kind} on a wall-clock time: {ast.unparse(test)}"
                )
    return sorted(set(problems))


def _files():
    return sorted(TESTS.rglob("*.py"))


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_tight_tolerance_without_exactness_comment(path):
    problems = tight_tolerances(path.read_text(encoding="utf-8"), path.name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_timing_in_asserts(path):
    problems = timing_asserts(path.read_text(encoding="utf-8"), path.name)
    assert not problems, "\n".join(problems)


# --- the linter itself, on small sources ----------------------------------------------------------


def _src(s: str) -> str:
    """Synthetic sources are written with ``~`` for ``=`` in tolerance arguments, so that this file
    itself holds no tight tolerance (for the lint test above and the pre-commit grep)."""
    return re.sub(r"\b(rel|rtol|abs|atol)~", r"\1=", s)


@pytest.mark.parametrize(
    "src",
    [
        "assert x == pytest.approx(y, rel~1e-12)\n",
        "np.testing.assert_allclose(a, b, rtol~1.0e-10)\n",
        "torch.testing.assert_close(a, b, rtol~0, atol~0)\n",
        "torch.testing.assert_close(a, b, rtol~1e-5, atol~1e-14)\n",
        "assert math.isclose(a, b, abs~1E-9)\n",
        "assert x == pytest.approx(y, rel~1e-12)  # pinned on this machine\n",
        "s = 'exact'\nassert x == pytest.approx(y, rel~1e-12)\n",  # a string is not a comment
    ],
)
def test_linter_flags_tight_tolerances(src):
    assert len(tight_tolerances(_src(src))) == 1


@pytest.mark.parametrize(
    "src",
    [
        "assert x == pytest.approx(y, rel~1e-12)  # exact: the same integers on both sides\n",
        (
            "# bit-identical: a replay of the same run on the same machine\n"
            "torch.testing.assert_close(a, b, rtol~0, atol~0)\n"
        ),
        "assert x == pytest.approx(y, rel~1e-6)\n",
        "assert x == pytest.approx(y, abs~0.005)\n",
        "assert x == pytest.approx(y, rel~tol.f64_rtol(model))\n",
        "torch.testing.assert_close(a, b, rtol~0, atol~1e-6)\n",
        "q = 1e-12  # not a tolerance\n",
        (
            "torch.testing.assert_close(\n    a, b, rtol~0, atol~0\n)"
            "  # exact: integers, a formatter split it\n"
        ),
    ],
)
def test_linter_passes_loose_or_explained_tolerances(src):
    assert tight_tolerances(_src(src)) == []


def test_linter_flags_timing_asserts():
    src = (
        "import time\n"
        "def test_a():\n    t0 = time.perf_counter()\n    f()\n"
        "    took = time.perf_counter() - t0\n"
        "    assert took < 2.0\n"
        "def test_b():\n    t0 = time.time()\n    f()\n    assert time.time() - t0 < 2\n"
        "def test_c(failures):\n    t0 = time.monotonic()\n    elapsed = time.monotonic() - t0\n"
        "    if elapsed > 1:\n        failures.append('slow')\n"
    )
    got = timing_asserts(src)
    assert [g.split(":")[1] for g in got] == ["10", "14", "6"]


def test_linter_allows_deadlines_and_reports():
    src = (
        "import time\n"
        "def test_a(proc):\n    deadline = time.time() + 240\n"
        "    while time.time() < deadline and proc.poll() is None:\n        pass\n"
        "    t0 = time.time()\n    took = time.time() - t0\n    print(f'took {took:.1f} s')\n"
        "    assert proc.returncode == 0\n"
    )
    assert timing_asserts(src) == []


def test_root_finder_tolerances_match_dpsgd():
    """tests/tolerances.py copies the brentq tolerances of gaussian_epsilon; they must be the
    code's."""
    from dpsgd.accountant import strong_composition as sc

    src = inspect.getsource(sc.gaussian_epsilon)
    call = re.search(r"brentq\([\s\S]*?xtol=([0-9.eE+-]+), rtol=([0-9.eE+-]+)\s*\)", src)
    assert call, (
        "gaussian_epsilon no longer calls brentq(xtol=..., rtol=...): update tests/tolerances.py"
    )
    assert (float(call.group(1)), float(call.group(2))) == (
        tolerances.GAUSSIAN_EPSILON_XTOL,  # exact: literals
        tolerances.GAUSSIAN_EPSILON_RTOL,
    )
