"""``pip install -e .`` in a fresh venv, then a script outside the repository trains a user's CNN
(Conv2d, GroupNorm, Linear) on a TensorDataset to a target ε through ``dpsgd.PrivateTrainer``: its ε
is the privacy command line's for the same schedule, and its ledger holds one charge per lot run.

The venv reuses this environment's packages (a .pth file naming its site-packages) and installs
dpsgd itself with ``--no-deps``: what is tested is the packaging, not pip's resolver (CI installs
the pinned dependencies once, with ``make install``)."""

from __future__ import annotations

import json
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent(
    """
    import json, torch, dpsgd
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
            self.fc = nn.Linear(8 * 4 * 4, 10)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
            return self.fc(x.flatten(1))

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(500, 3, 8, 8, generator=g),
                                          torch.randint(0, 10, (500,), generator=g))
    t = dpsgd.PrivateTrainer(Net(), data, lot_size=50, target_epsilon=2.0, epochs=3, seed=0)
    stop = t.fit()
    print(json.dumps({"stop": stop, "steps": t.steps, "epsilon": t.epsilon, "sigma": t.plan.sigma,
                      "charges": sum(e["count"] for e in t.ledger.to_dict()["entries"]),
                      "accountant": t.accountant,
                      "file": dpsgd.__file__}))
    """
)


@pytest.mark.slow
def test_pip_install_e_then_a_script_outside_the_repository(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run(
        [str(py), "-c", where], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(purelib) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e",
                    str(REPO)], check=True, cwd=tmp_path)  # fmt: skip
    (tmp_path / "mine.py").write_text(SCRIPT)
    out = subprocess.run([str(py), "mine.py"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(REPO)) and got["stop"] == "epochs_completed"
    assert got["charges"] == got["steps"] == 30  # one charge per lot run
    schedule = ["--q", "0.1", "--sigma", repr(got["sigma"]), "--steps", "30", "--json"]
    cli = subprocess.run(
        [str(py), "-m", "dpsgd.privacy", *schedule], capture_output=True, text=True, check=True
    )
    # the API's default accountant for Poisson lots is PLD (the tightest valid one); the same
    # schedule composed by two call paths on the same grid: equal far below its resolution
    assert got["accountant"] == "pld"
    assert got["epsilon"] == pytest.approx(json.loads(cli.stdout)["pld"]["epsilon"], rel=1e-6)
    assert got["epsilon"] <= 2.0
