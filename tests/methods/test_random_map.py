"""RandomMap, the chance-level baseline: seeded per example (batch invariant), and usable
through Captum's interfaces."""

from __future__ import annotations

import pytest
import torch
from captum.attr import NoiseTunnel

from captum_vit.methods import RandomMap
from tests.helpers import assert_unchanged, make_inputs, make_model, snapshot


def test_random_map_is_seeded_and_batch_invariant():
    model, x = make_model("vit"), make_inputs("vit", 3)
    before = snapshot(model)
    rnd = RandomMap(model, seed=3)
    a = rnd.attribute(x, output="tokens")
    assert torch.equal(a, RandomMap(model, seed=3).attribute(x, output="tokens"))
    assert torch.equal(a[1:2], rnd.attribute(x[1:2], output="tokens"))
    assert not torch.equal(a, RandomMap(model, seed=4).attribute(x, output="tokens"))
    assert rnd.attribute(x).shape == x.shape
    assert_unchanged(model, before)


def test_random_map_captum_interop():
    from captum.metrics import sensitivity_max

    model, x = make_model("vit"), make_inputs("vit", 2)
    before = snapshot(model)
    nt = NoiseTunnel(RandomMap(model)).attribute(x, nt_type="smoothgrad", nt_samples=2,
                                                 stdevs=0.1, target=[0, 1])
    assert nt.shape == x.shape
    sens = sensitivity_max(RandomMap(model).attribute, x, target=[0, 1], n_perturb_samples=2)
    assert sens.shape == (2,)
    with pytest.raises(ValueError, match="channels"):
        RandomMap(model).attribute(x[:, :1])
    assert_unchanged(model, before)
