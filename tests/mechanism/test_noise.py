"""GaussianNoise (dpsgd.mechanism.noise): the N(0, σ²C²) source of Algorithm 1.

Seeded mode must be reproducible and resumable bit-exactly from its state_dict (checkpoint/resume);
secure mode (privacy.secure_rng=true) must draw the right distribution from OS entropy, refuse a
fixed seed, and never repeat itself. Statistical checks use bounds of >= 6 standard errors (or
p > 1e-6), so a correct implementation fails them with probability < 1e-6.
"""

import io
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpsgd.mechanism.noise import GaussianNoise

N = 200_000  # samples for the statistical checks: SE(std)/std = 1/sqrt(2N) ≈ 0.0016


def _check_gaussian(z: np.ndarray, std: float) -> None:
    n = z.size
    se_mean, se_std = std / math.sqrt(n), std / math.sqrt(2 * n)
    assert abs(z.mean()) < 6 * se_mean, f"mean {z.mean()} not ≈ 0"
    assert abs(z.std() - std) < 6 * se_std, f"std {z.std()} not ≈ {std}"
    # shape of the distribution, not just two moments: Kolmogorov–Smirnov against N(0, std²)
    assert stats.kstest(z / std, "norm").pvalue > 1e-6


def test_seeded_is_reproducible():
    a = GaussianNoise(seed=123).sample((1000,), 2.0)
    b = GaussianNoise(seed=123).sample((1000,), 2.0)
    c = GaussianNoise(seed=124).sample((1000,), 2.0)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert GaussianNoise(seed=123).name == "torch_generator"


def test_seeded_resumes_from_state_dict_bit_exactly():
    ref = GaussianNoise(seed=7)
    ref.sample((100, 3), 1.0)
    state = ref.state_dict()
    # round-trip through torch.save/torch.load as a checkpoint would
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    expected = [ref.sample((50,), 0.5), ref.sample((4, 5), 3.0)]

    resumed = GaussianNoise(seed=999)  # any seed: the state overrides it
    resumed.load_state_dict(state)
    got = [resumed.sample((50,), 0.5), resumed.sample((4, 5), 3.0)]
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    assert resumed.seed == 7


def test_seedless_nonsecure_records_its_seed():
    a = GaussianNoise(seed=None)
    b = GaussianNoise(seed=a.state_dict()["seed"])
    assert torch.equal(a.sample((10,), 1.0), b.sample((10,), 1.0))


@pytest.mark.parametrize("std", [0.3, 4.0])
def test_seeded_std_matches_request(std):
    z = GaussianNoise(seed=0).sample((N,), std, dtype=torch.float64).numpy()
    _check_gaussian(z, std)


def test_shape_dtype_and_zero_std():
    for secure in (False, True):
        g = GaussianNoise(seed=None if secure else 1, secure=secure)
        x = g.sample((3, 4, 5), 1.5, dtype=torch.float32)
        assert x.shape == (3, 4, 5) and x.dtype == torch.float32 and x.device.type == "cpu"
        assert g.sample(torch.Size([7]), 1.0, dtype=torch.float64).dtype == torch.float64
        assert g.sample((), 1.0).shape == ()
        assert torch.count_nonzero(g.sample((10,), 0.0)) == 0


@pytest.mark.parametrize("std", [1.0, 16.0])
def test_secure_std_matches_request(std):
    g = GaussianNoise(secure=True)
    z = g.sample((N,), std, dtype=torch.float64).numpy()
    _check_gaussian(z, std)
    assert g.name != "torch_generator"


@pytest.mark.parametrize("seed", [0, 1, 123])
def test_secure_refuses_fixed_seed(seed):
    with pytest.raises(ValueError, match=r"privacy\.noise_seed"):
        GaussianNoise(seed=seed, secure=True)


def test_secure_draws_differ_between_instances_and_calls():
    a, b = GaussianNoise(secure=True), GaussianNoise(secure=True)
    xa, xb = a.sample((64,), 1.0), b.sample((64,), 1.0)
    assert not torch.equal(xa, xb)
    assert not torch.equal(xa, a.sample((64,), 1.0))
    # independent streams: no detectable correlation between two instances
    za = a.sample((N,), 1.0, dtype=torch.float64).numpy()
    zb = b.sample((N,), 1.0, dtype=torch.float64).numpy()
    assert abs(np.corrcoef(za, zb)[0, 1]) < 6 / math.sqrt(N)


