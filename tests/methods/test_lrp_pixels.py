"""LRP at the pixels (SPEC_NEXT §8.6, ``at="pixels"``): the embedding run with a rule set,
``adapter.embed(images, ops)``.

The patch projection is the linear map of the unfolded patches through ``ops.linear``
(so AttnLRP's γ-rule reaches it) and every embedding LayerNorm goes through ``ops.norm``
(the LN rule); the rest of the embedding is the model's own code. Checked in float64
against the model's own embedding (values and pixel gradients), against references that
detach the norms' standard deviation by hand, against zennit's γ-rule written from the
contributions of the unfolded patches, and by conservation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from captum_vit import CPLRP, AttnLRP
from captum_vit._base import prepare
from captum_vit.adapters import FusedOps, LRPOps, Ops, adapt, patch_projection
from captum_vit.methods._masks import patch_sums
from tests.helpers import (
    ALL_FAMILIES,
    EMBEDDING_FAMILIES,
    assert_unchanged,
    family_marks,
    make_inputs,
    make_model,
    randomize_,
    snapshot,
)

TARGET = torch.tensor([1, 3])

# timm models with embedding norms: name -> (class, kwargs, input size)
NORMED: dict[str, tuple[type, dict, tuple[int, int]]] = {
    # CLIP-style: norm_pre (and no patch bias), plus a LayerNorm inside patch_embed
    "vit_prenorm": (VisionTransformer, {"pre_norm": True, "embed_norm_layer": "layernorm"},
                    (32, 32)),
    # dynamic size with timm's padding of the last partial patches (NHWC patch output)
    "vit_prenorm_pad": (VisionTransformer, {"pre_norm": True, "dynamic_img_size": True,
                                            "dynamic_img_pad": True, "reg_tokens": 1},
                        (30, 36)),
    "eva_prenorm": (Eva, {"use_pre_transformer_norm": True, "use_rot_pos_emb": True,
                          "global_pool": "token"}, (32, 32)),
}
_MODELS: dict[str, nn.Module] = {}


def model_of(family: str) -> nn.Module:
    if family not in _MODELS:
        if family in NORMED:
            cls, extra, size = NORMED[family]
            torch.manual_seed(0)
            model = cls(img_size=size, patch_size=8, in_chans=3, embed_dim=32, depth=2,
                        num_heads=4, mlp_ratio=2.0, num_classes=5, qkv_bias=True, **extra)
            _MODELS[family] = randomize_(model, 0).double().eval()
        else:
            _MODELS[family] = make_model(family, depth=2)
    return _MODELS[family]


def inputs_of(family: str, batch: int = 2) -> torch.Tensor:
    if family in NORMED:
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch, 3, *NORMED[family][2], generator=g, dtype=torch.float64)
    return make_inputs(family, batch=batch)


def target_of(family: str, model: nn.Module) -> torch.Tensor:
    if family in EMBEDDING_FAMILIES:  # vector targets (SPEC_NEXT §7.5)
        dim = adapt(model).run(adapt(model).embed(inputs_of(family))).shape[-1]
        return torch.randn(2, dim, generator=torch.Generator().manual_seed(2),
                           dtype=torch.float64)
    return TARGET


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


def param(f: str):
    return pytest.param(f, marks=family_marks(f))


# -- the embedding with Ops ---------------------------------------------------------------
@pytest.mark.parametrize("family", [param(f) for f in (*ALL_FAMILIES, *EMBEDDING_FAMILIES,
                                                        *NORMED)])
def test_embed_with_plain_ops_is_the_models_embedding(family):
    """``embed(x, ops)`` with the plain rule sets (``Ops()``, ``FusedOps()``): the values
    of the model's own embedding and the same pixel gradient (vector-Jacobian product),
    1e-12, on every family."""
    model = model_of(family) if family in NORMED else make_model(family, depth=1)
    ad, x = adapt(model), inputs_of(family)
    before = snapshot(model)
    ref_in = x.clone().requires_grad_()
    ref = ad.embed(ref_in)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3),
                      dtype=ref.dtype)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, cot)
    for ops in (Ops(), FusedOps()):
        ours_in = x.clone().requires_grad_()
        ours = ad.embed(ours_in, ops=ops)
        (grad,) = torch.autograd.grad(ours, ours_in, cot)
        close(ours, ref.detach(), 1e-12)
        close(grad, ref_grad, 1e-12)
    assert_unchanged(model, before)


def frozen_layer_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """A LayerNorm whose standard deviation is detached by hand (the LN rule)."""
    if isinstance(norm, nn.Identity):
        return x
    xc = x - x.mean(-1, keepdim=True)
    sd = (xc.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt().detach()
    return xc / sd * norm.weight + norm.bias


def reference_embed(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The embedding written out with the model's own convolution (true gradient) and
    every embedding norm's σ detached by hand."""
    if hasattr(model, "patch_embed"):  # timm
        pe = model.patch_embed
        x = images
        if pe.dynamic_img_pad:
            ph, pw = pe.patch_size
            x = F.pad(x, (0, -x.shape[-1] % pw, 0, -x.shape[-2] % ph))
        x = pe.proj(x).permute(0, 2, 3, 1)  # NHWC
        if pe.flatten:
            x = x.flatten(1, 2)
        x = model._pos_embed(frozen_layer_norm(x, pe.norm))
        if isinstance(model, Eva):
            x = x[0]
        else:
            x = model.patch_drop(x)
        return frozen_layer_norm(x, model.norm_pre)
    ad = adapt(model)  # Hugging Face CLIP: the model's embeddings, then pre_layrnorm
    x = ad.backbone.embeddings(images, **ad._size_kwargs(images))
    return frozen_layer_norm(x, ad.backbone.pre_layrnorm)


