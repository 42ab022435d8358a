"""`scripts/train_zoo.py`'s warm start: adding register tokens to a trained model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_zoo.py"


@pytest.fixture(scope="module")
def train_zoo():
    spec = importlib.util.spec_from_file_location("train_zoo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kwargs(reg: int) -> dict:
    return dict(img_size=28, patch_size=7, in_chans=1, num_classes=3, embed_dim=16, depth=2,
                num_heads=2, mlp_ratio=2.0, reg_tokens=reg, qkv_bias=True)


def test_init_from_copies_weights_and_seeds_new_registers_from_the_class_token(train_zoo, tmp_path):
    torch.manual_seed(0)
    src = train_zoo.build_model(_kwargs(0))
    path = tmp_path / "src.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    dst = train_zoo.build_model(_kwargs(2))
    changed = train_zoo.init_from(dst, str(path))
    assert sorted(changed) == ["pos_embed", "reg_token"]
    s, d = src.state_dict(), dst.state_dict()
    for name in s:
        if name != "pos_embed":
            torch.testing.assert_close(d[name], s[name], rtol=0, atol=0)
    # timm's prefix order is [cls, reg, reg, patches]
    pe_s, pe_d = s["pos_embed"], d["pos_embed"]
    assert pe_d.shape[1] == pe_s.shape[1] + 2
    torch.testing.assert_close(pe_d[:, :1], pe_s[:, :1], rtol=0, atol=0)
    torch.testing.assert_close(pe_d[:, 1:3], pe_s[:, :1].expand(-1, 2, -1), rtol=0, atol=0)
    torch.testing.assert_close(pe_d[:, 3:], pe_s[:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(d["reg_token"], s["cls_token"].expand(-1, 2, -1), rtol=0, atol=0)


def test_init_from_refuses_a_source_it_cannot_map(train_zoo, tmp_path):
    src = train_zoo.build_model(_kwargs(0))
    path = tmp_path / "src.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    wider = dict(_kwargs(0), embed_dim=32)
    with pytest.raises(ValueError, match="cannot map tensor"):
        train_zoo.init_from(train_zoo.build_model(wider), str(path))
