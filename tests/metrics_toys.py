"""Toy models and data shared by the metrics tests."""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Obsolete: tests/conftest.py sets torch's thread count once per session
    (``CAPTUM_VIT_TEST_THREADS`` / ``--threads``, default 1). Kept so that a module which
    still imports it works; it leaves the count as configured."""
    yield


def linear_toy(seed: int = 0) -> nn.Module:
    """A real timm ViT (1×16×16, patch 4, 2 classes) whose logits are linear in the patches.

    No class token, average pooling, zero positional embedding and patch-embedding bias,
    both residual branches zeroed (blocks are the identity) and no final norm, so with a
    black (zero) baseline ``logits = b + (1/P) sum_j W e_j`` where ``e_j`` is patch j's
    embedding: each patch adds a fixed amount to each logit.
    """
    torch.manual_seed(seed)
    m = VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=6, depth=1,
                          num_heads=2, mlp_ratio=1.0, num_classes=2, class_token=False,
                          global_pool="avg").double().eval()
    with torch.no_grad():
        m.pos_embed.zero_()
        m.patch_embed.proj.bias.zero_()
        for p in (m.blocks[0].attn.proj, m.blocks[0].mlp.fc2):
            p.weight.zero_()
            p.bias.zero_()
        m.head.weight.normal_(generator=torch.Generator().manual_seed(seed))
    m.fc_norm = nn.Identity()
    m.norm = nn.Identity()
    return m


def toy_contributions(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-patch contribution [B, P, classes] to the logits, by explicit loops."""
    w = model.patch_embed.proj.weight  # [D, 1, 4, 4]
    b, _, h, ww = x.shape
    out = torch.zeros(b, (h // 4) * (ww // 4), model.head.weight.shape[0], dtype=x.dtype)
    for i in range(b):
        for r in range(h // 4):
            for c in range(ww // 4):
                e = (w[:, 0] * x[i, 0, 4 * r:4 * r + 4, 4 * c:4 * c + 4]).sum((1, 2))
                out[i, r * (ww // 4) + c] = model.head.weight @ e / out.shape[1]
    return out


def toy_inputs(batch: int = 4, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 16, 16, generator=g, dtype=torch.float64)
