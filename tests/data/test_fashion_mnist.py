"""Fashion-MNIST reader, FashionMNIST-Loc and the shipped sample."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from captum_vit.data import (
    CLASS_NAMES,
    FashionMNISTLoc,
    build_arrays,
    load_fashion_mnist,
    load_sample,
    mask_to_box,
    read_idx,
)
from tests.helpers import needs_fashion_mnist


def _write_idx(path, arr: np.ndarray, compress: bool) -> None:
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    data = head + arr.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


@pytest.mark.parametrize("compress", [True, False])
def test_reader_parses_idx_files(tmp_path, compress):
    imgs = np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28)
    labels = np.array([4, 0, 9], dtype=np.uint8)
    suffix = ".gz" if compress else ""
    _write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", imgs, compress)
    _write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", labels, compress)
    x, y = load_fashion_mnist("test", root=tmp_path)
    assert torch.equal(x, torch.from_numpy(imgs)) and y.tolist() == [4, 0, 9]
    assert y.dtype == torch.int64


def test_reader_rejects_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(bytes([1, 2, 3, 4]) + b"\0" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + (10).to_bytes(4, "big") + b"\0" * 3)
    with pytest.raises(ValueError, match="truncated"):
        read_idx(short)


def test_missing_dataset_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("val", root=tmp_path)


@needs_fashion_mnist
def test_real_debian_files():
    x, y = load_fashion_mnist("test")
    assert x.shape == (10000, 28, 28) and x.dtype == torch.uint8
    assert y.shape == (10000,) and set(y.unique().tolist()) == set(range(10))


def _synthetic_split(n=40, seed=0):
    g = np.random.default_rng(seed)
    imgs = np.zeros((n, 28, 28), dtype=np.uint8)
    for i in range(n):  # a blob of random size at a random place: nonzero garment pixels
        y0, x0 = g.integers(0, 14, size=2)
        imgs[i, y0:y0 + 12, x0:x0 + 10] = g.integers(60, 256, size=(12, 10))
    return torch.from_numpy(imgs), torch.from_numpy(np.arange(n) % 10)


def test_loc_is_deterministic_and_order_independent():
    imgs, labels = _synthetic_split()
    a = build_arrays(imgs, labels, [3, 7, 11], split="test", seed=5)
    b = build_arrays(imgs, labels, [11, 3], split="test", seed=5)
    assert torch.equal(a["images"][0], b["images"][1])
    assert torch.equal(a["images"][2], b["images"][0])
    c = build_arrays(imgs, labels, [3, 7, 11], split="test", seed=6)
    assert not torch.equal(a["images"], c["images"])
    d = build_arrays(imgs, labels, [3, 7, 11], split="test", seed=5, epoch=1)
    assert not torch.equal(a["images"], d["images"])


def test_mask_matches_pasted_garment_and_box_is_tight():
    imgs, labels = _synthetic_split()
    a = build_arrays(imgs, labels, range(20), split="train", seed=0)
    for k in range(20):
        img, mask, box = a["images"][k], a["masks"][k], a["boxes"][k]
        garment = imgs[k]
        assert mask.sum() == (garment > 0).sum()
        # the canvas shows exactly the garment where the mask is true
        assert torch.equal(img[mask], garment[garment > 0])
        x0, y0, x1, y1 = box.tolist()
        assert mask[y0:y1, x0:x1].sum() == mask.sum()
        assert mask[y0].any() and mask[y1 - 1].any() and mask[:, x0].any() and mask[:, x1 - 1].any()
        assert mask.sum() < img.numel() / 3
    assert torch.equal(mask_to_box(a["masks"]), a["boxes"])


def test_loc_rejects_bad_parameters():
    imgs, labels = _synthetic_split()
    with pytest.raises(ValueError, match="canvas_size"):
        build_arrays(imgs, labels, [0], canvas_size=40)
    with pytest.raises(ValueError, match="clutter_intensity"):
        build_arrays(imgs, labels, [0], clutter_intensity=2.0)
    with pytest.raises(ValueError, match="split"):
        build_arrays(imgs, labels, [0], split="val")


@needs_fashion_mnist
def test_dataset_items_and_sample_agree_with_the_builder():
    ds = FashionMNISTLoc("test", seed=0, n=128)
    item = ds[5]
    assert item["image"].shape == (1, 56, 56) and item["mask"].shape == (56, 56)
    sample = load_sample()
    torch.testing.assert_close(sample["images"][5], item["image"])
    assert torch.equal(sample["masks"][5], item["mask"])
    assert torch.equal(sample["boxes"][5], item["box"]) and sample["labels"][5] == item["label"]


def test_sample_loads_without_the_dataset():
    s = load_sample()
    assert s["images"].shape == (128, 1, 56, 56) and s["images"].max() <= 1.0
    assert s["labels"].shape == (128,) and s["masks"].dtype == torch.bool
    assert torch.equal(mask_to_box(s["masks"]), s["boxes"])
    assert (s["masks"].flatten(1).float().mean(1) < 1 / 3).all()


# -- data specs and image reading (captum_vit.data.specs / images) ----------------------------
def _png(path, arr) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_read_image_grey_rgb_and_errors(tmp_path):
    from captum_vit.data import read_image

    grey = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    _png(tmp_path / "g.png", grey)
    x = read_image(tmp_path / "g.png")
    assert x.shape == (1, 3, 4) and x.dtype == torch.float32
    torch.testing.assert_close(x[0], torch.from_numpy(grey).float() / 255)
    rgba = np.zeros((5, 6, 4), np.uint8)
    rgba[..., 0] = 255
    _png(tmp_path / "c.png", rgba)
    y = read_image(tmp_path / "c.png")
    assert y.shape == (3, 5, 6) and float(y[0].min()) == 1.0 and float(y[1:].max()) == 0.0
    deep = np.full((2, 2), 65535, np.uint16)
    _png(tmp_path / "d.png", deep)
    assert float(read_image(tmp_path / "d.png").max()) == 1.0
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_image(tmp_path / "missing.png")
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match="not an image"):
        read_image(tmp_path / "text.png")


def test_conform_channels_and_size():
    from captum_vit.data import conform

    rgb = torch.rand(3, 20, 30)
    g = conform(rgb, 1, (20, 30))
    torch.testing.assert_close(g[0], 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2])
    assert conform(g, 3, (10, 15)).shape == (3, 10, 15)
    with pytest.raises(ValueError, match="channels"):
        conform(torch.rand(2, 4, 4), 3, (4, 4))


def test_match_class_names_ignores_case_and_punctuation():
    from captum_vit.data import match_class_names

    assert match_class_names(["t-shirt_top", "ANKLE BOOT", "dress"], CLASS_NAMES) == [0, 9, 3]
    with pytest.raises(ValueError, match=r"'hat'.*T-shirt/top, Trouser"):
        match_class_names(["dress", "hat"], CLASS_NAMES, what="class folder")
    assert match_class_names(["hat"], CLASS_NAMES, strict=False) == [-1]


def test_folder_spec_maps_class_folders_to_the_models_classes(tmp_path):
    from captum_vit.data import FolderImages, load_data, model_batch

    img = (np.random.default_rng(0).random((30, 20, 3)) * 255).astype(np.uint8)
    for name in ("sandal", "T-Shirt_Top", "trouser"):
        _png(tmp_path / name / "a.png", img)
    _png(tmp_path / "sandal" / "nested" / "b.jpg", img)
    (tmp_path / "sandal" / "notes.txt").write_text("not an image")
    folder = FolderImages(tmp_path)
    assert folder.classes == ("T-Shirt_Top", "sandal", "trouser") and len(folder) == 4
    shape = (1, (56, 56))
    data = load_data(f"folder:{tmp_path}", n=10, input_shape=shape, num_classes=10,
                     class_names=CLASS_NAMES, need_labels=True)
    assert [data[i].label for i in range(len(data))] == [0, 5, 5, 1]
    assert not data.has_masks
    x, labels, masks = model_batch(data, [0, 3], input_shape=shape, dtype=torch.float64)
    assert x.shape == (2, 1, 56, 56) and x.dtype == torch.float64 and masks is None
    assert labels.tolist() == [0, 1]
    # labels unknown: fine for the prediction, an error when they are needed
    free = load_data(f"folder:{tmp_path}", n=10, input_shape=shape, num_classes=10)
    assert {free[i].label for i in range(4)} == {-1}
    with pytest.raises(ValueError, match="--classes FILE.*--target predicted"):
        load_data(f"folder:{tmp_path}", n=10, input_shape=shape, num_classes=10,
                  need_labels=True)
    _png(tmp_path / "loose.png", img)
    with pytest.raises(ValueError, match="loose.png is not in a class sub-folder"):
        load_data(f"folder:{tmp_path}", n=10, input_shape=shape, num_classes=10,
                  class_names=CLASS_NAMES, need_labels=True)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_data(f"folder:{tmp_path / 'nope'}", n=1, input_shape=shape, num_classes=10)
    with pytest.raises(ValueError, match="unknown data 'imagenet'"):
        load_data("imagenet", n=1, input_shape=shape, num_classes=10)


def test_synthetic_and_sample_specs():
    from captum_vit.data import load_data, model_batch

    shape = (3, (32, 24))
    data = load_data("synthetic", n=5, seed=3, input_shape=shape, num_classes=4,
                     need_labels=True)
    assert len(data) == 5 and data.has_masks and data[4].label == 0
    assert data[2].image.shape == (3, 32, 24) and data[2].mask.shape == (32, 24)
    again = load_data("synthetic", n=9, seed=3, input_shape=shape, num_classes=4)
    assert torch.equal(again[2].image, data[2].image)
    x, labels, masks = model_batch(data, range(5), input_shape=(1, (16, 12)))
    assert x.shape == (5, 1, 16, 12) and masks.shape == (5, 16, 12) and masks.dtype == torch.bool
    assert labels.tolist() == [0, 1, 2, 3, 0]
    s = load_data("sample", n=300, input_shape=(1, (56, 56)), num_classes=10,
                  class_names=CLASS_NAMES, need_labels=True)
    assert len(s) == 128 and s.has_masks and s[5].label == int(load_sample()["labels"][5])
    with pytest.raises(ValueError, match="--classes FILE"):
        load_data("sample", n=3, input_shape=(1, (56, 56)), num_classes=10, need_labels=True)
