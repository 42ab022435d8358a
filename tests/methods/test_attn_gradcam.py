"""AttnGradCAM (SPEC §1.5, Chefer et al.'s Grad-CAM baseline): on an
attention-pool head (timm ``global_pool='map'``) it runs on the pool's attention, checked
against a slow float64 reference from its definition (the pool's attention and gradient
kept by hand through timm's own modules: the reference of tests/methods/test_vanilla.py),
and a batch gives each image's map alone. The class-token and average-pooling readouts are
checked against the reference of tests/methods/test_attention_methods.py."""

from __future__ import annotations

import pytest
import torch

from captum_vit import AttnGradCAM
from tests.helpers import make_inputs, make_model
from tests.methods.test_vanilla import Reference


def test_attention_pool_head_uses_the_pools_attention():
    """m = ReLU(mean_h w_h A_p^h[0, :]) with w_h = mean over patches of ∇A_p^h[0, j]."""
    model, x = make_model("map"), make_inputs("map", batch=2)
    target = torch.tensor([4, 4])  # a class whose map is not all zero after the ReLU
    ref = Reference(model)
    ref.run(x, target)
    a, g = ref.pool_attn.detach()[:, :, 0], ref.pool_attn.grad[:, :, 0]  # [B, H, N]
    k = model.num_prefix_tokens
    heads = torch.zeros(a.shape[0], a.shape[1], a.shape[-1] - k, dtype=torch.float64)
    for b in range(a.shape[0]):
        for h in range(a.shape[1]):
            heads[b, h] = (g[b, h, k:].mean() * a[b, h])[k:]
    want = torch.relu(heads.mean(1))
    got = AttnGradCAM(model).attribute(x, target, output="tokens")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (want.abs().amax(1) > 0).all()
    per_head = AttnGradCAM(model).attribute(x, target, heads="all", output="tokens")
    torch.testing.assert_close(per_head, heads, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["vit", "registers", "avgpool", "map"])
def test_batch_equals_images_one_by_one(family):
    model, x = make_model(family), make_inputs(family, batch=3)
    target = torch.tensor([1, 4, 0])
    method = AttnGradCAM(model)
    batch = method.attribute(x, target, output="tokens")
    alone = torch.cat([method.attribute(x[i:i + 1], target[i:i + 1], output="tokens")
                       for i in range(3)])
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-12)
