"""The privacy CLI: python -m dpsgd.privacy (table, --json, --target-epsilon, bad arguments)."""
import json
import subprocess
import sys

import pytest

from dpsgd import privacy


def _run(capsys, *argv):
    rc = privacy.main(list(argv))
    return rc, capsys.readouterr()


def test_table_has_every_accountant(capsys):
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--epochs", "100", "--delta", "1e-5")
    assert rc == 0
    for word in ("moments", "rdp", "pld", "strong composition (paper)", "NOT a valid bound", "lambda=19"):
        assert word in out.out
    assert "1.2586" in out.out and "9.353" in out.out


def test_json_keys_and_values(capsys):
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--steps", "10000", "--json")
    d = json.loads(out.out)
    assert set(d) == {"moments", "rdp", "pld", "strong_composition"}
    assert all("epsilon" in v for v in d.values())
    assert d["moments"]["epsilon"] == pytest.approx(1.2586, abs=1e-4) and d["moments"]["order"] == 19
    assert d["pld"]["epsilon"] <= d["rdp"]["epsilon"] <= d["moments"]["epsilon"]
    assert d["strong_composition"]["valid_bound"] is False


def test_target_epsilon_json(capsys):
    rc, out = _run(capsys, "--q", "0.01", "--target-epsilon", "2", "--epochs", "20", "--json")
    d = json.loads(out.out)
    assert set(d) == {"moments", "rdp", "pld", "strong_composition"}
    for v in d.values():
        assert v["sigma"] > 0 and 1.98 <= v["epsilon"] <= 2.0
    assert d["pld"]["sigma"] <= d["rdp"]["sigma"] <= d["moments"]["sigma"]


@pytest.mark.parametrize("argv,name", [
    (["--q", "1.5", "--sigma", "4", "--steps", "10"], "q"),
    (["--q", "0.01", "--sigma", "0", "--steps", "10"], "sigma"),
    (["--q", "0.01", "--sigma", "4", "--steps", "10", "--delta", "1"], "delta"),
    (["--q", "0.01", "--sigma", "4", "--steps", "-3"], "steps"),
    (["--q", "0.01", "--target-epsilon", "-1", "--steps", "10"], "target_epsilon"),
    (["--q", "0.01", "--sigma", "4"], "--steps"),
    (["--q", "abc", "--sigma", "4", "--steps", "10"], "--q"),
    (["--q", "0.01", "--steps", "10"], "sigma"),
])
def test_bad_arguments_one_line_exit_2(capsys, argv, name):
    with pytest.raises(SystemExit) as exc:
        privacy.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "dpsgd.privacy", "--q", "2", "--sigma", "1", "--steps", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "q" in r.stderr
