"""The text side of CLIP-style targets (``clip_text_target(..., text_relevance=True)``): each
prompt token's relevance for each image's logit, on tiny random Hugging Face CLIP and
SigLIP and OpenCLIP models in float64.

- input×gradient equals a reference written here: the model's own text forward on a deep
  copy whose token embedding returns a leaf ``X``, the logit of each image (its own image
  features) differentiated by autograd, ``Σ_f X ⊙ ∂s/∂X``; the sum over tokens is the
  directional derivative ``d/dλ s(λX)`` (what input×gradient's sum means for a cosine);
- CP-LRP on a tower without biases and position embeddings is complete (the tokens sum
  to the logit minus its bias); AttnLRP (both attention rules) equals a hand-written
  forward with the rules, independent of the hooks on the model's modules;
- the image map is the same with and without ``text_relevance``; the model is unchanged
  (hooks removed) even when a call raises; bad input is refused by name.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captum_vit import CPLRP, GAE, RISE, AttnLRP, TokenIxG
from captum_vit.adapters.rules import lrp_linear
from captum_vit.targets import EmbeddingTarget, TextEmbeddingTarget, clip_text_target
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_open_clip_model,
    needs_open_clip,
    needs_transformers,
    snapshot,
)

KINDS = ("CLIP", "Siglip", "open_clip")
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16},  # the contract suite's options
        "bt_h": {"n_steps": 3, "start_layer": 1}, "bt_t": {"n_steps": 3, "start_layer": 1},
        "tam": {"n_steps": 3, "start_layer": 0}}
TEXTS = ["a photo of a dog", "a small cat"]
EOS = 99


class StandInTokenizer:
    """A Hugging Face tokenizer's call and ``convert_ids_to_tokens`` (no vocabulary file
    to download): one id per word, then the end token ``EOS``, padded with 0."""

    def __call__(self, *, text, padding, return_tensors):
        ids = [[1] + [3 + (sum(map(ord, w)) % 90) for w in s.split()] + [EOS] for s in text]
        width = 8 if padding == "max_length" else max(map(len, ids))
        ids = [row + [0] * (width - len(row)) for row in ids]
        t = torch.tensor(ids)
        return {"input_ids": t, "attention_mask": (t != 0).long()}

    def convert_ids_to_tokens(self, ids):
        return [{0: "<pad>", 1: "<s>", EOS: "</s>"}.get(i, f"w{i}") for i in ids]


class SigLIPStandIn(StandInTokenizer):
    """SigLIP's tokenizer returns no attention mask (its text attends to the padding)."""

    def __call__(self, **kw):
        return {"input_ids": super().__call__(**kw)["input_ids"]}


_MODELS: dict[str, nn.Module] = {}


def hf_model(kind: str) -> nn.Module:
    """A tiny random ``CLIPModel`` / ``SiglipModel`` (two text layers), float64, eval."""
    transformers = pytest.importorskip("transformers")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=100, bos_token_id=1, eos_token_id=EOS,
                pad_token_id=0, max_position_embeddings=8)
    extra = {"projection_dim": 16} if kind == "CLIP" else {}
    cfg = getattr(transformers, f"{kind}Config")(text_config=text, vision_config=vision, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}Model")(cfg).double().eval()
    with torch.no_grad():  # an order-one logit: the temperature of 10, sharper embeddings
        model.logit_scale.fill_(math.log(10.0))
        for name, p in model.named_parameters():
            if name.startswith("text_model.") and p.dim() == 2:
                p.normal_(0, 0.3 if "embedding" in name else p.shape[-1] ** -0.5)
    return model


def model_of(kind: str) -> nn.Module:
    if kind not in _MODELS:
        if kind == "open_clip":
            pytest.importorskip("open_clip")
            _MODELS[kind] = make_open_clip_model("open_clip", depth=2)
        else:
            _MODELS[kind] = hf_model(kind)
    return _MODELS[kind]


