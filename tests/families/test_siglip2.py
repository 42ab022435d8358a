"""SigLIP2 NaFlex (HF ``Siglip2VisionModel`` / ``Siglip2Model`` /
``Siglip2ForImageClassification``) and timm ``NaFlexVit`` (SPEC_FRONTIER §15.1, §14.2): the
adapter's forward on an unpadded image is the model's own on a processor-style padded batch
of several grids; an all-valid SigLIP2 is a twin of SigLIP with copied weights (every
method's maps); a processor batch of two sizes gives each image the maps it gets alone, in
every output format; bad batches are refused by key, the model unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from captum_vit import EmbeddingTarget
from captum_vit.adapters import adapt, catalog
from captum_vit.adapters.families.hf_siglip2 import HFSiglip2Adapter, siglip2_vision_config
from captum_vit.adapters.families.timm_naflex import TimmNaFlexAdapter
from captum_vit.registry import available_methods, build_method
from tests.helpers import assert_close_scaled, assert_unchanged, needs_transformers, snapshot

pytestmark = needs_transformers
METHODS = available_methods(compositions=True)
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16}}
P = 8
_MODELS: dict[str, nn.Module] = {}


def model(name: str = "hf_siglip2", depth: int = 2) -> nn.Module:
    """The catalogue's tiny example ``name`` (float64, eval, ``depth`` blocks), one per
    name (never changed by a test)."""
    key = f"{name}:{depth}"
    if key not in _MODELS:
        _MODELS[key] = catalog.example(name)[1].model(depth=depth)
    return _MODELS[key]


def image(h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, h, w, generator=g, dtype=torch.float64)


def vectors(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def processor_batch(images: list[torch.Tensor], max_patches: int = 24) -> dict:
    """What ``Siglip2ImageProcessor`` makes of already-sized images, with its own
    functions (``convert_image_to_patches``, ``pad_along_first_dim``): patches, mask and
    spatial shapes, padded to ``max_patches`` rows."""
    from transformers.models.siglip2.image_processing_siglip2 import (
        convert_image_to_patches,
        pad_along_first_dim,
    )

    pv, mask, shapes = [], [], []
    for im in images:
        p, m = pad_along_first_dim(convert_image_to_patches(im[0], P), max_patches)
        pv.append(p)
        mask.append(m)
        shapes.append((im.shape[-2] // P, im.shape[-1] // P))
    return {"pixel_values": torch.stack(pv), "pixel_attention_mask": torch.stack(mask),
            "spatial_shapes": torch.tensor(shapes)}


def naflex_dict(images: list[torch.Tensor], max_patches: int = 24) -> dict:
    """timm's NaFlex collator layout (``patches``, ``patch_coord`` (y, x), ``patch_valid``)
    of already-sized images, patchified with timm's own ``batch_patchify``."""
    from timm.models.naflexvit import batch_patchify

    b = len(images)
    patches = torch.zeros(b, max_patches, P * P * 3, dtype=torch.float64)
    coord = torch.zeros(b, max_patches, 2, dtype=torch.int64)
    valid = torch.zeros(b, max_patches, dtype=torch.bool)
    for i, im in enumerate(images):
        p, (h, w) = batch_patchify(im, (P, P))
        patches[i, :h * w] = p[0]
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        coord[i, :h * w] = torch.stack([ys.flatten(), xs.flatten()], 1)
        valid[i, :h * w] = True
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


GRID_PAIRS = [((24, 40), (32, 16)), ((32, 32), (8, 24)), ((16, 48), (40, 8))]


# -- forward parity with the padded batch -------------------------------------------------------
@pytest.mark.parametrize("sizes", GRID_PAIRS, ids=lambda s: f"{s[0]}+{s[1]}")
@pytest.mark.parametrize("name", ["hf_siglip2", "hf_siglip2_cls", "hf_siglip2_dual"])
def test_unpadded_forward_equals_the_models_padded_batch(name, sizes):
    """Two images of different grids in one padded batch (the model's own forward, its key
    mask and masked pooling): each image's output equals the canonical forward on the
    image alone, unpadded (positions resized to its grid by the model's code)."""
    m = model(name)
    ad = adapt(m)
    assert isinstance(ad, HFSiglip2Adapter)
    images = [image(*s, seed=i) for i, s in enumerate(sizes)]
    batch = processor_batch(images)
    with torch.no_grad():
        if hasattr(m, "get_image_features"):
            ref = m.get_image_features(**batch).pooler_output
        else:
            out = m(**batch)
            ref = out.logits if hasattr(out, "logits") else out.pooler_output
        ours = torch.cat([ad.run(ad.embed(im)) for im in images])
    assert_close_scaled(ours, ref)
    for im in images:
        ad.self_check(im)


