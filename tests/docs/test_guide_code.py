"""The Python code of the user guide's method pages, "Which method should I use", the
recipes and the model families runs, so that it cannot rot; the families page's random
SAM, PaliGemma and DPT give maps that are not numerically zero.

Convention (for whoever writes these pages):

- Every fenced ```` ```python ```` block of a page is executed, in page order, in ONE
  namespace per page (like a notebook: a later block may use what an earlier one defined),
  with the working directory a fresh temporary folder that holds ``photo.jpg`` (an RGB
  photo-sized JPEG made from a bundled sample image), matplotlib on its ``Agg`` backend.
  A block that raises fails the page's test.
- A block whose first line is ``# needs a download`` (followed by what it downloads) is
  NOT run by the page's test: it needs the internet or a model hub (pretrained weights of
  a Hugging Face processor, say). Say in the text what the block needs. The recipes' Hugging
  Face block is run by a test of its own, against a tiny random model saved under the hub
  name it loads.
- A block whose first line is ``# downloads: pretrained=True`` runs with every
  ``pretrained=True`` replaced by ``pretrained=False``: the same architecture and
  preprocessing with random weights, so the code path is checked offline.
- Other fence languages (``bash``, ``text``, ...) are not run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "docs" / "source"
PAGES = sorted([*(SOURCE / "guide" / "methods").glob("*.md"),
                SOURCE / "guide" / "choosing.md", SOURCE / "guide" / "recipes.md",
                SOURCE / "guide" / "families.md", SOURCE / "guide" / "naflex.md"])
NEEDS = {"families.md": ("transformers",), "naflex.md": ("transformers",)}
"""Libraries a page's code needs beyond the core dependencies (skipped without them)."""
_NAMESPACES: dict[str, dict] = {}
"""The namespace each page's code left (``test_page_code_runs``), for the checks of what
it computed."""
SKIP_MARK = "# needs a download"
OFFLINE_MARK = "# downloads: pretrained=True"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def python_blocks(text: str) -> list[str]:
    """The ```` ```python ```` blocks of a Markdown page, in order."""
    return [m.group(1) for m in _FENCE.finditer(text)]


def runnable(block: str) -> str | None:
    """The code to run for ``block``: ``None`` for a block marked as needing a download,
    the offline variant of a ``pretrained=True`` block, otherwise the block itself."""
    first = block.lstrip().split("\n", 1)[0].strip()
    if first.startswith(SKIP_MARK):
        return None
    if first.startswith(OFFLINE_MARK):
        return block.replace("pretrained=True", "pretrained=False")
    return block


