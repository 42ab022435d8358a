"""Hugging Face DINOv3 (``DINOv3ViTModel``, SPEC_FRONTIER §15.2): the canonical forward is
the model's at several sizes with either MLP, RoPE rotates the patch rows only, timm's
DINOv3 ``Eva`` with copied weights is a twin (forward and every method's maps), DecompX is
complete, maps do not depend on the batch, and the model is never changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_vit import DecompX, EmbeddingTarget
from captum_vit.adapters import adapt
from captum_vit.adapters.families.hf_dinov3 import HFDinov3Adapter, dinov3_example
from captum_vit.registry import available_methods, build_method
from tests.helpers import assert_close_scaled, assert_unchanged, needs_transformers, snapshot

pytestmark = needs_transformers
METHODS = available_methods(compositions=True)
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16}}
_MODELS: dict[bool, nn.Module] = {}


def dinov3(gated: bool = False) -> nn.Module:
    """The tiny DINOv3ViTModel of the catalogue (float64, eval: 3 layers, width 32, patch 8,
    2 registers; ``gated``: SwiGLU MLP), one per kind (never changed by a test)."""
    if gated not in _MODELS:
        _MODELS[gated] = dinov3_example(gated)()
    return _MODELS[gated]


def images(size: tuple[int, int] = (24, 40), batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


def vectors(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- the canonical forward ------------------------------------------------------------------
@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("size", [(24, 40), (32, 16)])
def test_forward_equals_the_models_pooler_output(size, gated):
    """The canonical forward's embedding is the model's ``pooler_output`` (the normed CLS
    row) at the configured size and another one (the RoPE tables of the input's grid),
    with the GELU and the SwiGLU MLP; the states are the model's hidden states."""
    model = dinov3(gated)
    ad = adapt(model)
    assert isinstance(ad, HFDinov3Adapter) and ad.num_prefix == 3 and ad.embedding
    assert (ad.blocks[0].gate_weight is not None) == gated
    x = images(size)
    with torch.no_grad():
        out = model(pixel_values=x, output_hidden_states=True)
        assert_close_scaled(out.pooler_output, out.last_hidden_state[:, 0])  # pooler = CLS
        assert_close_scaled(ad.run(ad.embed(x)), out.pooler_output)
        h = ad.embed(x)
        for l in range(3):
            h = ad.block(h, l, ad_ops())
            assert_close_scaled(h, out.hidden_states[l + 1])
    ad.self_check(x)


def ad_ops():
    from captum_vit.adapters import Ops

    return Ops()


def test_rope_rotates_the_patch_rows_only():
    """Block 0's attention probabilities equal a reference written here from the model's
    parameters and its own RoPE tables: prefix rows (CLS, registers) of q and k
    unrotated, patch rows ``x cos + rotate_half(x) sin``."""
    model = dinov3()
    ad = adapt(model)
    x = images()
    with torch.no_grad():
        x0 = ad.embed(x)
        rec = ad.trace(x).blocks[0]
        layer = model.model.layer[0]
        u = layer.norm1(x0)
        att = layer.attention
        cos, sin = model.rope_embeddings(x)

        def heads(t):
            return t.view(2, -1, 4, 8).transpose(1, 2)

        def rope(t):
            half = torch.cat([-t[..., 4:], t[..., :4]], -1)
            return torch.cat([t[:, :, :3], t[:, :, 3:] * cos + half[:, :, 3:] * sin], 2)

        q, k = rope(heads(att.q_proj(u))), rope(heads(att.k_proj(u)))
        ref = (q @ k.transpose(-1, -2) * 8 ** -0.5).softmax(-1)
    assert_close_scaled(rec.attn, ref)


# -- the timm twin -----------------------------------------------------------------------------
def timm_twin(hf: nn.Module) -> nn.Module:
    """timm's DINOv3 ``Eva`` (the configuration of ``vit_small_patch16_dinov3``: RoPE
    ``'dinov3'`` with rotate-half, temperature 100, registers, no absolute embedding,
    LayerScale, CLS readout without ``fc_norm``; head-less) with ``hf``'s weights.

    The weight mapping (HF ``DINOv3ViTModel`` -> timm ``Eva``): ``embeddings.cls_token`` ->
    ``cls_token``, ``register_tokens`` -> ``reg_token``, ``patch_embeddings`` ->
    ``patch_embed.proj``; per layer ``norm1``/``norm2`` as they are, ``q/k/v_proj.weight``
    stacked -> ``attn.qkv.weight`` (timm's ``k_bias`` is a zero buffer: HF
    ``key_bias=False``), ``q_proj.bias`` -> ``attn.q_bias``, ``v_proj.bias`` ->
    ``attn.v_bias``, ``o_proj`` -> ``attn.proj``, ``layer_scale{1,2}.lambda1`` ->
    ``gamma_{1,2}``, ``down_proj`` -> ``mlp.fc2``; the GELU ``up_proj`` -> ``mlp.fc1``, the
    gated ``[gate_proj; up_proj]`` -> the packed ``GluMlp.fc1`` (``act(first half) ⊙ second
    half``); ``norm`` -> ``norm``.

    The RoPE tables are the one thing the libraries compute differently: both build the
    patch-centre angles in float32 (by other operations, ~1e-7 apart,
    :func:`test_the_twin_rope_tables_agree_to_float32_rounding`), so the twin's HF model
    gets timm's tables (its ``rope_embeddings.forward`` replaced on the copy), which
    leaves the comparison about the adapters."""
    from timm.models.eva import Eva

    cfg = hf.config
    gated = bool(cfg.use_gated_mlp)
    twin = Eva(img_size=tuple(cfg.image_size), patch_size=8, in_chans=3, embed_dim=32,
               depth=cfg.num_hidden_layers, num_heads=4, mlp_ratio=2.0, qkv_bias=True,
               num_classes=0, global_pool="token", use_fc_norm=False, init_values=1.0,
               rope_type="dinov3", rope_temperature=100, rope_rotate_half=True,
               use_rot_pos_emb=True, use_abs_pos_emb=False, num_reg_tokens=2,
               dynamic_img_size=True, swiglu_mlp=gated).double().eval()
    e = hf.embeddings
    sd = {"cls_token": e.cls_token, "reg_token": e.register_tokens,
          "patch_embed.proj.weight": e.patch_embeddings.weight,
          "patch_embed.proj.bias": e.patch_embeddings.bias,
          "norm.weight": hf.norm.weight, "norm.bias": hf.norm.bias}
    for i, layer in enumerate(hf.model.layer):
        a, mlp, b = layer.attention, layer.mlp, f"blocks.{i}."
        sd.update({
            b + "norm1.weight": layer.norm1.weight, b + "norm1.bias": layer.norm1.bias,
            b + "norm2.weight": layer.norm2.weight, b + "norm2.bias": layer.norm2.bias,
            b + "gamma_1": layer.layer_scale1.lambda1, b + "gamma_2": layer.layer_scale2.lambda1,
            b + "attn.qkv.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            b + "attn.q_bias": a.q_proj.bias, b + "attn.v_bias": a.v_proj.bias,
            b + "attn.proj.weight": a.o_proj.weight, b + "attn.proj.bias": a.o_proj.bias,
            b + "mlp.fc2.weight": mlp.down_proj.weight, b + "mlp.fc2.bias": mlp.down_proj.bias,
            b + "mlp.fc1.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            if gated else mlp.up_proj.weight,
            b + "mlp.fc1.bias": torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            if gated else mlp.up_proj.bias})
    missing, unexpected = twin.load_state_dict({k: v.detach().clone() for k, v in sd.items()},
                                               strict=False)
    assert not unexpected and all(k.endswith("k_bias") for k in missing)
    return twin


def timm_tables(twin: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's RoPE table of images ``x`` as HF's ``(cos, sin)``."""
    _, rope = twin._pos_embed(twin.patch_embed(x))
    d = rope.shape[-1] // 2
    return rope[:, d:], rope[:, :d]


_TWINS: dict[bool, tuple[nn.Module, nn.Module]] = {}


def twins(gated: bool = False) -> tuple[nn.Module, nn.Module]:
    """``(hf, timm)``: a copy of :func:`dinov3` reading timm's RoPE tables, and its twin."""
    if gated not in _TWINS:
        import copy

        hf = copy.deepcopy(dinov3(gated))
        twin = timm_twin(hf)
        hf.rope_embeddings.forward = lambda pixel_values: timm_tables(twin, pixel_values)
        _TWINS[gated] = (hf, twin)
    return _TWINS[gated]


def test_the_twin_rope_tables_agree_to_float32_rounding():
    """The two libraries' own RoPE tables (both computed in float32) agree to 1e-6."""
    model = dinov3()
    twin = timm_twin(model)
    for size in ((24, 40), (32, 16)):
        x = images(size)
        with torch.no_grad():
            cos, sin = model.rope_embeddings(x)
            tcos, tsin = timm_tables(twin, x)
        assert (cos - tcos).abs().max() < 1e-6 and (sin - tsin).abs().max() < 1e-6


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("size", [(24, 40), (32, 16)])
def test_the_timm_twin_has_the_same_forward(size, gated):
    hf, twin = twins(gated)
    x = images(size)
    with torch.no_grad():
        ref = twin(x)
        assert_close_scaled(hf(pixel_values=x).pooler_output, ref, rel=1e-10)
        assert_close_scaled(adapt(hf).run(adapt(hf).embed(x)), ref, rel=1e-10)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_equals_the_timm_twin(name):
    """Every registered method gives the HF model the maps of its timm twin (the same
    embedding target, token maps), and changes neither model."""
    hf, twin = twins()
    x = images()
    target = EmbeddingTarget(vectors())
    before, before_twin = snapshot(hf), snapshot(twin)
    kw = dict(FAST.get(name, {}), output="tokens")
    ours = build_method(name, hf).attribute(x, target=target, **kw)
    ref = build_method(name, twin).attribute(x, target=target, **kw)
    assert torch.isfinite(ours).all()
    if name != "random":
        assert (ref.std(1) > 0).any()  # (a ReLU-ed map may be zero for one image)
    assert_close_scaled(ours, ref, rel=1e-10)  # of each map's largest value
    assert_unchanged(hf, before)
    assert_unchanged(twin, before_twin)


@pytest.mark.parametrize("name", ["decompx", "gae", "attnlrp", "token_ixg", "cp_lrp"])
def test_the_swiglu_twin_maps_agree(name):
    hf, twin = twins(gated=True)
    x = images((32, 16))
    target = EmbeddingTarget(vectors())
    ours = build_method(name, hf).attribute(x, target=target, output="tokens")
    ref = build_method(name, twin).attribute(x, target=target, output="tokens")
    assert (ref.std(1) > 0).all()
    assert_close_scaled(ours, ref, rel=1e-10)


# -- DecompX, batches, token removal, errors ----------------------------------------------------
@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_decompx_is_complete(gated):
    """Tokens plus bias equal the linearised score, which for a dot-product target is the
    score itself; both routes agree."""
    model = dinov3(gated)
    x = images((32, 16))
    target = EmbeddingTarget(vectors(), similarity="dot")
    explicit = DecompX(model, route="explicit").decompose(x, target)
    gradient = DecompX(model, route="gradient").decompose(x, target)
    assert_close_scaled(explicit.tokens.sum(-1) + explicit.bias, explicit.logit)
    with torch.no_grad():
        score = (model(pixel_values=x).pooler_output * vectors()).sum(-1)
    assert_close_scaled(explicit.logit, score)
    for field in ("tokens", "bias", "logit"):
        assert_close_scaled(getattr(gradient, field), getattr(explicit, field), rel=1e-10)


@pytest.mark.parametrize("name", ["decompx", "gae", "attnlrp", "rollout", "tis"])
def test_maps_do_not_depend_on_the_batch(name):
    model = dinov3()
    x = images(batch=3)
    t = vectors(3)
    kw = dict(FAST.get(name, {}), output="tokens")
    method = build_method(name, model)
    whole = method.attribute(x, target=EmbeddingTarget(t), **kw)
    for i in range(3):
        one = method.attribute(x[i:i + 1], target=EmbeddingTarget(t[i:i + 1]), **kw)
        assert_close_scaled(whole[i:i + 1], one, rel=1e-10)


def test_token_removal_keeps_the_original_rope_rows():
    """True token removal equals the model's own layers on [CLS, registers, kept patches]
    with the RoPE rows of the kept patches' original positions."""
    model = dinov3()
    ad = adapt(model)
    x = images()
    keep = torch.tensor([[0, 3, 5, 8, 11], [1, 2, 4, 9, 14]])
    with torch.no_grad():
        x0 = ad.embed(x)
        got = ad.run(x0, keep=keep)
        assert_close_scaled(ad.run(x0, keep=torch.arange(15).expand(2, -1)), ad.run(x0))
        cos, sin = model.rope_embeddings(x)
        ref = []
        for i in range(2):
            h = torch.cat([x0[i:i + 1, :3], x0[i:i + 1, 3 + keep[i]]], 1)
            for layer in model.model.layer:
                h = layer(h, position_embeddings=(cos[keep[i]], sin[keep[i]]))
            ref.append(model.norm(h)[:, 0])
    assert_close_scaled(got, torch.cat(ref))


def test_clear_errors_and_the_model_unchanged():
    model = dinov3()
    ad = adapt(model)
    before = snapshot(model)
    with pytest.raises(ValueError, match="patch size"):
        build_method("gae", model).attribute(images((30, 40)), target=EmbeddingTarget(vectors()))
    with pytest.raises(TypeError, match="target"):
        build_method("gae", model).attribute(images(), target=1)
    with torch.no_grad():
        x0 = ad.embed(images((32, 16)))
        ad.embed(images())
        with pytest.raises(ValueError, match="rotary embedding of the last embedded input"):
            ad.run(x0, 0, 1)
    assert_unchanged(model, before)
    parts = {id(p) for stage in ad.parameter_stages() for p in stage}
    embedding = {id(p) for p in model.embeddings.parameters()}
    assert parts | embedding == {id(p) for p in model.parameters()}
    assert not parts & embedding
