"""Per-head maps, ``attribute(..., heads="all")``: RawAttention, Rollout, AttnGradCAM and
GAE against a slow per-head reference written from their definitions (attention and its
gradient captured through timm's own forward), the head-mean relation of each, batch
invariance, the three output shapes, a Hugging Face family (against the model's own
``output_attentions``), and the refusal of ``heads=`` by every other method."""

from __future__ import annotations

import copy

import pytest
import torch
from captum.attr import NoiseTunnel

from captum_vit import GAE, PLUS, AttnGradCAM, RawAttention, Rollout, SkipPLUS, TokenTM
from captum_vit.methods.table import method_entries
from captum_vit.registry import takes_option
from tests.helpers import (
    ReferenceCapture,
    assert_close_to_reference,
    assert_unchanged,
    make_hf_model,
    make_inputs,
    make_model,
    needs_transformers,
    snapshot,
)

PER_HEAD = {
    "raw_attention": lambda m: RawAttention(m),
    "rollout": lambda m: Rollout(m),
    "rollout1": lambda m: Rollout(m, start_layer=1),
    "gae": lambda m: GAE(m),
    "attn_gradcam": lambda m: AttnGradCAM(m),
}
OFFERED = {"RawAttention", "Rollout", "AttnGradCAM", "GAE"}


def _readout_row(model, mat):
    """Row 0 for class-token models, the mean of the patch rows for average pooling."""
    if model.global_pool == "avg":
        return mat[model.num_prefix_tokens:].mean(0)
    return mat[0]


def per_head_reference(model, x, target):
    """Per-head maps [B, H, P] from their definitions, one image and one head at a time,
    with full N x N matrices."""
    refs = ReferenceCapture(model)
    logits = refs(x)
    logits[torch.arange(len(x)), target].sum().backward()
    k = model.num_prefix_tokens
    out = {name: [] for name in PER_HEAD}
    for b in range(len(x)):
        attn = [a[b].detach() for a in refs.attn]
        grad = [a.grad[b] for a in refs.attn]
        heads, n = attn[-1].shape[0], attn[-1].shape[-1]
        eye = torch.eye(n, dtype=x.dtype)
        last, below = attn[-1], attn[:-1]
        # raw attention: head h's attention at the readout row
        out["raw_attention"].append(torch.stack([_readout_row(model, last[h])
                                                 for h in range(heads)]))
        # rollout: the last factor per head, (A^h + I) / rowsum, over the head-mean rollout
        for name, start in (("rollout", 0), ("rollout1", 1)):
            joint = eye.clone()
            for a in below[start:]:
                m = sum(a) / heads + eye
                joint = (m / m.sum(-1, keepdim=True)) @ joint
            rows = []
            for h in range(heads):
                m = last[h] + eye
                rows.append(_readout_row(model, (m / m.sum(-1, keepdim=True)) @ joint))
            out[name].append(torch.stack(rows))
        # GAE: R_{L-1} from the head-mean updates below, then the last update per head
        rel = eye.clone()
        for a, g in zip(below, grad[:-1], strict=True):
            rel = rel + (sum(torch.relu(g[h] * a[h]) for h in range(heads)) / heads) @ rel
        out["gae"].append(torch.stack([
            _readout_row(model, rel + torch.relu(grad[-1][h] * last[h]) @ rel)
            for h in range(heads)]))
        # attention Grad-CAM: w_h A^h[r, :] before the head mean and the ReLU
        out["attn_gradcam"].append(torch.stack([
            _readout_row(model, grad[-1][h])[k:].mean() * _readout_row(model, last[h])
            for h in range(heads)]))
    return {name: torch.stack(v)[..., k:] for name, v in out.items()}


@pytest.mark.parametrize("family", ["vit", "avgpool", "registers"])
def test_matches_slow_per_head_reference(family):
    model = make_model(family)
    x = make_inputs(family, batch=2)
    target = torch.tensor([1, 3])
    ref = per_head_reference(model, x, target)
    for name, make in PER_HEAD.items():
        out = make(model).attribute(x, target=target, heads="all", output="tokens")
        assert out.dtype == torch.float64
        assert out.shape == (2, 4, ref[name].shape[-1]), name
        assert_close_to_reference(out, ref[name], rel=1e-12)