@pytest.mark.parametrize("family", [param(f) for f in (*NORMED, "hf_clip", "hf_clip_noproj")])
def test_embed_with_the_ln_rule_detaches_sigma(family):
    """``embed(x, LRPOps())``: the model's values; the pixel gradient of the reference
    whose ``patch_embed.norm`` / ``norm_pre`` / ``pre_layrnorm`` has σ detached by hand
    (1e-12), which differs from the true gradient."""
    model = model_of(family) if family in NORMED else make_model(family, depth=1)
    ad, x = adapt(model), inputs_of(family)
    assert ad.embedding_norms()
    ref_in = x.clone().requires_grad_()
    ref = reference_embed(model, ref_in)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3),
                      dtype=ref.dtype)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, cot)
    ours_in = x.clone().requires_grad_()
    ours = ad.embed(ours_in, ops=LRPOps())
    (grad,) = torch.autograd.grad(ours, ours_in, cot)
    close(ours, ad.embed(x).detach(), 1e-12)
    close(grad, ref_grad, 1e-12)
    true_in = x.clone().requires_grad_()
    (true_grad,) = torch.autograd.grad(ad.embed(true_in), true_in, cot)
    assert not torch.allclose(grad, true_grad, atol=1e-6)


# -- at="pixels" --------------------------------------------------------------------------
def reference_pixels(method, family: str, x: torch.Tensor, target) -> torch.Tensor:
    """Per-patch pixel relevance [B, P] of ``method`` with the embedding of
    :func:`reference_embed` (the blocks and head run the method's own rule set)."""
    model = method.adapter.model
    ad = adapt(model)
    p = prepare(ad, x, target)
    with torch.enable_grad(), ad.targeting(p.embedding):
        images = p.images.clone().requires_grad_()
        tr = ad.trace(images, x=reference_embed(model, images), grad=True, ops=method.ops)
        score = tr.logits.gather(1, p.target[:, None]).sum()
        (g,) = torch.autograd.grad(score, images)
    return patch_sums((images * g).sum(1).detach(), p.layout)


