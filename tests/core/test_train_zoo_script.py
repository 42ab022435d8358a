"""`scripts/train_zoo.py`: a seeded run is reproducible; warm start adds register tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import VisionTransformer

from tests.helpers import needs_fashion_mnist

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_zoo.py"


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


@pytest.mark.integration
@needs_fashion_mnist
def test_a_tiny_run_is_deterministic_and_writes_weights_and_card(tmp_path):
    args = ["--name", "tiny", "--embed-dim", "16", "--depth", "1", "--heads", "2",
            "--epochs", "2", "--train-n", "256", "--batch-size", "64", "--warmup-steps", "2",
            "--seed", "3"]
    for run in ("a", "b"):
        subprocess.run([sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path / run)],
                       check=True, capture_output=True)
    wa, wb = (load_file(str(tmp_path / r / "tiny.safetensors")) for r in ("a", "b"))
    assert wa.keys() == wb.keys()
    for k in wa:  # same seed, same weights, bit for bit
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    card = json.loads((tmp_path / "a" / "tiny.json").read_text())
    assert [c["epoch"] for c in card["learning_curve"]] == [1, 2]
    assert card["seed"] == 3 and card["device"] == "cpu" and card["init_from"] is None
    assert card["command"].startswith("python scripts/train_zoo.py --name tiny")
    assert 0 <= card["accuracy"]["fashionmnist_loc_test_10000"] <= 1
    # the card's kwargs rebuild the saved model exactly (strict load)
    VisionTransformer(**card["timm_kwargs"]).load_state_dict(wa)


@pytest.mark.integration
@needs_fashion_mnist
def test_two_processes_take_the_steps_of_one(tmp_path):
    """Under torchrun each process takes half of every batch and the gradients are
    averaged: the weights equal a one-process run's up to summation order."""
    args = ["--name", "tiny", "--embed-dim", "16", "--depth", "1", "--heads", "2",
            "--epochs", "1", "--train-n", "256", "--batch-size", "64", "--warmup-steps", "2",
            "--seed", "3", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path / "one")],
                   check=True, capture_output=True, env=env)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", str(SCRIPT), *args, "--out-dir", str(tmp_path / "two")],
                   check=True, capture_output=True, env=env)
    one, two = (load_file(str(tmp_path / r / "tiny.safetensors")) for r in ("one", "two"))
    assert one.keys() == two.keys()
    for k in one:  # float32 training: 4 steps of AdamW from the same start
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)
    c1, c2 = (json.loads((tmp_path / r / "tiny.json").read_text()) for r in ("one", "two"))
    assert c2["processes"] == 2 and c1["processes"] == 1
    assert c2["command"].startswith("torchrun --standalone --nproc_per_node=2 scripts/")
    assert abs(c1["accuracy"]["fashionmnist_loc_test_10000"]
               - c2["accuracy"]["fashionmnist_loc_test_10000"]) <= 0.002


def test_distillation_loss_is_the_weighted_sum_of_its_two_terms(train_zoo):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    y = torch.randint(0, 10, (6,), generator=g)
    hard = F.cross_entropy(s, y, label_smoothing=0.1)
    # KL(p_t || p_s) at temperature T, written out, times T^2
    T = 2.0
    pt, ps = (t / T).softmax(-1), (s / T).softmax(-1)
    soft = (pt * (pt.log() - ps.log())).sum(-1).mean() * T * T
    torch.testing.assert_close(train_zoo.distillation_loss(s, t, y, 0.0, T), hard)
    torch.testing.assert_close(train_zoo.distillation_loss(s, t, y, 0.3, T),
                               0.7 * hard + 0.3 * soft)
    # a student equal to its teacher pays no distillation term
    torch.testing.assert_close(train_zoo.distillation_loss(s, s, y, 1.0, T), torch.tensor(0.0),
                               atol=1e-6, rtol=0)


def test_load_teacher_reads_weights_and_card(train_zoo, tmp_path):
    torch.manual_seed(0)
    src = train_zoo.build_model(_kwargs(0))
    save_file({k: v.contiguous() for k, v in src.state_dict().items()},
              str(tmp_path / "t.safetensors"))
    (tmp_path / "t.json").write_text(json.dumps({"timm_kwargs": _kwargs(0)}))
    teacher = train_zoo.load_teacher(str(tmp_path / "t.safetensors"))
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(teacher(x), src.eval()(x))