def test_blocks_are_found_and_marks_read():
    text = ("a\n```python\nx = 1\n```\ntext\n```bash\nls\n```\n"
            "```python\n# needs a download: weights\ny = 2\n```\n"
            "```python\n# downloads: pretrained=True\nm(pretrained=True)\n```\n")
    blocks = python_blocks(text)
    assert blocks == ["x = 1\n", "# needs a download: weights\ny = 2\n",
                      "# downloads: pretrained=True\nm(pretrained=True)\n"]
    assert [runnable(b) for b in blocks] == [
        "x = 1\n", None, "# downloads: pretrained=False\nm(pretrained=False)\n"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A temporary working folder holding ``photo.jpg``, with matplotlib on Agg."""
    import matplotlib

    matplotlib.use("Agg")
    from PIL import Image

    from captum_vit.data import load_sample

    gray = (load_sample()["images"][3, 0] * 255).round().byte().numpy()
    Image.fromarray(gray).convert("RGB").resize((320, 240)).save(tmp_path / "photo.jpg")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.docs_build  # executed by CI's docs step (.ci/docs) with the rest of the docs
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_page_code_runs(page, workdir):
    import matplotlib.pyplot as plt
    import torch

    assert page.is_file(), f"{page} is missing"
    for module in NEEDS.get(page.name, ()):
        pytest.importorskip(module)
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    assert blocks, f"{page.name} has no python block"
    namespace: dict = {"__name__": "__docs__"}
    torch.manual_seed(0)
    ran = 0
    try:
        for i, block in enumerate(blocks):
            code = runnable(block)
            if code is None:
                continue
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)  # noqa: S102
            ran += 1
    finally:
        plt.close("all")
    assert ran, f"{page.name}: every block is marked as needing a download"
    assert os.getcwd() == str(workdir)
    _NAMESPACES[page.name] = namespace


def _families_namespace(workdir) -> dict:
    """What the families page's code computed (run here when the page's test has not)."""
    page = SOURCE / "guide" / "families.md"
    if page.name not in _NAMESPACES:
        test_page_code_runs(page, workdir)
    return _NAMESPACES[page.name]


def test_families_examples_explain_models_whose_output_is_not_zero(workdir):
    """Issue 42: the SAM example's random model had an image embedding of ~1e-22 under
    transformers 5.x's initialisation and maps of ~1e-26; with ``seeded_init`` the
    embedding, the mask score and the maps are of order one (far above the float32
    round-off of their scale)."""
    pytest.importorskip("transformers")
    import torch

    ns = _families_namespace(workdir)
    sam, x, target = ns["sam"], ns["x"], ns["target"]
    with torch.no_grad():
        embedding = sam.get_image_embeddings(x)
    assert float(embedding.std()) > 0.1
    res = ns["DecompX"](sam).decompose(x, target)
    assert float(res.logit.abs().min()) > 1e-3
    assert float(res.tokens.abs().amax(-1).min()) > 1e-4 * float(res.logit.abs().max())
    gae = ns["GAE"](sam).attribute(x, target=target, output="grid")
    assert float(gae.abs().amax((1, 2, 3)).min()) > 1e-3
    # the PaliGemma and DPT examples are not zero either
    for name in ("vlm_maps", "vlm_rise", "depth_maps", "depth_rise"):
        assert ns[name].shape == (2, 1, 4, 4), name
        assert float(ns[name].abs().amax((1, 2, 3)).min()) > 1e-3, name
    assert float(ns["depth_tokens"].abs().amax(-1).min()) > 1e-3


def test_hugging_face_recipe_runs_on_a_local_model(workdir, monkeypatch):
    """The recipe's Hugging Face block (marked as needing the hub) runs unchanged against a
    tiny random ViT saved under the hub name it loads: ``from_pretrained`` reads a local
    folder of that name first."""
    transformers = pytest.importorskip("transformers")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = python_blocks((SOURCE / "guide" / "recipes.md").read_text(encoding="utf-8"))
    hf = [b for b in blocks if "AutoImageProcessor" in b]
    assert len(hf) == 1 and runnable(hf[0]) is None
    name = re.search(r'from_pretrained\("([^"]+)"\)', hf[0]).group(1)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, num_labels=5)
    transformers.ViTForImageClassification(config).save_pretrained(workdir / name)
    transformers.ViTImageProcessor().save_pretrained(workdir / name)
    namespace: dict = {"__name__": "__docs__"}
    try:
        exec(compile(blocks[0], "recipes.md[block 0]", "exec"), namespace)  # noqa: S102
        exec(compile(hf[0], "recipes.md[hugging face]", "exec"), namespace)  # noqa: S102
    finally:
        plt.close("all")
    assert namespace["attr"].shape == (1, 1, 14, 14)
    assert namespace["names"] == [config.id2label[k] for k in range(5)]


def test_seeded_init_is_reproducible_and_of_order_one():
    """``captum_vit.zoo.seeded_init``, the examples' re-initialisation: the same seed gives
    the same parameters, matrices get std ``1/sqrt(fan_in)``, vectors named bias ~0.02,
    other vectors 1; a non-module is refused by name."""
    import torch

    from captum_vit.zoo import seeded_init

    def make():
        torch.manual_seed(123)
        return torch.nn.Sequential(torch.nn.Linear(400, 300), torch.nn.LayerNorm(300))

    a, b = seeded_init(make(), seed=7), seeded_init(make(), seed=7)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(seeded_init(make(), seed=8)[0].weight, a[0].weight)
    assert abs(float(a[0].weight.std()) * 400 ** 0.5 - 1) < 0.02
    assert abs(float(a[0].bias.std()) - 0.02) < 0.005
    assert torch.equal(a[1].weight, torch.ones(300))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        seeded_init("vit")


def test_seeded_init_gives_sam_an_output_of_order_one():
    """transformers 5.x initialises SAM so that a config-built model's image embedding is
    ~1e-22 (the maps of the families page and tutorial 05 were ~1e-26)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from captum_vit.zoo import seeded_init

    cfg = transformers.SamConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=4, window_size=3, global_attn_indexes=[1],
                           output_channels=16, mlp_dim=64, num_pos_feats=8),
        prompt_encoder_config=dict(hidden_size=16, image_size=32, patch_size=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 mlp_dim=32, iou_head_hidden_dim=16))
    sam = transformers.SamModel(cfg).eval()
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        after = float(seeded_init(sam, seed=0).get_image_embeddings(x).std())
    assert 0.1 < after < 10
