"""captum_vit.models: the model specs zoo:, timm:, file:, random: and the card reader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from captum_vit import zoo
from captum_vit.data import CLASS_NAMES
from captum_vit.models import (
    RANDOM_MODELS,
    Preprocess,
    load_model,
    read_card,
    read_class_names,
)
from tests.helpers import assert_unchanged, snapshot

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions

KWARGS = dict(img_size=(16, 24), patch_size=8, in_chans=3, embed_dim=16, depth=1, num_heads=2,
              num_classes=3)


def _save(tmp_path, card: dict, name: str = "m") -> str:
    torch.manual_seed(0)
    model = VisionTransformer(**card.get("timm_kwargs", card.get("kwargs")))
    save_file(model.state_dict(), str(tmp_path / f"{name}.safetensors"))
    (tmp_path / f"{name}.json").write_text(json.dumps(card))
    return f"file:{tmp_path / f'{name}.safetensors'}"


def test_zoo_spec_gives_model_preprocessing_and_class_names():
    lm = load_model("zoo:vit_fmnist_loc")
    zm = zoo.load("vit_fmnist_loc")
    assert lm.class_names == CLASS_NAMES and not lm.random_weights and lm.card == zm.card
    assert lm.input_shape == (1, (56, 56)) and lm.num_classes == 10
    img = torch.rand(3, 70, 90)
    torch.testing.assert_close(lm.preprocess(img), zm.preprocess(img))
    assert lm.preprocess == Preprocess(1, (56, 56), (0.1,), (0.25,))


def test_file_spec_reads_the_zoo_card_format(tmp_path):
    card = {"timm_kwargs": KWARGS, "normalization": {"mean": [0.5, 0.4, 0.3], "std": [0.2]},
            "class_names": ["cat", "dog", "bird"], "accuracy": {"x": 0.5}}
    lm = load_model(_save(tmp_path, card))
    assert lm.class_names == ("cat", "dog", "bird") and lm.card["accuracy"] == {"x": 0.5}
    assert lm.input_shape == (3, (16, 24)) and not lm.model.training
    x = lm.preprocess(torch.full((1, 32, 48), 0.5))  # grey, twice the size
    assert x.shape == (3, 16, 24)
    torch.testing.assert_close(x[:, 0, 0], torch.tensor([0.0, 0.5, 1.0]))
    # the zoo's own card and weights, copied: the same model through the same reader
    for suffix in ("json", "safetensors"):
        shutil.copy(zoo.ZOO_DIR / f"vit_fmnist_loc.{suffix}", tmp_path / f"copy.{suffix}")
    copy = load_model(f"file:{tmp_path / 'copy.safetensors'}", class_names=CLASS_NAMES)
    zm = zoo.load("vit_fmnist_loc")
    x = torch.rand(2, 1, 56, 56)
    torch.testing.assert_close(copy.model(x), zm.model(x), rtol=0, atol=0)
    assert copy.preprocess == zm.preprocess


def test_file_spec_accepts_the_old_kwargs_file_and_reports_missing_files(tmp_path):
    spec = _save(tmp_path, {"kwargs": KWARGS})
    lm = load_model(spec)
    assert lm.class_names is None and lm.preprocess.mean is None
    assert read_card(tmp_path / "m.json")["timm_kwargs"] == json.loads(json.dumps(KWARGS))
    (tmp_path / "m.json").unlink()
    with pytest.raises(FileNotFoundError, match="m.json"):
        load_model(spec)
    with pytest.raises(ValueError, match=".safetensors"):
        load_model(f"file:{tmp_path / 'm.pt'}")
    (tmp_path / "bad.json").write_text(json.dumps({"timm_kwargs": KWARGS,
                                                   "architecture": "ResNet"}))
    with pytest.raises(ValueError, match="not supported"):
        read_card(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="timm_kwargs"):
        read_card(tmp_path / "bad.json")


def test_random_and_timm_specs_are_seeded_and_leave_the_global_rng(tmp_path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b = load_model("random:vit_tiny", seed=1), load_model("random:vit_tiny", seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.model.head.weight, b.model.head.weight) and a.random_weights
    assert not torch.equal(a.model.head.weight,
                           load_model("random:vit_tiny", seed=2).model.head.weight)
    assert a.input_shape == (3, (32, 32)) and a.class_names is None
    assert a.preprocess.mean is None  # no normalisation: conversion to the input only
    assert set(RANDOM_MODELS) == {"vit_tiny", "vit_small"}
    t = load_model("timm:vit_tiny_patch16_224", seed=0)
    assert t.random_weights and t.preprocess.size == (224, 224) and len(t.preprocess.mean) == 3


def test_class_names_from_a_file_for_any_model(tmp_path):
    names = tmp_path / "classes.txt"
    names.write_text("\n".join(f"thing {i}" for i in range(10)) + "\n\n")
    assert read_class_names(names)[9] == "thing 9"
    lm = load_model("random:vit_tiny", class_names=names)
    assert lm.class_names == tuple(f"thing {i}" for i in range(10))
    assert load_model("zoo:vit_fmnist_loc", class_names=str(names)).class_names[0] == "thing 0"
    names.write_text("a\nb\n")
    with pytest.raises(ValueError, match="2 class names for a model with 10 classes"):
        load_model("random:vit_tiny", class_names=names)
    names.write_text("\n")
    with pytest.raises(ValueError, match="names no class"):
        read_class_names(names)
    with pytest.raises(FileNotFoundError, match="one class name per line"):
        read_class_names(tmp_path / "missing.txt")


def test_bad_specs_say_what_is_accepted():
    with pytest.raises(ValueError, match="unknown model 'bogus:x'; use zoo:NAME"):
        load_model("bogus:x")
    with pytest.raises(ValueError, match="unknown random model"):
        load_model("random:vit_huge")
    with pytest.raises(ValueError, match="--pretrained applies to --model timm"):
        load_model("random:vit_tiny", pretrained=True)
    with pytest.raises(ValueError, match="unknown zoo model"):
        load_model("zoo:nope")
    with pytest.raises(ValueError, match="no_such_vit"):
        load_model("timm:no_such_vit")


def test_loading_never_changes_a_bundled_model():
    lm = load_model("zoo:vit_fmnist_loc")
    before = snapshot(lm.model)
    lm.preprocess(torch.rand(56, 56))
    _ = lm.input_shape, lm.num_classes
    assert_unchanged(lm.model, before)