@pytest.mark.parametrize("sizes", GRID_PAIRS[:2], ids=lambda s: f"{s[0]}+{s[1]}")
@pytest.mark.parametrize("name", ["timm_naflex", "timm_naflex_avg"])
def test_timm_unpadded_forward_equals_its_naflex_dict(name, sizes):
    """timm's NaFlex mode on a padded dict of two grids equals the canonical forward of
    each image (timm's image mode) alone."""
    m = model(name)
    ad = adapt(m)
    assert isinstance(ad, TimmNaFlexAdapter)
    images = [image(*s, seed=i) for i, s in enumerate(sizes)]
    with torch.no_grad():
        ref = m(naflex_dict(images))
        ours = torch.cat([ad.run(ad.embed(im)) for im in images])
    assert_close_scaled(ours, ref)


# -- the SigLIP twin ------------------------------------------------------------------------------
def siglip_twin(s2: nn.Module) -> nn.Module:
    """``SiglipVisionModel`` (32 px, patch 8: the 4x4 grid of SigLIP2's position table)
    with ``s2``'s weights: the patch ``Linear`` ``[D, P·P·C]`` (channels last) is the
    ``Conv2d`` ``[D, C, P, P]``; every other tensor has the same name and shape."""
    import transformers

    cfg = transformers.SiglipVisionConfig(**{
        k: v for k, v in siglip2_vision_config(s2.config.num_hidden_layers).items()
        if k != "num_patches"}, image_size=32)
    twin = transformers.SiglipVisionModel(cfg).double().eval()
    src = s2.state_dict()
    dst = twin.state_dict()
    mapped = {}
    for k, v in dst.items():
        if k.endswith("patch_embedding.weight"):
            w = src[k]  # [D, P, P, C] flattened
            mapped[k] = w.reshape(w.shape[0], P, P, 3).permute(0, 3, 1, 2).contiguous()
        else:
            assert src[k].shape == v.shape, k
            mapped[k] = src[k]
    twin.load_state_dict(mapped)
    return twin


_TWINS: list[tuple[nn.Module, nn.Module]] = []


def twins() -> tuple[nn.Module, nn.Module]:
    """``(siglip2, siglip)``: a copy of the example whose position table is rounded to
    float32 (SigLIP2 resizes it in float32 even on its own grid: the rounded table is its
    own result), and the twin."""
    if not _TWINS:
        s2 = copy.deepcopy(model())
        with torch.no_grad():
            w = s2.embeddings.position_embedding.weight
            w.copy_(w.float().double())
        _TWINS.append((s2, siglip_twin(s2)))
    return _TWINS[0]


def test_the_twin_has_the_same_forward():
    s2, twin = twins()
    x = image(32, 32, seed=5)
    with torch.no_grad():
        ref = twin(pixel_values=x).pooler_output
        assert_close_scaled(s2(**processor_batch([x], 16)).pooler_output, ref, rel=1e-12)
        assert_close_scaled(adapt(s2).run(adapt(s2).embed(x)), ref, rel=1e-12)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_equals_the_siglip_twin(name):
    """Every registered method gives the all-valid SigLIP2 the maps of its SigLIP twin
    (token maps, one vector target per image) and changes neither model."""
    s2, twin = twins()
    x = torch.cat([image(32, 32, seed=1), image(32, 32, seed=2)])
    target = EmbeddingTarget(vectors())
    before, before_twin = snapshot(s2), snapshot(twin)
    kw = dict(FAST.get(name, {}), output="tokens")
    ours = build_method(name, s2).attribute(x, target=target, **kw)
    ref = build_method(name, twin).attribute(x, target=target, **kw)
    assert torch.isfinite(ours).all()
    if name != "random":
        assert (ref.std(1) > 0).any()
    # VanillaGrad sums the gradient at the input of post_layernorm over its channels: zero
    # by construction (a LayerNorm's input gradient sums to zero), so its map is rounding
    # and is compared at the score's scale (a cosine similarity: 1)
    scale = 1.0 if name == "vanilla_grad" else None
    assert_close_scaled(ours, ref, rel=1e-10, scale=scale)
    assert_unchanged(s2, before)
    assert_unchanged(twin, before_twin)