@pytest.mark.parametrize("family", ["vit", "avgpool", "map"])
def test_head_mean_gives_the_heads_mean_map(family):
    """RawAttention, Rollout, GAE: mean_h m_h is the map; AttnGradCAM: ReLU(mean_h m_h)."""
    model = make_model(family)
    x = make_inputs(family, batch=2)
    for name, make in PER_HEAD.items():
        method = make(model)
        mean = method.attribute(x, target=[0, 2], output="tokens")
        per_head = method.attribute(x, target=[0, 2], heads="all", output="tokens")
        relation = per_head.mean(1)
        if name == "attn_gradcam":
            relation = relation.clamp(min=0)
            assert (per_head < 0).any()  # signed per-head terms: the ReLU comes after
        assert_close_to_reference(relation, mean, rel=1e-12)


def test_heads_mean_is_the_default_path():
    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    for make in PER_HEAD.values():
        method = make(model)
        assert torch.equal(method.attribute(x, target=[0, 1]),
                           method.attribute(x, target=[0, 1], heads="mean"))


def test_batch_invariance():
    model = make_model("vit")
    x = make_inputs("vit", batch=3)
    target = torch.tensor([0, 4, 2])
    for make in PER_HEAD.values():
        method = make(model)
        together = method.attribute(x, target=target, heads="all", output="tokens")
        for b in range(3):
            alone = method.attribute(x[b:b + 1], target=target[b:b + 1], heads="all",
                                     output="tokens")
            assert_close_to_reference(together[b:b + 1], alone, rel=1e-12)


@pytest.mark.parametrize("name", list(PER_HEAD))
def test_output_shapes_on_a_non_square_grid(name):
    model = make_model("nonsquare")  # 24 x 40 pixels, patch 8: a 3 x 5 grid
    x = make_inputs("nonsquare", batch=2)
    method = PER_HEAD[name](model)
    tokens = method.attribute(x, target=[0, 1], heads="all", output="tokens")
    grid = method.attribute(x, target=[0, 1], heads="all", output="grid")
    pixels = method.attribute(x, target=[0, 1], heads="all")
    assert tokens.shape == (2, 4, 15)
    assert grid.shape == (2, 4, 3, 5)
    assert pixels.shape == (2, 4, 24, 40)  # one channel per head, not the image's three
    assert_close_to_reference(grid, tokens.reshape(2, 4, 3, 5), rel=1e-12)
    for i in range(3):  # each patch's score fills its 8 x 8 pixels
        for j in range(5):
            patch = pixels[..., 8 * i:8 * i + 8, 8 * j:8 * j + 8]
            assert_close_to_reference(patch, grid[..., i:i + 1, j:j + 1].expand_as(patch),
                                      rel=1e-12)
    as_tuple = method.attribute((x,), target=[0, 1], heads="all", output="grid")
    assert isinstance(as_tuple, tuple) and as_tuple[0].shape == grid.shape


def test_attention_pool_heads():
    """``global_pool='map'``: RawAttention reads the pool's own heads, recomputed here from
    the pool's modules on its captured input."""
    model = make_model("map")
    x = make_inputs("map", batch=2)
    out = RawAttention(model).attribute(x, heads="all", output="tokens")
    twin = copy.deepcopy(model)
    pool = twin.attn_pool
    seen = []
    pool.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        twin(x)
        z = seen[0]
        b, n, d = z.shape
        heads, hd = pool.num_heads, d // pool.num_heads
        if pool.pos_embed is not None:
            z = z + pool.pos_embed.unsqueeze(0)
        q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, -1, heads, hd).transpose(1, 2)
        k = pool.kv(z).reshape(b, n, 2, heads, hd).permute(2, 0, 3, 1, 4)[0]
        q, k = pool.q_norm(q), pool.k_norm(k)
        ref = ((q * hd ** -0.5) @ k.transpose(-2, -1)).softmax(-1)[:, :, 0]
    assert out.shape == (2, heads, n)  # no class token: every token is a patch
    assert_close_to_reference(out, ref, rel=1e-12)


