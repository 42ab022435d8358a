"""Benchmark loaders from local files in their exact on-disk layouts (SPEC_NEXT §9.2-§9.6):
ImageNet-Segmentation (HDF5 with object references), ImageNet validation (flat with the
devkit, class folders, VOC boxes), CIFAR-10/100 pickles, ImageNet-S PNG masks; the folder
class mapping, seeded subsets, the seeds' resizing and one evaluate run per loader."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from captum_vit.cli import main
from captum_vit.data import (
    CIFAR10,
    CIFAR100,
    ImageNetS,
    ImageNetSegmentation,
    ImageNetVal,
    load_data,
    match_class_names,
    model_wnids,
    seed_transforms,
    subset_indices,
)
from tests.data_files import (
    WNIDS,
    flat_val,
    id_png,
    jpeg,
    pickle_file,
    rgb,
    write_gtsegs,
)

h5py = pytest.importorskip("h5py")
SHAPE = (3, (32, 32))
RNG = np.random.default_rng(0)




def _as_uint8(image: torch.Tensor) -> np.ndarray:
    """A loader's float [C, H, W] image in [0, 1] back to uint8 H x W x C."""
    return (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def _evaluate(tmp_path, data: str, metric: str, *extra: str) -> dict:
    out = tmp_path / "out"
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", data, "--methods",
            "raw_attention", "--metrics", metric, "--n", "2", "--batch-size", "2",
            "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


# -- ImageNet-Segmentation: gtsegs_ijcv.mat (MATLAB v7.3 = HDF5) ---------------------------



def test_imagenet_segmentation_reads_images_and_masks_exactly(tmp_path):
    images = [rgb(20, 30), rgb(25, 16), rgb(12, 12)]
    masks = [RNG.random(im.shape[:2]) > 0.5 for im in images]
    path = tmp_path / "gtsegs_ijcv.mat"
    write_gtsegs(path, images, masks)
    ds = ImageNetSegmentation(path)
    assert len(ds) == 3 and ds.classes is None
    for i in range(3):
        image, label, mask = ds[i]
        assert label == -1 and image.shape == (3, *images[i].shape[:2])
        assert np.array_equal(_as_uint8(image), images[i])
        assert mask.dtype == torch.bool and np.array_equal(mask.numpy(), masks[i])
    again = pickle.loads(pickle.dumps(ds))  # an open HDF5 handle is not pickled
    assert torch.equal(again[2][0], ds[2][0])
    data = load_data(f"imagenet-seg:{path}", n=5, input_shape=SHAPE, num_classes=10)
    assert len(data) == 3 and data.has_masks and data[1].label == -1
    res = _evaluate(tmp_path, f"imagenet-seg:{path}", "segmentation")
    assert res["config"]["n"] == 2 and "raw_attention" in json.dumps(res["results"]).lower()


def test_imagenet_segmentation_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="put gtsegs_ijcv.mat"):
        ImageNetSegmentation(tmp_path / "gtsegs_ijcv.mat")
    bad = tmp_path / "bad.mat"
    bad.write_bytes(b"MATLAB 5.0 MAT-file, not HDF5")
    with pytest.raises(ValueError, match="not an HDF5 file"):
        ImageNetSegmentation(bad)
    wrong = tmp_path / "wrong.mat"
    with h5py.File(wrong, "w") as f:
        f.create_dataset("value/img", data=np.zeros((3, 1)))
    with pytest.raises(ValueError, match=r"wrong layout \(/value/img, /value/gt"):
        ImageNetSegmentation(wrong)


def test_seed_transforms_are_torchvision_resize_on_pil(tmp_path):
    img, mask = rgb(37, 53), RNG.random((37, 53)) > 0.5
    t = seed_transforms()  # tokentm_segmentation: Resize((224, 224)) bilinear, no crop
    want = np.asarray(Image.fromarray(img).resize((224, 224), Image.Resampling.BILINEAR))
    image = t.image(torch.from_numpy(img).permute(2, 0, 1).float() / 255)
    assert np.array_equal(_as_uint8(image), want)
    want_mask = np.asarray(Image.fromarray(mask.astype(np.uint8)).resize(
        (224, 224), Image.Resampling.NEAREST)) > 0
    assert np.array_equal(t.mask(torch.from_numpy(mask)).numpy(), want_mask)
    assert t.preprocess.size == (224, 224) and t.preprocess.mean == (0.5,)
    torch.testing.assert_close(t.preprocess(image), (image - 0.5) / 0.5)
    crop = seed_transforms(64, crop=48)  # Resize(64) -> CenterCrop(48)
    big = np.asarray(Image.fromarray(img).resize((91, 64), Image.Resampling.BILINEAR))
    out = crop.image(torch.from_numpy(img).permute(2, 0, 1).float() / 255)
    assert np.array_equal(_as_uint8(out), big[8:56, 22:70])
    assert crop.mask(torch.from_numpy(mask)).shape == (48, 48)
    with pytest.raises(ValueError, match="shorter side"):
        seed_transforms(256)