# -- a processor batch of two sizes ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["gae", "decompx", "attnlrp", "tis"])
def test_a_processor_batch_gives_each_image_its_own_maps(name):
    """Three images of two grids in one processor batch: every output format gives each
    image the maps it gets alone (pixels and grids on its own grid, tokens one image
    after the other, inputs in the layout of ``pixel_values``, zero on the padding)."""
    m = model()
    images = [image(24, 40, 1), image(32, 16, 2), image(24, 40, 3)]
    batch = processor_batch(images)
    t = vectors(3)
    method = build_method(name, m)
    kw = FAST.get(name, {})
    before = snapshot(m)
    alone = [method.attribute(im, target=t[i:i + 1], output="pixels", **kw)
             for i, im in enumerate(images)]
    grids = [method.attribute(im, target=t[i:i + 1], output="grid", **kw)
             for i, im in enumerate(images)]
    pixels = method.attribute(batch, target=t, output="pixels", **kw)
    grid = method.attribute(batch, target=EmbeddingTarget(t), output="grid", **kw)
    tokens = method.attribute(batch, target=t, output="tokens", **kw)
    inputs = method.attribute(batch, target=t, output="inputs", **kw)
    assert [p.shape for p in pixels] == [a.shape for a in alone]
    for i in range(3):
        assert_close_scaled(pixels[i], alone[i])
        assert_close_scaled(grid[i], grids[i])
    assert_close_scaled(tokens, torch.cat([g.flatten() for g in grids]))
    assert inputs.shape == batch["pixel_values"].shape
    for i, a in enumerate(alone):
        n = a.shape[-2] * a.shape[-1] // (P * P)
        assert_close_scaled(inputs[i, :n], processor_batch([a], n)["pixel_values"][0])
        assert inputs[i, n:].eq(0).all()
    assert_unchanged(m, before)


def test_one_vector_for_every_image_and_a_classifier_batch():
    """One target vector ``[D′]`` (or ``EmbeddingTarget`` of one vector) serves every image
    of a two-grid batch; a classifier's batch takes one class per image."""
    m = model()
    images = [image(24, 40, 1), image(32, 16, 2)]
    batch = processor_batch(images)
    v = vectors(1)[0]
    method = build_method("gae", m)
    maps = method.attribute(batch, target=v, output="grid")
    same = method.attribute(batch, target=EmbeddingTarget(v), output="grid")
    texts = vectors(3)
    indexed = method.attribute(batch, target=EmbeddingTarget(texts, index=[2, 0]),
                               output="grid")
    for i, im in enumerate(images):
        one = method.attribute(im, target=v, output="grid")
        assert_close_scaled(maps[i], one)
        assert_close_scaled(same[i], one)
        assert_close_scaled(indexed[i], method.attribute(
            im, target=EmbeddingTarget(texts, index=[2, 0][i]), output="grid"))
    cls = model("hf_siglip2_cls")
    method = build_method("decompx", cls)
    maps = method.attribute(batch, target=[3, 1], output="grid")
    for i, im in enumerate(images):
        assert_close_scaled(maps[i], method.attribute(im, target=[3, 1][i], output="grid"))


def test_a_timm_naflex_dict_gives_each_image_its_own_maps():
    m = model("timm_naflex")
    images = [image(24, 40, 1), image(32, 16, 2)]
    batch = naflex_dict(images)
    method = build_method("gae", m)
    grids = method.attribute(batch, target=[1, 4], output="grid")
    inputs = method.attribute(batch, target=[1, 4], output="inputs")
    assert inputs.shape == batch["patches"].shape
    for i, im in enumerate(images):
        assert_close_scaled(grids[i], method.attribute(im, target=i * 3 + 1, output="grid"))
        alone = method.attribute(im, target=i * 3 + 1, output="pixels")
        n = im.shape[-2] * im.shape[-1] // (P * P)
        assert_close_scaled(inputs[i, :n], naflex_dict([alone], n)["patches"][0])