METHODS = {
    "cp_lrp": lambda m: CPLRP(m, at="pixels"),
    "cp_lrp_gradient": lambda m: CPLRP(m, act_rule="gradient", at="pixels"),
    "attnlrp": lambda m: AttnLRP(m, at="pixels"),
    "attnlrp_cp": lambda m: AttnLRP(m, attention="cp", at="pixels"),
    # γ in the blocks, the patch projection left at the ε-rule
    "attnlrp_gamma_blocks": lambda m: AttnLRP(m, gamma=0.3, gamma_embed=0.0, at="pixels"),
}


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("family", [param(f) for f in ("vit", "nonsquare", *NORMED,
                                                       "hf_clip", "hf_clip_noproj")])
def test_pixels_equal_the_reference(family, name):
    """``at="pixels"`` (patch projection at γ = 0) equals the network whose embedding norms
    have σ detached by hand, gradient × input at the pixels summed per patch (1e-10
    relative; also on models without embedding norms, where it is the old true-gradient
    embedding: CP-LRP's numbers are unchanged)."""
    model, x = model_of(family), inputs_of(family)
    target = target_of(family, model)
    method = METHODS[name](model)
    before = snapshot(model)
    ours = method.attribute(x, target, output="tokens")
    close(ours, reference_pixels(method, family, x, target), 1e-10)
    assert_unchanged(model, before)


def gamma_rule(x, w, b, r, gamma, eps=0.0):
    """zennit's ``Gamma`` on ``y = x wᵀ + b`` written from the contributions
    :math:`z_{ij} = x_i w_{ji}`: for :math:`y_j > 0` each contribution becomes
    :math:`z + \\gamma z^+` and the bias :math:`b + \\gamma b^+`, for :math:`y_j < 0`
    :math:`z + \\gamma z^-` and :math:`b + \\gamma b^-`;
    :math:`R_i = \\sum_j z'_{ij} R_j / (\\sum_i z'_{ij} + b'_j)` (ε stabilised)."""
    z = x[..., None, :] * w  # [..., out, in]
    y = z.sum(-1) + b
    up = (y > 0)[..., None]
    zp = torch.where(up, z + gamma * z.clamp(min=0), z + gamma * z.clamp(max=0))
    bp = torch.where(y > 0, b + gamma * b.clamp(min=0), b + gamma * b.clamp(max=0))
    d = zp.sum(-1) + bp
    d = d + eps * torch.where(d >= 0, torch.ones_like(d), -torch.ones_like(d))
    s = torch.where(y != 0, r / d, torch.zeros_like(r))
    return (zp * s[..., None]).sum(-2)


def _patch_conv(ad) -> nn.Conv2d:
    if hasattr(ad.model, "patch_embed"):
        return ad.model.patch_embed.proj
    emb = ad.backbone.embeddings
    conv = getattr(emb, "patch_embedding", None)
    return emb.patch_embeddings.projection if conv is None else conv


@pytest.mark.parametrize(("gamma", "gamma_embed", "epsilon"),
                         [(0.5, None, 0.0), (0.1, 0.75, 0.0), (0.0, 0.25, 0.0),
                          (0.25, None, 1e-2)])
