"""Writers of tiny benchmark data sets in their exact on-disk layouts (SPEC_NEXT §9.2-§9.6),
shared by the loader tests and the protocol presets' end-to-end tests."""

from __future__ import annotations

import pickle

import numpy as np
from PIL import Image

from captum_vit.data import imagenet_wnids

RNG = np.random.default_rng(0)
WNIDS = imagenet_wnids()
ID_WNID = {1: WNIDS[999], 2: WNIDS[0], 3: WNIDS[1]}  # ILSVRC2012_ID order != sorted order


def rgb(h: int, w: int) -> np.ndarray:
    return RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)
def jpeg(path, img) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img).save(path, "JPEG")
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))  # what the decoder gives back
def pickle_file(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj))
def id_png(path, ids: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rgb = np.stack([ids % 256, ids // 256, np.zeros_like(ids)], -1).astype(np.uint8)
    Image.fromarray(rgb).save(path)
def write_gtsegs(path, images, masks) -> None:
    """The layout of gtsegs_ijcv.mat: /value/img and /value/gt are [n, 1] object references;
    images stored (3, W, H), each gt a (1, 1) cell referencing the mask stored (W, H)."""
    import h5py

    with h5py.File(path, "w") as f:
        refs = f.create_group("#refs#")
        img_refs, gt_refs = [], []
        for i, (img, m) in enumerate(zip(images, masks, strict=True)):
            img_refs.append(refs.create_dataset(f"img{i}", data=img.transpose(2, 1, 0)).ref)
            mask = refs.create_dataset(f"mask{i}", data=m.astype(np.uint8).T)
            cell = refs.create_dataset(f"cell{i}", (1, 1), dtype=h5py.ref_dtype)
            cell[0, 0] = mask.ref
            gt_refs.append(cell.ref)
        value = f.create_group("value")
        for name, r in (("img", img_refs), ("gt", gt_refs)):
            d = value.create_dataset(name, (len(r), 1), dtype=h5py.ref_dtype)
            for i, ref in enumerate(r):
                d[i, 0] = ref
def flat_val(tmp_path, meta: str = "mat"):
    val = tmp_path / "val"
    decoded = [jpeg(val / f"ILSVRC2012_val_{k:08d}.JPEG", rgb(20 + k, 24)) for k in (1, 2, 4)]
    data = tmp_path / "ILSVRC2012_devkit_t12" / "data"
    data.mkdir(parents=True)
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text("1\n3\n2\n1\n")
    if meta == "mat":
        from scipy.io import savemat

        rec = np.zeros(4, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"),
                                 ("num_children", "O")])
        for j, (i, w) in enumerate([*ID_WNID.items(), (1001, "n00001740")]):
            rec[j] = (i, w, "words", 0 if i <= 1000 else 3)
        savemat(data / "meta.mat", {"synsets": rec})
    else:
        (data / "synsets.txt").write_text("".join(f"{w} words\n" for w in ID_WNID.values()))
    for k, wnid in ((1, ID_WNID[1]), (2, ID_WNID[3]), (4, ID_WNID[1])):  # PASCAL VOC boxes
        other = "<object><name>n00000000</name><bndbox><xmin>0</xmin><ymin>0</ymin><xmax>1"\
                "</xmax><ymax>1</ymax></bndbox></object>"
        (val / f"ILSVRC2012_val_{k:08d}.xml").write_text(
            f"<annotation><size><width>24</width><height>{20 + k}</height></size><object>"
            f"<name>{wnid}</name><bndbox><xmin>2</xmin><ymin>3</ymin><xmax>10</xmax>"
            f"<ymax>8</ymax></bndbox></object>{other}</annotation>")
    return val, decoded


def write_cifar10(root, n: int = 4):
    """A CIFAR-10 python-version test split of ``n`` images in ``root/cifar-10-batches-py``;
    returns the folder and the class names."""
    folder = root / "cifar-10-batches-py"
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse",
             b"ship", b"truck"]
    pickle_file(folder / "test_batch", {
        b"data": RNG.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"labels": [i % 10 for i in range(n)], b"filenames": [b"x.png"] * n})
    pickle_file(folder / "batches.meta", {b"label_names": names})
    return folder, [x.decode() for x in names]


def write_imagenet_s(root, n: int = 3):
    """An ImageNet-S919 validation split of ``n`` 16 x 16 images whose class ``k`` (WNID
    ``WNIDS[k]``, id ``k + 1``) covers the left half; returns the folder."""
    folder = root / "ImageNetS919"
    folder.mkdir(parents=True)
    (folder / "ImageNetS_categories_im919.txt").write_text("\n".join(WNIDS[:n]) + "\n")
    for k in range(n):
        ids = np.zeros((16, 16), np.int64)
        ids[:, :8] = k + 1
        id_png(folder / "validation-segmentation" / WNIDS[k] / f"ILSVRC2012_val_{k:08d}.png",
               ids)
        jpeg(folder / "validation" / WNIDS[k] / f"ILSVRC2012_val_{k:08d}.JPEG", rgb(16, 16))
    return folder