def tokenizer_of(kind: str):
    if kind == "open_clip":
        from open_clip.tokenizer import SimpleTokenizer

        return SimpleTokenizer(context_length=8)
    return SigLIPStandIn() if kind == "Siglip" else StandInTokenizer()


def images_of(kind: str) -> torch.Tensor:
    return make_inputs("open_clip" if kind == "open_clip" else "hf_clip", batch=2)


def marks(kind: str):
    return needs_open_clip if kind == "open_clip" else needs_transformers


PARAMS = [pytest.param(k, marks=marks(k)) for k in KINDS]


def token_embedding(model: nn.Module) -> tuple[nn.Module, str]:
    """The token-embedding module and its attribute path."""
    if hasattr(model, "token_embedding"):
        return model.token_embedding, "token_embedding"
    return model.text_model.embeddings.token_embedding, "text_model.embeddings.token_embedding"


class Fixed(nn.Module):
    """A token embedding that returns the given embeddings, whatever the ids."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.x = x

    def forward(self, ids):
        return self.x


def text_inputs(kind: str, model: nn.Module, tokenizer, texts) -> dict[str, torch.Tensor]:
    if kind == "open_clip":
        return {"input_ids": tokenizer(texts)}
    return tokenizer(text=texts, padding="max_length" if kind == "Siglip" else True,
                     return_tensors="pt")


def image_features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "encode_image"):
        return model.encode_image(x)
    out = model.get_image_features(pixel_values=x)
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def text_features(model: nn.Module, inputs) -> torch.Tensor:
    if hasattr(model, "encode_text"):
        return model.encode_text(inputs["input_ids"])
    out = model.get_text_features(**inputs)
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def logit_parts(model: nn.Module) -> tuple[float, float]:
    bias = getattr(model, "logit_bias", None)
    return model.logit_scale.exp().item(), 0.0 if bias is None else bias.item()


def ixg_reference(kind, model, tokenizer, x, prompt_of_image):
    """Input×gradient through the model's own text forward on a copy whose token
    embedding is a leaf: ``[B, L]`` relevance and ``d/dλ s(λX)`` at λ = 1."""
    inputs = text_inputs(kind, model, tokenizer, TEXTS)
    rows = {k: v[prompt_of_image] for k, v in inputs.items()}
    emb, path = token_embedding(model)
    leaf = emb(rows["input_ids"]).detach().requires_grad_()
    lam = torch.ones(len(leaf), 1, 1, dtype=leaf.dtype, requires_grad=True)  # per image
    twin = copy.deepcopy(model)
    owner = twin
    *parents, last = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    setattr(owner, last, Fixed(leaf * lam))
    scale, bias = logit_parts(model)
    with torch.no_grad():
        e = image_features(model, x)
    s = scale * F.cosine_similarity(e, text_features(twin, rows), dim=-1) + bias
    g, dlam = torch.autograd.grad(s.sum(), [leaf, lam])
    return (leaf * g).sum(-1).detach(), dlam.reshape(-1).detach(), s.detach()


@pytest.mark.parametrize("kind", PARAMS)
def test_text_relevance_equals_input_x_gradient(kind):
    """Two images × two prompts, each image its own prompt (``index=[1, 0]``) and the
    predicted prompt; a gradient method (GAE), a decomposition without text rules
    (TokenIxG) and a perturbation method (RISE) all give input×gradient on the text."""
    model, tok = model_of(kind), tokenizer_of(kind)
    x = images_of(kind)
    before = snapshot(model)
    for method, kw in ((GAE, {}), (TokenIxG, {}), (RISE, {"n_masks": 8, "grid_size": 2})):
        target = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
        assert isinstance(target, TextEmbeddingTarget) and target.text_relevance is None
        method(model).attribute(x, target=target, **kw)
        ref, dlam, _ = ixg_reference(kind, model, tok, x, torch.tensor([1, 0]))
        assert target.text_relevance.shape == ref.shape == (2, target.text_ids.shape[1])
        assert_close_scaled(target.text_relevance, ref, rel=1e-10)
        assert target.text_index.tolist() == [1, 0]
        # what the sum of input×gradient is: the derivative along the embeddings' scale
        assert_close_scaled(target.text_relevance.sum(-1), dlam, rel=1e-10)
        assert ref.abs().max() > 1e-3  # not vacuous
    predicted = clip_text_target(model, tok, TEXTS, index="predicted", text_relevance=True)
    GAE(model).attribute(x, target=predicted)
    scale, bias = logit_parts(model)
    with torch.no_grad():
        scores = scale * F.normalize(image_features(model, x), dim=-1) @ F.normalize(
            text_features(model, text_inputs(kind, model, tok, TEXTS)), dim=-1).T + bias
    best = scores.argmax(-1)
    assert predicted.text_index.tolist() == best.tolist()
    ref, _, _ = ixg_reference(kind, model, tok, x, best)
    assert_close_scaled(predicted.text_relevance, ref, rel=1e-10)
    assert_unchanged(model, before)


@pytest.mark.parametrize("kind", PARAMS)
def test_the_image_map_is_unchanged_by_text_relevance(kind):
    model, tok = model_of(kind), tokenizer_of(kind)
    x = images_of(kind)
    before = snapshot(model)
    for method in (GAE, TokenIxG, AttnLRP, CPLRP):
        plain = clip_text_target(model, tok, TEXTS, index=[0, 1])
        both = clip_text_target(model, tok, TEXTS, index=[0, 1], text_relevance=True)
        assert type(plain) is EmbeddingTarget
        torch.testing.assert_close(both.vectors, plain.vectors, rtol=0, atol=0)
        a = method(model).attribute(x, target=plain, output="tokens")
        b = method(model).attribute(x, target=both, output="tokens")
        assert isinstance(b, torch.Tensor) and b.shape == a.shape
        assert_close_scaled(b, a, rel=1e-10)
        assert both.text_relevance is not None and torch.isfinite(both.text_relevance).all()
    assert_unchanged(model, before)


@needs_open_clip
def test_every_registered_method_keeps_its_map_and_gets_the_text_side():
    """Every registered method and composition (ViT-CX aside: many forwards, a
    perturbation method like RISE): the map is the one without ``text_relevance``, the
    text side is input×gradient but for CP-LRP and AttnLRP; NoiseTunnel's last noisy batch
    is what the target holds."""
    from captum.attr import NoiseTunnel

    from captum_vit.registry import available_methods, build_method

    model, tok = model_of("open_clip"), tokenizer_of("open_clip")
    x = images_of("open_clip")
    before = snapshot(model)
    ref, _, _ = ixg_reference("open_clip", model, tok, x, torch.tensor([0, 1]))
    for name in available_methods(compositions=True):
        if name == "vit_cx":
            continue
        kw = FAST.get(name, {})
        plain = clip_text_target(model, tok, TEXTS, index=[0, 1])
        both = clip_text_target(model, tok, TEXTS, index=[0, 1], text_relevance=True)
        torch.manual_seed(0)
        a = build_method(name, model).attribute(x, target=plain, output="tokens", **kw)
        torch.manual_seed(0)
        b = build_method(name, model).attribute(x, target=both, output="tokens", **kw)
        assert_close_scaled(b, a, rel=1e-10, msg=name)
        if name not in ("cp_lrp", "attnlrp"):
            assert_close_scaled(both.text_relevance, ref, rel=1e-10, msg=name)
            assert both.text_rules == "input×gradient"
        else:
            assert both.text_rules == {"cp_lrp": "CPLRP", "attnlrp": "AttnLRP"}[name]
    noisy = clip_text_target(model, tok, TEXTS, index=0, text_relevance=True)
    NoiseTunnel(TokenIxG(model)).attribute(x, target=noisy, nt_samples=3, stdevs=0.01)
    assert noisy.text_relevance.shape == (6, 8) and noisy.text_index.tolist() == [0] * 6
    assert_unchanged(model, before)


def _without_biases(model: nn.Module) -> nn.Module:
    """A copy whose text tower has no biases and no position embeddings."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            text = name.startswith(("text_model.", "transformer.", "ln_final."))
            if text and (name.endswith("bias") or "position" in name):
                p.zero_()
        if hasattr(twin, "positional_embedding"):
            twin.positional_embedding.zero_()
    return twin