@pytest.mark.parametrize("family", [param(f) for f in ("vit", "hf_vit")])
def test_patch_projection_gamma_rule_equals_zennit(family, gamma, gamma_embed, epsilon):
    """AttnLRP's γ on the patch projection (``gamma_embed``, default ``gamma``): the pixel
    relevance is zennit's γ-rule on the unfolded patches (``F.unfold`` and the kernel as a
    matrix, from the contributions) applied to the relevance of the patch projection's
    output, :math:`R_p = p \\odot \\tilde g_{x_0}` (position embeddings are added, so the
    modified gradient at the patch rows of :math:`x_0` is that at :math:`p`); per pixel
    and, through ``attribute``, per patch (1e-10 relative)."""
    model, x = model_of(family), inputs_of(family)
    method = AttnLRP(model, gamma=gamma, gamma_embed=gamma_embed, epsilon=epsilon,
                     at="pixels")
    ad = adapt(model)
    conv = _patch_conv(ad)
    k = conv.kernel_size
    w, b = conv.weight.detach().flatten(1), conv.bias.detach()
    # reference: the modified gradient at x0 (blocks: the method's rules) ...
    tr = ad.trace(x, grad=True, ops=method.ops)
    (g0,) = torch.autograd.grad(tr.logits.gather(1, TARGET[:, None]).sum(), tr.x0)
    cols = F.unfold(x, k, stride=k).transpose(1, 2)  # [B, P, C kh kw]
    p = cols @ w.T + b
    r_p = p * g0[:, ad.num_prefix:].detach()
    ge = gamma if gamma_embed is None else gamma_embed
    ref = gamma_rule(cols, w, b, r_p, ge, epsilon)  # [B, P, C kh kw]
    # ... against the pixel relevance of the rules through adapter.embed(images, ops)
    images = x.clone().requires_grad_()
    embed_ops = method.ops if method.embed_ops is None else method.embed_ops
    tr = ad.trace(images, x=ad.embed(images, ops=embed_ops), grad=True, ops=method.ops)
    (g,) = torch.autograd.grad(tr.logits.gather(1, TARGET[:, None]).sum(), images)
    pixels = F.unfold(images.detach() * g, k, stride=k).transpose(1, 2)
    close(pixels, ref, 1e-10)
    close(method.attribute(x, TARGET, output="tokens"), ref.sum(-1), 1e-10)
    if ge:  # the rule changes the map
        plain = AttnLRP(model, gamma=gamma, gamma_embed=0.0, epsilon=epsilon, at="pixels")
        assert not torch.allclose(plain.attribute(x, TARGET, output="tokens"),
                                  ref.sum(-1), atol=1e-6)


def test_conservation_through_the_embedding():
    """Without biases, class token and position embedding, the LN rule (``patch_embed.norm``
    and ``norm_pre``) and the γ-rule of the patch projection are conservative: the pixel
    relevance of CP-LRP and of AttnLRP(attention="cp", γ) sums to the logit (1e-10)."""
    model = copy.deepcopy(model_of("vit_prenorm"))
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("bias") or name in ("cls_token", "pos_embed"):
                prm.zero_()
    x = inputs_of("vit_prenorm")
    logit = adapt(model).model_logits(x).gather(1, TARGET[:, None])[:, 0].detach()
    for method in (CPLRP(model, at="pixels"),
                   AttnLRP(model, attention="cp", gamma=0.3, at="pixels"),
                   AttnLRP(model, attention="cp", gamma=0.0, gamma_embed=2.0, at="pixels")):
        close(method._token_maps(x, TARGET).sum(-1), logit, 1e-10)


# -- errors and options -------------------------------------------------------------------
def test_patch_projection_needs_non_overlapping_patches():
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    for conv in (nn.Conv2d(3, 4, 8, stride=4), nn.Conv2d(3, 4, 8, stride=8, padding=1),
                 nn.Linear(3, 4)):
        with pytest.raises(TypeError, match="proj.*stride == kernel_size"):
            patch_projection(x, conv.double(), Ops(), "proj")
    conv = nn.Conv2d(3, 4, 8, stride=8, padding="valid").double()
    close(patch_projection(x, conv, Ops(), "proj").permute(0, 3, 1, 2), conv(x), 1e-12)


def test_gamma_embed_is_checked():
    model = model_of("vit")
    with pytest.raises(ValueError, match="gamma_embed"):
        AttnLRP(model, gamma_embed=-1.0, at="pixels")
    with pytest.raises(ValueError, match="gamma_embed.*at='pixels'"):
        AttnLRP(model, gamma_embed=0.5)
    with pytest.raises(ValueError, match="at"):
        AttnLRP(model, gamma_embed=0.5, at="patches")
    assert AttnLRP(model, gamma=0.2, at="pixels").gamma_embed == 0.2
    assert AttnLRP(model, gamma=0.2, gamma_embed=0.0, at="pixels").gamma_embed == 0.0
