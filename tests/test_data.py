"""Fashion-MNIST reader, FashionMNIST-Loc and the shipped sample."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from captum_vit.data import (
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