# -- ImageNet validation: flat folder + devkit, class folders, boxes -------------------------







@pytest.mark.parametrize("meta", ["mat", "text"])
def test_imagenet_val_flat_with_devkit(tmp_path, meta):
    val, decoded = flat_val(tmp_path, meta)
    ds = ImageNetVal(val)
    assert len(ds) == 3 and ds.classes == WNIDS
    assert [ds[i][1] for i in range(3)] == [999, 1, 999]  # images 1, 2, 4 -> IDs 1, 3, 1
    for i in range(3):
        assert np.array_equal(_as_uint8(ds[i][0]), decoded[i])
    box = ds[1][2]  # the box of the image's class; the other object's is left out
    assert box.shape == (22, 24) and box.sum() == 8 * 5 and bool(box[3:8, 2:10].all())
    (val / "ILSVRC2012_val_00000001.xml").unlink()
    assert ds[0][2] is None
    # model classes: unknown 1000-class head = sorted WNIDs; named models by WNID or name
    data = load_data(f"imagenet-val:{val}", input_shape=SHAPE, num_classes=1000,
                     need_labels=True)
    assert [data[i].label for i in range(3)] == [999, 1, 999]
    names = ["goldfish, Carassius auratus", "toilet tissue, toilet paper, bathroom tissue"]
    data = load_data(f"imagenet-val:{val}", input_shape=SHAPE, num_classes=2,
                     class_names=names, need_labels=True)
    assert [data[i].label for i in range(3)] == [1, 0, 1]
    data = load_data(f"imagenet-val:{val}", input_shape=SHAPE, num_classes=2,
                     class_names=[WNIDS[999], WNIDS[1]], need_labels=True)
    assert [data[i].label for i in range(3)] == [0, 1, 0]


def test_imagenet_val_class_folders_and_errors(tmp_path):
    val = tmp_path / "val"
    d0 = jpeg(val / WNIDS[5] / "a.JPEG", rgb(10, 12))
    d1 = jpeg(val / WNIDS[2] / "b.JPEG", rgb(11, 9))
    ds = ImageNetVal(val)
    assert [ds[i][1] for i in range(2)] == [2, 5]
    assert np.array_equal(_as_uint8(ds[0][0]), d1) and np.array_equal(_as_uint8(ds[1][0]), d0)
    res = _evaluate(tmp_path, f"imagenet-val:{val}", "sparseness")
    assert res["config"]["data"] == f"imagenet-val:{val}"
    (val / "cats").mkdir()
    with pytest.raises(ValueError, match=r"WNIDs \(cats are not\)"):
        ImageNetVal(val)
    with pytest.raises(FileNotFoundError, match="put the validation images"):
        ImageNetVal(tmp_path / "missing")
    flat = tmp_path / "flat"
    jpeg(flat / "ILSVRC2012_val_00000001.JPEG", rgb(8, 8))
    with pytest.raises(FileNotFoundError, match="ILSVRC2012_validation_ground_truth.txt"):
        ImageNetVal(flat)


def test_flat_val_end_to_end_with_a_subset(tmp_path):
    val, _ = flat_val(tmp_path)
    res = _evaluate(tmp_path, f"imagenet-val:{val}", "pointing_game", "--subset", "2",
                    "--subset-seed", "3")
    cfg = res["config"]
    assert cfg["subset"] == 2 and cfg["subset_seed"] == 3
    assert cfg["indices"] == subset_indices(3, 2, seed=3) and cfg["n"] == 2


# -- CIFAR python version -------------------------------------------------------------------