@needs_transformers
def test_hugging_face_family_against_its_own_modules():
    """RawAttention's heads on a Hugging Face ViT equal the last layer's attention
    recomputed in float64 from the layer's own q/k projections on its captured input (the
    model's ``output_attentions`` takes its softmax in float32)."""
    model = make_hf_model("hf_vit")
    x = make_inputs("hf_vit", batch=2)
    before = snapshot(model)
    out = RawAttention(model).attribute(x, heads="all", output="tokens")
    assert_unchanged(model, before)
    twin = copy.deepcopy(model)
    attn = twin.vit.layers[-1].attention
    seen = []
    attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True)
    with torch.no_grad():
        twin(pixel_values=x)
        h = seen[0]
        q = attn.q_proj(h).unflatten(-1, (attn.num_attention_heads, -1)).transpose(1, 2)
        k = attn.k_proj(h).unflatten(-1, (attn.num_attention_heads, -1)).transpose(1, 2)
        probs = ((q @ k.transpose(-2, -1)) * attn.scaling).softmax(-1)
    assert out.shape == (2, 4, 16)
    assert_close_to_reference(out, probs[:, :, 0, 1:], rel=1e-12)
    for name, make in PER_HEAD.items():
        method = make(model)
        mean = method.attribute(x, target=[0, 2], output="tokens")
        per_head = method.attribute(x, target=[0, 2], heads="all", output="grid")
        assert per_head.shape == (2, 4, 4, 4), name
        relation = per_head.flatten(2).mean(1)
        if name == "attn_gradcam":
            relation = relation.clamp(min=0)
        assert_close_to_reference(relation, mean, rel=1e-12)


def test_every_other_method_refuses_heads_by_name():
    model = make_model("vit", depth=2)
    x = make_inputs("vit", batch=1)
    offering = {e.cls.__name__ for e in method_entries() if getattr(e.cls, "per_head", False)}
    assert offering == OFFERED
    for entry in method_entries():
        if entry.cls.__name__ in OFFERED:
            assert takes_option(entry.name, "heads")
            continue
        assert not takes_option(entry.name, "heads"), entry.name
        method = entry.build(model, 0)
        with pytest.raises(TypeError, match=rf"{entry.cls.__name__}\.attribute takes no "
                                            r"heads= option") as err:
            method.attribute(x, heads="all")
        for name in OFFERED:
            assert name in str(err.value)


def test_combinators_and_noise_tunnel_refuse_heads():
    model = make_model("vit", depth=2)
    x = make_inputs("vit", batch=1)
    for combinator in (PLUS(model, "gae"), SkipPLUS(model, "raw_attention")):
        with pytest.raises(TypeError, match=r"PLUS\.attribute takes no heads= option"):
            combinator.attribute(x, heads="all")
    with pytest.raises(TypeError, match=r"TokenTM\.attribute takes no heads= option"):
        NoiseTunnel(TokenTM(model)).attribute(x, nt_type="smoothgrad", nt_samples=2,
                                              stdevs=0.1, heads="all")


def test_noise_tunnel_averages_per_head_maps():
    model = make_model("vit", depth=2)
    x = make_inputs("vit", batch=2)
    out = NoiseTunnel(GAE(model)).attribute(x, nt_type="smoothgrad", nt_samples=2, stdevs=0.1,
                                            target=[0, 1], heads="all", output="grid")
    assert out.shape == (2, 4, 4, 4)


def test_unknown_heads_value():
    model = make_model("vit", depth=2)
    x = make_inputs("vit", batch=1)
    with pytest.raises(ValueError, match=r"heads must be one of 'mean', 'all'; got 'max'"):
        GAE(model).attribute(x, heads="max")


def test_model_unchanged():
    model = make_model("vit", depth=2)
    x = make_inputs("vit", batch=2)
    before = snapshot(model)
    for make in PER_HEAD.values():
        make(model).attribute(x, target=[0, 1], heads="all")
    assert_unchanged(model, before)


def test_plot_heads_draws_a_panel_per_head(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from captum_vit.viz import plot_heads

    model = make_model("nonsquare", depth=2)
    x = make_inputs("nonsquare", batch=2)
    for output in ("tokens", "grid", "pixels"):
        maps = RawAttention(model).attribute(x, heads="all", output=output)
        fig = plot_heads(x[1], maps[1], title="raw attention")
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert titles == ["input", "head 0", "head 1", "head 2", "head 3"]
        heat = [ax.images[-1].get_array() for ax in fig.axes
                if ax.get_title().startswith("head")]
        assert all(tuple(h.shape[:2]) == (24, 40) for h in heat)
        plt.close(fig)
    with pytest.raises(ValueError, match=r"whole batch: pass one image's, maps\[b\]"):
        plot_heads(x[0], maps)
    plot_heads(x[0], maps[0], path=str(tmp_path / "heads.png"))
    assert (tmp_path / "heads.png").stat().st_size > 0