@pytest.mark.parametrize("kind", PARAMS)
def test_cp_lrp_text_relevance_is_complete_without_biases(kind):
    """CP-LRP's rules make the text tower a linear map of the token embeddings once its
    biases and position embeddings are gone: the relevances sum to ``s − logit_bias``.
    Input×gradient does not (the cosine is scale-invariant)."""
    model = _without_biases(model_of(kind))
    tok = tokenizer_of(kind)
    x = images_of(kind)
    target = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
    CPLRP(model).attribute(x, target=target)
    _, _, s = ixg_reference(kind, model, tok, x, torch.tensor([1, 0]))
    scale, bias = logit_parts(model)
    torch.testing.assert_close(target.text_relevance.sum(-1), s - bias, rtol=0, atol=1e-10)
    ixg = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
    TokenIxG(model).attribute(x, target=ixg)
    assert (ixg.text_relevance.sum(-1) - (s - bias)).abs().max() > 1e-3


# -- AttnLRP through the text tower: a hand-written forward with the rules --------------


def _frozen_ln(x, ln):
    mu = x.mean(-1, keepdim=True)
    inv = (x.var(-1, unbiased=False, keepdim=True) + ln.eps).rsqrt()
    return (x - mu) * inv.detach() * ln.weight + ln.bias