def test_cifar10_and_cifar100_batches(tmp_path):
    x10 = RNG.integers(0, 256, (4, 3072), dtype=np.uint8)
    root = tmp_path / "cifar-10-batches-py"
    names10 = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog",
               b"horse", b"ship", b"truck"]
    pickle_file(root / "test_batch", {b"data": x10, b"labels": [3, 8, 0, 9],
                                  b"filenames": [b"a.png"] * 4, b"batch_label": b"test"})
    pickle_file(root / "batches.meta", {b"label_names": names10, b"num_vis": 3072})
    for split in ("test",):
        ds = CIFAR10(tmp_path, split=split)  # the parent of cifar-10-batches-py works too
    assert len(ds) == 4 and ds.classes[3] == "cat" and [ds[i][1] for i in range(4)] == [3, 8,
                                                                                          0, 9]
    for i in range(4):  # 1024 R, 1024 G, 1024 B, each 32 x 32 row-major
        assert torch.equal((ds[i][0] * 255).round().to(torch.uint8),
                           torch.from_numpy(x10[i].reshape(3, 32, 32)))
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        CIFAR10(root, split="train")
    with pytest.raises(ValueError, match="split"):
        CIFAR10(root, split="val")
    names = [n.decode() for n in names10]
    data = load_data(f"cifar10:{root}", input_shape=SHAPE, num_classes=10, class_names=names,
                     need_labels=True)
    assert [data[i].label for i in range(4)] == [3, 8, 0, 9]
    classes = tmp_path / "classes.txt"
    classes.write_text("\n".join(names))
    res = _evaluate(tmp_path, f"cifar10:{root}", "sparseness", "--classes", str(classes),
                    "--target", "label")
    assert res["config"]["target"] == "label"

    x100 = RNG.integers(0, 256, (3, 3072), dtype=np.uint8)
    root100 = tmp_path / "cifar-100-python"
    pickle_file(root100 / "test", {b"data": x100, b"fine_labels": [99, 0, 42],
                               b"coarse_labels": [1, 2, 3], b"filenames": [b"x"] * 3})
    pickle_file(root100 / "meta", {b"fine_label_names": [f"c{i}".encode() for i in range(100)],
                               b"coarse_label_names": [b"s"] * 20})
    ds = CIFAR100(root100)
    assert [ds[i][1] for i in range(3)] == [99, 0, 42] and ds.classes[42] == "c42"
    assert torch.equal((ds[2][0] * 255).round().to(torch.uint8),
                       torch.from_numpy(x100[2].reshape(3, 32, 32)))
    _evaluate(tmp_path, f"cifar100:{root100}", "sparseness")
    (root100 / "test").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a CIFAR python-version pickle"):
        CIFAR100(root100)


# -- ImageNet-S ---------------------------------------------------------------------------



def test_imagenet_s_masks_of_the_main_class(tmp_path):
    root = tmp_path / "ImageNetS919"
    cats = WNIDS[:300]
    root.mkdir()
    (root / "ImageNetS_categories_im919.txt").write_text("\n".join(cats) + "\n")
    ids = [np.zeros((10, 10), np.int64) for _ in range(3)]
    ids[0][:4] = 300          # 40 %: id 300 (R = 44, G = 1)
    ids[0][4:7] = 2           # 30 %
    ids[0][7:] = 1000         # ignored
    ids[1][:, :6] = 7         # 60 %
    ids[1][0, 9] = 300        # 1 %: below 5 %
    ids[2][0, :4] = 5         # 4 %: no target
    images = []
    for k, m in enumerate(ids):
        w = cats[k]
        id_png(root / "validation-segmentation" / w / f"ILSVRC2012_val_{k:08d}.png", m)
        images.append(jpeg(root / "validation" / w / f"ILSVRC2012_val_{k:08d}.JPEG",
                            rgb(10, 10)))
    ds = ImageNetS(root)
    assert len(ds) == 3 and ds.classes == cats
    assert [ds[i][1] for i in range(3)] == [299, 6, -1]
    for i in range(3):
        image, label, mask = ds[i]
        assert np.array_equal(_as_uint8(image), images[i])
        want = ids[i] == label + 1 if label >= 0 else np.zeros((10, 10), bool)
        assert np.array_equal(mask.numpy(), want)
    assert ds.class_ids(0)[0, 0] == 300
    data = load_data(f"imagenet-s:{root}", input_shape=SHAPE, num_classes=1000,
                     need_labels=True)
    assert [data[i].label for i in range(3)] == [299, 6, -1] and data.has_masks
    _evaluate(tmp_path, f"imagenet-s:{root}", "segmentation")
    (root / "ImageNetS_categories_im919.txt").unlink()
    with pytest.raises(FileNotFoundError, match="ImageNetS_categories_im919.txt"):
        ImageNetS(root)