def test_secure_and_seeded_checkpoints_do_not_mix():
    secure, seeded = GaussianNoise(secure=True), GaussianNoise(seed=3)
    assert "state" not in secure.state_dict()  # nothing replayable is stored
    with pytest.raises(ValueError, match="secure_rng"):
        seeded.load_state_dict(secure.state_dict())
    with pytest.raises(ValueError, match="secure_rng"):
        secure.load_state_dict(seeded.state_dict())


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("shape", [(N,), (3, 70_001)])  # one chunk; several chunks
def test_add_in_place_matches_std_and_draws_fresh_noise(secure, shape):
    g = GaussianNoise(seed=None if secure else 5, secure=secure)
    t = torch.full(shape, 2.0, dtype=torch.float64)
    ptr = t.data_ptr()
    assert g.add_(t, 3.0) is t and t.data_ptr() == ptr
    z = (t - 2.0).flatten().numpy()
    _check_gaussian(z, 3.0)
    assert len(np.unique(z)) == z.size  # chunks are not repeats of one buffer


def test_add_is_reproducible_resumable_and_noncontiguous_safe():
    a, b = GaussianNoise(seed=9), GaussianNoise(seed=9)
    ta, tb = torch.zeros(200_000), torch.zeros(200_000)
    a.add_(ta, 1.0), b.add_(tb, 1.0)
    assert torch.equal(ta, tb)
    c = GaussianNoise(seed=0)
    c.load_state_dict(a.state_dict())
    x, y = torch.zeros(50), torch.zeros(50)
    a.add_(x, 2.0), c.add_(y, 2.0)
    assert torch.equal(x, y)
    nc = torch.zeros(40, 30).t()  # not contiguous: drawn whole, same law
    before = nc.clone()
    GaussianNoise(seed=1).add_(nc, 1.0)
    assert not torch.equal(nc, before) and nc.shape == (30, 40)
    zero = torch.zeros(10)
    GaussianNoise(seed=1).add_(zero, 0.0)
    assert torch.count_nonzero(zero) == 0


# -- noise drawn ahead on a worker thread (GaussianNoise.ahead) -----------------------------------
def _lot(noise, shapes, std, dtype=torch.float32):
    out = [noise.add_(torch.zeros(s, dtype=dtype), std) for s in shapes]
    noise.ahead()
    return out


def test_drawn_ahead_is_bit_for_bit_the_sequential_stream():
    """Lots of small and chunked tensors (over CHUNK), then lots whose requests differ from the
    last (another std, fewer tensors, an empty lot, a sample() nobody planned, float64): the same
    calls give the same values with and without the worker, exactly (the same generator calls in
    the same order; a draw made ahead and not asked for is given back)."""
    shapes = [(70_000,), (60, 1000), (10,), (3, 5)]
    lots = [(shapes, 4.0)] * 3 + [(shapes, 2.0), (shapes[:2], 2.0), ([], 2.0), (shapes, 2.0)]
    lots += [([(5, 7)], 1.0), ([(5, 7)], 1.0), (shapes, 1.0)]
    runs = []
    for ahead in (False, True):
        noise = GaussianNoise(seed=11, ahead=ahead)
        got = []
        for i, (shapes_, std) in enumerate(lots):
            if i == 8:
                got.append(noise.sample((4,), 3.0, dtype=torch.float64))  # a request not planned
            got += _lot(noise, shapes_, std, torch.float64 if i == 9 else torch.float32)
        runs.append(got)
    assert len(runs[0]) == len(runs[1]) == 1 + sum(len(s_) for s_, _ in lots)
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # exact: the same draws


def test_drawn_ahead_keeps_the_checkpoint_at_the_draws_taken():
    """A state_dict taken while the next lot's noise waits on the worker is the state after the
    draws taken: resuming from it gives the stream the uninterrupted source gives, exactly."""
    shapes = [(70_000,), (10, 3)]
    ref = GaussianNoise(seed=5, ahead=False)
    want = [_lot(ref, shapes, 1.5) for _ in range(4)]
    a = GaussianNoise(seed=5, ahead=True)
    got = [_lot(a, shapes, 1.5) for _ in range(2)]  # lot 3's noise now drawn ahead
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = GaussianNoise(seed=0, ahead=True)
    b.load_state_dict(torch.load(buf))
    got += [_lot(b, shapes, 1.5) for _ in range(2)]
    assert all(torch.equal(x, y) for w, g in zip(want, got) for x, y in zip(w, g))  # exact
    two = GaussianNoise(seed=5, ahead=False)
    for _ in range(2):
        _lot(two, shapes, 1.5)
    # the generator seen from outside gives back what waits: the state after two lots, exactly
    assert torch.equal(a.generator.get_state(), two.generator.get_state())


def test_ahead_is_off_for_the_secure_source_and_by_environment(monkeypatch):
    from dpsgd.mechanism import noise as nz

    assert not GaussianNoise(secure=True, ahead=True).ahead_enabled
    monkeypatch.setenv("DPSGD_NOISE_AHEAD", "0")
    assert not nz.ahead_default() and not GaussianNoise(seed=1).ahead_enabled
    monkeypatch.setenv("DPSGD_NOISE_AHEAD", "1")
    assert nz.ahead_default()
