"""An unknown key or option is the user's typo: one line naming it, the closest names, exit 2
(never Hydra's "+key" hint, which would add a key nothing reads)."""

import pytest

from dpsgd.config.schema import ConfigError
from dpsgd.launch.cli import compose


@pytest.mark.parametrize(
    "arg, message",
    [
        ("training.epoch=2", "training.epoch: no such key; did you mean training.epochs? ("),
        (
            "experiment=mnist_medum",
            "experiment=mnist_medum: no such experiment; did you mean mnist_medium",
        ),  # fmt: skip
        ("dataset=mnst", "dataset=mnst: no such dataset; did you mean mnist?"),
        ("nonsense=1", "nonsense: no such key (python -m dpsgd.train --help lists them)"),
        (
            "dataset.cls=MNIST",
            "dataset.cls: not read by the chosen dataset; dataset=torchvision reads it",
        ),  # a key of another option of the group, not a typo
        ("dataset.label=y", "dataset.label: not read by the chosen dataset; dataset=csv or"),
    ],
)
def test_a_typo_gets_the_closest_names(arg, message):
    with pytest.raises(ConfigError) as e:
        compose([arg])
    assert str(e.value).startswith(message) and "+" not in str(e.value)