# -- folder: class mapping (SPEC_NEXT §9.5) and subsets -------------------------------------

def _folders(root, names) -> None:
    for n in names:
        jpeg(root / n / "a.jpg", rgb(8, 8))


def test_folder_class_map_ambiguity_and_unmatched(tmp_path):
    _folders(tmp_path / "d", ["kitty", "crane", "tench"])
    spec = f"folder:{tmp_path / 'd'}"
    model = ["tench, Tinca tinca", "crane", "crane", "kitty"]
    with pytest.raises(ValueError, match=r"'crane' \('crane', 'crane'\) matches several"):
        load_data(spec, input_shape=SHAPE, num_classes=4, class_names=model, need_labels=True)
    free = load_data(spec, input_shape=SHAPE, num_classes=4, class_names=model)
    assert [free[i].label for i in range(3)] == [-1, 3, 0]  # crane ambiguous, tench synonym
    cmap = tmp_path / "map.json"
    cmap.write_text(json.dumps({"kitty": 3, "crane": 2, "tench": 0}))
    data = load_data(spec, input_shape=SHAPE, num_classes=4, class_names=model,
                     need_labels=True, class_map=cmap)
    assert [data[i].label for i in range(3)] == [2, 3, 0]
    with pytest.raises(ValueError, match="'tench' not in the map"):
        load_data(spec, input_shape=SHAPE, num_classes=4, need_labels=True,
                  class_map={"kitty": 3, "crane": 2})
    with pytest.raises(ValueError, match=r"not classes of the model \(0 .. 3\)"):
        load_data(spec, input_shape=SHAPE, num_classes=4, class_map={"kitty": 4})
    _folders(tmp_path / "d", ["zebra"])
    with pytest.raises(ValueError, match="class folder 'zebra' matches no class"):
        load_data(spec, input_shape=SHAPE, num_classes=4, class_names=model,
                  need_labels=True, class_map=None)
    assert match_class_names(["tench"], model) == [0]
    # folders named by WNIDs map through the model's WNIDs (timm ImageNet heads)
    _folders(tmp_path / "w", [WNIDS[7], WNIDS[3]])
    w = load_data(f"folder:{tmp_path / 'w'}", input_shape=SHAPE, num_classes=1000,
                  class_names=model_wnids(None, 1000), need_labels=True)
    assert [w[i].label for i in range(2)] == [3, 7]
    import timm

    from captum_vit.models import timm_class_names

    names = timm_class_names(timm.create_model("vit_tiny_patch16_224"))
    assert names[0] == "tench, Tinca tinca" and model_wnids(names, 1000) == WNIDS
    w = load_data(f"folder:{tmp_path / 'w'}", input_shape=SHAPE, num_classes=1000,
                  class_names=names, need_labels=True)
    assert [w[i].label for i in range(2)] == [3, 7]


def test_subset_is_seeded_and_saved(tmp_path):
    a, b = subset_indices(100, 10, seed=4), subset_indices(100, 10, seed=4)
    assert a == b and len(set(a)) == 10 and a != subset_indices(100, 10, seed=5)
    assert subset_indices(100, 4, seed=4) == a[:4]
    with pytest.raises(ValueError, match="--subset"):
        subset_indices(5, 6)
    data = load_data("synthetic", n=20, input_shape=SHAPE, num_classes=10, subset=5,
                     subset_seed=1)
    assert data.indices == subset_indices(20, 5, seed=1) and len(data) == 5
    full = load_data("synthetic", n=20, input_shape=SHAPE, num_classes=10)
    assert torch.equal(data[2].image, full[data.indices[2]].image)
    first = load_data("synthetic", n=20, input_shape=SHAPE, num_classes=10, subset=5,
                      subset_seed=1)
    assert first.indices == data.indices
