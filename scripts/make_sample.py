"""Regenerate ``captum_vit/data/sample.safetensors`` (first 128 FashionMNIST-Loc test examples)."""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from captum_vit.data import FashionMNISTLoc  # noqa: E402
from captum_vit.data.sample import SAMPLE_PATH  # noqa: E402

if __name__ == "__main__":
    a = FashionMNISTLoc("test", seed=0, n=128).arrays()
    save_file({"images": a["images"].contiguous(), "labels": a["labels"],
               "masks": a["masks"].to(__import__("torch").uint8), "boxes": a["boxes"],
               "indices": a["indices"]}, str(SAMPLE_PATH))
    print(f"wrote {SAMPLE_PATH}")