# -- bad input -----------------------------------------------------------------------------------
def _bad(batch: dict, key: str, value) -> dict:
    out = dict(batch)
    out[key] = value
    return out


def test_bad_batches_are_refused_by_key_and_the_model_is_unchanged():
    m = model()
    images = [image(24, 40, 1), image(32, 16, 2)]
    batch = processor_batch(images)
    method = build_method("gae", m)
    before = snapshot(m)
    mask = batch["pixel_attention_mask"].clone()
    mask[1, 8] = 1  # nine valid rows for a 4x2 grid
    with pytest.raises(ValueError, match=r"pixel_attention_mask\[1\].*spatial_shapes\[1\].*"
                                         "disagree"):
        method.attribute(_bad(batch, "pixel_attention_mask", mask), target=vectors())
    shapes = torch.tensor([[3, 5], [5, 5]])  # 25 patches: more than pixel_values holds
    with pytest.raises(ValueError, match=r"spatial_shapes\[1\].*does not match pixel_values"):
        method.attribute(_bad(batch, "spatial_shapes", shapes), target=vectors())
    with pytest.raises(ValueError, match=r"pixel_values has shape \(2, 24, 100\)"):
        method.attribute(_bad(batch, "pixel_values", batch["pixel_values"][..., :100]),
                         target=vectors())
    with pytest.raises(ValueError, match="no 'spatial_shapes'"):
        method.attribute({k: v for k, v in batch.items() if k != "spatial_shapes"},
                         target=vectors())
    with pytest.raises(ValueError, match=r"inputs must have shape \[B, C, H, W\]"):
        method.attribute(batch["pixel_values"], target=vectors())
    with pytest.raises(TypeError, match="float32.*float64"):
        method.attribute(_bad(batch, "pixel_values", batch["pixel_values"].float()),
                         target=vectors())
    assert_unchanged(m, before)
    tm = model("timm_naflex")
    d = naflex_dict(images)
    coord = d["patch_coord"].clone()
    coord[0, 1] = torch.tensor([1, 0])
    before = snapshot(tm)
    with pytest.raises(ValueError, match=r"patch_coord\[0\].*patch_coord and patch_valid "
                                         "disagree"):
        build_method("gae", tm).attribute(_bad(d, "patch_coord", coord), target=[0, 1])
    with pytest.raises(TypeError, match="attn_mask"):
        build_method("gae", tm).attribute(_bad(d, "attn_mask", torch.zeros(1)), target=[0, 1])
    assert_unchanged(tm, before)


def test_a_rope_naflexvit_is_refused_by_name():
    from timm.models.naflexvit import NaFlexVit

    m = NaFlexVit(patch_size=8, embed_dim=32, depth=1, num_heads=4, num_classes=3,
                  pos_embed_grid_size=(4, 4), rope_type="axial", pos_embed="none")
    with pytest.raises(TypeError, match="rope_type"):
        adapt(m)


@pytest.mark.parametrize("name", ["hf_siglip2", "timm_naflex_avg"])
def test_decompx_is_complete(name):
    """Tokens plus bias equal the explained score (a dot-product target on the embedding,
    a logit of the classifier) at a grid other than the position table's."""
    from captum_vit import DecompX

    m = model(name)
    x = torch.cat([image(24, 40, 1), image(24, 40, 2)])
    if name == "hf_siglip2":
        target = EmbeddingTarget(vectors(), similarity="dot")
        with torch.no_grad():
            score = (adapt(m).model_outputs(x) * vectors()).sum(-1)
    else:
        target = torch.tensor([1, 3])
        with torch.no_grad():
            score = m(x)[torch.arange(2), target]
    d = DecompX(m).decompose(x, target)
    assert_close_scaled(d.tokens.sum(-1) + d.bias, d.logit)
    assert_close_scaled(d.logit, score)