def _identity_rule(z, act):
    return z * (act(z) / z).detach()


def _grad_times(t, f):
    return t * f + (t * (1 - f)).detach()


def _attention(u, q, k, v, heads, mask, rule):
    """``softmax(q kᵀ/√d + mask) v`` with CP (q, k detached) or AttnLRP's uniform rule."""
    if rule == "cp":
        q, k = q.detach(), k.detach()
    else:
        q, k, v = _grad_times(q, 0.25), _grad_times(k, 0.25), _grad_times(v, 0.5)
    b, n, d = q.shape
    split = lambda t: t.reshape(b, n, heads, d // heads).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None], -math.inf)
    return (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


def lrp_reference(kind, model, inputs, e, rule, gamma=0.0, epsilon=0.0):
    """``[K, L]`` relevance of AttnLRP (``rule`` ``"attnlrp"`` or ``"cp"``: the attention
    rule) through the text tower, written from the model's parameters; ``gamma`` /
    ``epsilon``: the γ-rule (the package's ``lrp_linear``) on the ``nn.Linear`` modules the
    tower calls (not OpenCLIP's packed attention projections nor its projection matrix)."""

    def lin(m, u):
        return lrp_linear(u, m.weight, m.bias, gamma, epsilon) if gamma or epsilon else m(u)

    ids = inputs["input_ids"]
    n = ids.shape[1]
    valid = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    if kind == "open_clip":
        x = model.token_embedding(ids).detach().requires_grad_()
        h = x + model.positional_embedding[:n]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(len(ids), n, n)
        for blk in model.transformer.resblocks:
            u = _frozen_ln(h, blk.ln_1)
            w, bb = blk.attn.in_proj_weight, blk.attn.in_proj_bias
            q, k, v = (F.linear(u, wi, bi) for wi, bi in zip(w.chunk(3), bb.chunk(3), strict=True))
            a = _attention(u, q, k, v, blk.attn.num_heads, mask, rule)
            h = h + blk.attn.out_proj(a)
            z = lin(blk.mlp.c_fc, _frozen_ln(h, blk.ln_2))
            h = h + lin(blk.mlp.c_proj, _identity_rule(z, blk.mlp.gelu))
        h = _frozen_ln(h, model.ln_final)
        t = h[torch.arange(len(ids)), ids.argmax(-1)] @ model.text_projection
    else:
        tm = model.text_model
        x = tm.embeddings.token_embedding(ids).detach().requires_grad_()
        h = x + tm.embeddings.position_embedding.weight[:n]
        mask = valid[:, None, :].expand(-1, n, -1)
        if kind == "CLIP":
            mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
        for layer in tm.encoder.layers:
            u = _frozen_ln(h, layer.layer_norm1)
            at = layer.self_attn
            a = _attention(u, lin(at.q_proj, u), lin(at.k_proj, u), lin(at.v_proj, u),
                           at.num_heads, mask, rule)
            h = h + lin(at.out_proj, a)
            z = lin(layer.mlp.fc1, _frozen_ln(h, layer.layer_norm2))
            h = h + lin(layer.mlp.fc2, _identity_rule(z, layer.mlp.activation_fn))
        h = _frozen_ln(h, tm.final_layer_norm)
        if kind == "CLIP":
            t = lin(model.text_projection, h[torch.arange(len(ids)), (ids == EOS).int().argmax(-1)])
        else:
            t = lin(tm.head, h[:, -1])
    scale, bias = logit_parts(model)
    s = scale * (F.normalize(e, dim=-1) * t / t.norm(dim=-1, keepdim=True).detach()).sum(-1)
    (g,) = torch.autograd.grad((s + bias).sum(), [x])
    return (x * g).sum(-1).detach()


@pytest.mark.parametrize("attention", ["attnlrp", "cp"])
@pytest.mark.parametrize("kind", PARAMS)
def test_attnlrp_text_relevance_equals_the_rules_written_out(kind, attention):
    model, tok = model_of(kind), tokenizer_of(kind)
    x = images_of(kind)
    before = snapshot(model)
    target = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
    AttnLRP(model, attention=attention).attribute(x, target=target)
    inputs = {k: v[torch.tensor([1, 0])]
              for k, v in text_inputs(kind, model, tok, TEXTS).items()}
    with torch.no_grad():
        e = image_features(model, x)
    ref = lrp_reference(kind, model, inputs, e, attention)
    assert_close_scaled(target.text_relevance, ref, rel=1e-10)
    ixg, _, _ = ixg_reference(kind, model, tok, x, torch.tensor([1, 0]))
    assert (ref - ixg).abs().max() > 1e-4  # the rules change the relevance
    if attention == "cp":  # AttnLRP outside the attention, CP inside = CP-LRP
        cp = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
        CPLRP(model).attribute(x, target=cp)
        assert_close_scaled(cp.text_relevance, target.text_relevance, rel=1e-10)
    assert_unchanged(model, before)


@pytest.mark.parametrize("kind", PARAMS)
def test_attnlrp_gamma_reaches_the_text_towers_linear_modules(kind):
    model, tok = model_of(kind), tokenizer_of(kind)
    x = images_of(kind)
    target = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
    AttnLRP(model, gamma=0.25, epsilon=1e-3).attribute(x, target=target)
    inputs = {k: v[torch.tensor([1, 0])]
              for k, v in text_inputs(kind, model, tok, TEXTS).items()}
    with torch.no_grad():
        e = image_features(model, x)
    ref = lrp_reference(kind, model, inputs, e, "attnlrp", gamma=0.25, epsilon=1e-3)
    assert_close_scaled(target.text_relevance, ref, rel=1e-10)
    assert (ref - lrp_reference(kind, model, inputs, e, "attnlrp")).abs().max() > 1e-4


# -- tokens, viz and bad input --------------------------------------------------------------


@needs_open_clip
def test_text_tokens_are_the_tokenizers():
    model, tok = model_of("open_clip"), tokenizer_of("open_clip")
    target = clip_text_target(model, tok, TEXTS, index=[1, 0], text_relevance=True)
    GAE(model).attribute(images_of("open_clip"), target=target)
    ids = tok(TEXTS)
    assert torch.equal(target.text_ids, ids)
    words = target.text_tokens
    assert len(words) == 2 and all(len(w) == ids.shape[1] for w in words)
    assert words[0][:4] == ["<start_of_text>", "a</w>", "small</w>", "cat</w>"]
    assert words[0][4] == "<end_of_text>" and words[0][5:] == ["", "", ""]
    # the causal mask: tokens after the end token do not reach the pooled end token
    r = target.text_relevance[0]
    assert (r[5:] == 0).all() and r[:5].abs().min() > 0


@needs_transformers
def test_hugging_face_tokens_and_a_tokenizer_without_decoding():
    model = model_of("CLIP")
    target = clip_text_target(model, StandInTokenizer(), TEXTS, text_relevance=True,
                              index=[0, 0])
    GAE(model).attribute(images_of("CLIP"), target=target)
    assert target.text_tokens[0][0] == "<s>" and target.text_tokens[0][6] == "</s>"
    assert target.text_tokens[1] == target.text_tokens[0]
    bare = clip_text_target(model, lambda **kw: StandInTokenizer()(**kw), TEXTS,
                            text_relevance=True, index=0)
    GAE(model).attribute(images_of("CLIP"), target=bare)
    assert bare.text_tokens is None and bare.text_relevance.shape == (2, 7)


def test_plot_text_relevance():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from captum_vit.viz import plot_text_relevance

    ax = plot_text_relevance(["<s>", "a", "dog", "</s>"], torch.tensor([0.0, 1.0, -2.0, 0.5]))
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["<s>", "a", "dog", "</s>"]
    colours = [t.get_bbox_patch().get_facecolor() for t in ax.texts]
    assert colours[1][0] > colours[1][2] and colours[2][2] > colours[2][0]  # red +, blue −
    with pytest.raises(ValueError, match="relevance"):
        plot_text_relevance(["a", "b"], torch.zeros(3))
    with pytest.raises(TypeError, match="tokens"):
        plot_text_relevance("a b", torch.zeros(2))


@needs_open_clip
def test_bad_input_is_refused_by_name_and_the_model_is_unchanged():
    model, tok = model_of("open_clip"), tokenizer_of("open_clip")
    before = snapshot(model)
    with pytest.raises(TypeError, match="text_relevance must be True or False"):
        clip_text_target(model, tok, TEXTS, text_relevance="yes")
    with pytest.raises(TypeError, match="text side.*text_relevance"):
        clip_text_target(model.visual, tok, TEXTS, text_relevance=True)
    # a text tower of custom blocks: input×gradient runs, the LRP rules refuse by name
    odd = copy.deepcopy(model)
    odd.transformer.resblocks[0].ln_1_kv = nn.LayerNorm(32).double()  # a cross-attention block
    target = clip_text_target(odd, tok, TEXTS, index=[0, 1], text_relevance=True)
    GAE(odd).attribute(images_of("open_clip"), target=target)
    assert target.text_relevance.shape == (2, 8)
    snap = snapshot(odd)
    with pytest.raises(TypeError, match="text_relevance: the LRP rules do not reach"):
        AttnLRP(odd).attribute(images_of("open_clip"), target=target)
    assert_unchanged(odd, snap)

    class HFTextEncoderLike(nn.Module):  # OpenCLIP's Hugging Face text encoder
        pass

    other = copy.deepcopy(model)
    other.text = HFTextEncoderLike()
    del other.token_embedding
    with pytest.raises(TypeError, match="text_relevance needs OpenCLIP's own text"):
        clip_text_target(other, tok, TEXTS, text_relevance=True)
    assert_unchanged(model, before)
