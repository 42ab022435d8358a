"""The adapters' structure: one adapter per model, settings as adapter state, the abstract
family contract, the one patch <-> pixel geometry, trace options and the derived views of
a family's features."""

from __future__ import annotations

import contextvars
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import captum_vit
from captum_vit._base import ViTFront, format_output
from captum_vit.adapters import (
    BLOCK_FEATURES,
    FAMILY_CONTRACT,
    Layout,
    SubnetworkAdapter,
    TargetHead,
    TraceOptions,
    ValuePath,
    ViTAdapter,
    adapt,
    grid_to_pixels,
    readout_alpha,
    tokens_to_grid,
)
from captum_vit.metrics.removal import patch_pixels, upsample
from captum_vit.viz import upsample_map
from tests.helpers import assert_close_scaled, make_inputs, make_model

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions


# -- one adapter per model -------------------------------------------------------------------
def test_adapt_memoises_one_adapter_per_model():
    model = make_model("vit")
    ad = adapt(model)
    assert adapt(model) is ad and adapt(ad) is ad
    assert adapt(make_model("vit")) is not ad  # another model object, another adapter


def test_adapt_rebuilds_on_refresh_and_replaced_parameters():
    model, x = make_model("vit"), make_inputs("vit")
    ad = adapt(model)
    fresh = adapt(model, refresh=True)
    assert fresh is not ad and adapt(model) is fresh
    # parameters replaced by new tensors (assign=True): the old views are stale
    state = {k: v.clone() * 1.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    rebuilt = adapt(model)
    assert rebuilt is not fresh
    with torch.no_grad():
        assert_close_scaled(rebuilt.run(rebuilt.embed(x)), model(x), 1e-10)
    # a dtype change replaces the storage too
    model.float()
    as_float = adapt(model)
    assert as_float is not rebuilt and as_float.dtype == torch.float32
    # an in-place update does not (the views see it)
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)
    assert adapt(model) is as_float


def test_adapt_holds_neither_model_nor_adapter():
    import gc
    import weakref

    model = make_model("vit")
    ref = weakref.ref(model)
    adapt(model)
    del model
    gc.collect()
    assert ref() is None


# -- settings are adapter state -------------------------------------------------------------
def test_no_module_level_context_variable_anywhere():
    """Settings are adapter state: no module of the package holds a context variable
    (the last one, how scores become probabilities, is ``ViTAdapter.probability``)."""
    import captum_vit

    names = ["captum_vit", *(m.name for m in pkgutil.walk_packages(captum_vit.__path__,
                                                                  "captum_vit."))]
    found = []
    for name in names:
        module = importlib.import_module(name)
        found += [f"{name}.{attr}" for attr, value in vars(module).items()
                  if isinstance(value, contextvars.ContextVar)]
    assert not found
    adapter_modules = [n for n in names if n.startswith("captum_vit.adapters")]
    for gone in ("_TARGETS", "_ALPHAS", "_FROZEN", "_CHECKED", "_PROBABILITY"):
        assert not any(hasattr(importlib.import_module(n), gone) for n in adapter_modules)


def test_the_probability_kind_is_state_of_each_model():
    """How scores become probabilities travels as adapter state: the target's kind under
    ``targeting``, ``probability_kind`` for a multi-label head; another model, another
    thread and the code after the block keep softmax; the functions take it explicitly."""
    import threading

    from captum_vit.adapters import TargetHead, log_probabilities, probabilities

    a, other = adapt(make_model("vit")), adapt(make_model("vit"))
    z = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    assert a.probability == "softmax"
    seen = {}
    with a.probability_kind("sigmoid"):
        assert a.probability == "sigmoid" and adapt(a.model).probability == "sigmoid"
        assert other.probability == "softmax"
        worker = threading.Thread(target=lambda: seen.update(kind=a.probability))
        worker.start()
        worker.join()
        assert_close_scaled(probabilities(z, a.probability), torch.sigmoid(z), 1e-15)
        assert_close_scaled(log_probabilities(z, a.probability),
                            torch.nn.functional.logsigmoid(z), 1e-15)
        with pytest.raises(ValueError, match="probability_kind|kind"):
            with a.probability_kind("tanh"):
                pass
    assert seen == {"kind": "softmax"} and a.probability == "softmax"
    assert_close_scaled(probabilities(z), z.softmax(-1), 1e-15)
    head = TargetHead(torch.randn(1, 8, dtype=torch.float64), probability="sigmoid")
    with a.targeting(head):
        assert a.probability == "sigmoid" and other.probability == "softmax"
    assert a.probability == "softmax"
    with pytest.raises(ValueError, match="kind must be 'softmax' or 'sigmoid'"):
        probabilities(z, "tanh")


def test_settings_are_restored_after_an_exception():
    model, x = make_model("vit"), make_inputs("vit")
    ad = adapt(model)
    target = TargetHead(torch.randn(2, 5, dtype=torch.float64), cosine=False)
    with pytest.raises(RuntimeError, match="boom"):
        with ad.targeting(target):
            assert ad.head.target is target and adapt(model).num_classes == 2
            with pytest.raises(KeyError):
                with ad.targeting(TargetHead(torch.randn(3, 5, dtype=torch.float64))):
                    assert ad.num_classes == 3
                    raise KeyError("inner")
            assert ad.head.target is target  # the outer target again
            raise RuntimeError("boom")
    assert ad.head.target is None and ad.num_classes == 5
    with pytest.raises(RuntimeError):
        with ad.state.override(frozen=True):
            assert ad.state.settings.frozen
            raise RuntimeError
    assert not ad.state.settings.frozen
    tr = ad.trace(x, grad=True)  # the gradient trace sets `frozen` only inside
    assert tr.logits.requires_grad and not ad.state.settings.frozen


def test_cls_alpha_is_adapter_state_seen_by_views():
    hf = pytest.importorskip("transformers")
    del hf
    from tests.helpers import make_hf_model

    model = make_hf_model("hf_dinov2")
    ad = adapt(model)
    view = SubnetworkAdapter(ad, 1)
    with readout_alpha(model, "logit"):
        assert ad.cls_alpha == "logit" and view.cls_alpha == "logit"
    assert ad.cls_alpha == 0.5 and view.cls_alpha == 0.5


def test_adapters_and_methods_can_be_deep_copied():
    import copy
    import pickle

    from captum_vit import GAE

    model, x = make_model("vit"), make_inputs("vit")
    method = GAE(model)
    ad = method.adapter
    with ad.targeting(TargetHead(torch.randn(2, 5, dtype=torch.float64))):
        clone = copy.deepcopy(method)
        assert clone.adapter.state is not ad.state
        assert clone.adapter.head.target is None  # the copy's settings start fresh
    assert torch.equal(clone.attribute(x, target=0), method.attribute(x, target=0))
    assert pickle.loads(pickle.dumps(ad.state)).settings == ad.state.settings


def test_settings_do_not_leak_into_other_threads():
    import threading

    model = make_model("vit")
    ad = adapt(model)
    seen = []
    with ad.targeting(TargetHead(torch.randn(2, 5, dtype=torch.float64))):
        t = threading.Thread(target=lambda: seen.append(ad.head.target))
        t.start()
        t.join()
    assert seen == [None]


def test_self_check_runs_once_per_model():
    model, x = make_model("nonsquare"), make_inputs("nonsquare")
    ad = adapt(model)
    calls = []
    original = ad.model_logits

    def counting(inputs):
        calls.append(1)
        return original(inputs)

    ad.model_logits = counting
    ad.self_check(x)
    adapt(model).self_check(x)
    SubnetworkAdapter(ad, 1).self_check(x)  # a view shares the model adapter's memo
    assert len(calls) == 1
    ad.self_check(x[:, :, :, :32])  # another input size: checked again
    assert len(calls) == 2


# -- the family contract ---------------------------------------------------------------------
def test_family_contract_is_abstract_and_documented():
    assert ViTAdapter.__abstractmethods__ == frozenset(FAMILY_CONTRACT)
    assert set(FAMILY_CONTRACT) == {"layout", "embed", "input_shape", "parameter_stages"}
    for name in FAMILY_CONTRACT:
        member = vars(ViTAdapter)[name]
        doc = (member.fget if isinstance(member, property) else member).__doc__
        assert doc and doc.strip(), name
        assert f":meth:`{name}`" in ViTAdapter.__doc__ or f":attr:`{name}`" in \
            ViTAdapter.__doc__, name

    class Incomplete(ViTAdapter):
        def layout(self, inputs):
            raise AssertionError

        @property
        def input_shape(self):
            return 3, (32, 32)

        def parameter_stages(self):
            return []

    with pytest.raises(TypeError, match="embed"):
        Incomplete()

    class Complete(Incomplete):
        def embed(self, inputs, ops=None):
            return inputs

    Complete()


def test_views_delegate_through_the_contract():
    ad = adapt(make_model("registers"))
    view = SubnetworkAdapter(ad, 1)
    assert view.state is ad.state
    assert (view.num_prefix, view.readout, view.in_chans, view.embedding) == \
        (ad.num_prefix, ad.readout, ad.in_chans, ad.embedding)


# -- the one geometry ------------------------------------------------------------------------
def _old_format_output(tokens, layout, images):
    gh, gw = layout.grid
    grid = tokens.reshape(tokens.shape[0], 1, gh, gw)
    ph, pw = layout.patch_size
    h, w = images.shape[-2:]
    pix = grid.repeat_interleave(ph, dim=2).repeat_interleave(pw, dim=3)[..., :h, :w]
    return pix.expand(-1, images.shape[1], -1, -1).contiguous()


def _old_upsample(scores, grid, patch_size, size, mode):
    b = scores.shape[0]
    g = scores.reshape(b, 1, *grid).double()
    full = (grid[0] * patch_size[0], grid[1] * patch_size[1])
    if mode == "nearest":
        up = g.repeat_interleave(patch_size[0], 2).repeat_interleave(patch_size[1], 3)
    else:
        up = F.interpolate(g, size=full, mode=mode, align_corners=False)
    return up[:, 0, :size[0], :size[1]]


@pytest.mark.parametrize("size", [(24, 40), (21, 37)])
def test_the_three_callers_use_the_one_geometry(size):
    layout = Layout(1, (3, 5), (8, 8), "token", 2, 4, size)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, 15, generator=g, dtype=torch.float64)
    images = torch.zeros(2, 3, *size, dtype=torch.float64)
    grid = tokens_to_grid(tokens, layout)
    pixels = grid_to_pixels(grid, size, patch_size=layout.patch_size)
    out = format_output(tokens, layout, images, "pixels")
    assert torch.equal(out, pixels.expand(-1, 3, -1, -1))
    assert torch.equal(out, _old_format_output(tokens, layout, images))
    for mode in ("nearest", "bilinear", "bicubic"):
        up = upsample(tokens, layout.grid, layout.patch_size, size, mode)
        assert torch.equal(up, grid_to_pixels(grid, size, patch_size=(8, 8), mode=mode)[:, 0])
        assert torch.equal(up, _old_upsample(tokens, layout.grid, layout.patch_size, size, mode))
    removed = tokens > 0
    masks = patch_pixels(removed, layout, size)
    assert masks.dtype == torch.bool
    assert torch.equal(masks, grid_to_pixels(removed.reshape(2, 3, 5), size, patch_size=(8, 8)))
    for display, mode in (("nearest", "nearest-exact"), ("bilinear", "bilinear")):
        shown = upsample_map(tokens[0].float(), size, grid=(3, 5), display=display)
        a = tokens[0].float().reshape(1, 1, 3, 5)
        old = F.interpolate(a, size=size, mode=mode) if mode == "nearest-exact" else \
            F.interpolate(a, size=size, mode=mode, align_corners=False)
        assert torch.equal(shown, old[0, 0])
        assert torch.equal(shown, grid_to_pixels(tokens[0].float().reshape(3, 5), size,
                                                 mode=display))


def test_grid_to_pixels_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode must be one of"):
        grid_to_pixels(torch.zeros(1, 2, 2), (4, 4), mode="area")


# -- trace options ---------------------------------------------------------------------------
def test_trace_options_and_keywords_agree():
    ad, x = adapt(make_model("vit")), make_inputs("vit")
    a = ad.trace(x, grad=True, attention="fused")
    b = ad.trace(x, options=TraceOptions(grad=True, attention="fused"))
    c = ad.trace(x, options=TraceOptions(grad=True), attention="fused")
    for t in (b, c):
        assert torch.equal(a.logits, t.logits)
        assert a.blocks[0].attn is None and t.blocks[0].heads is not None
    with pytest.raises(ValueError, match="attention must be"):
        TraceOptions(attention="flash")
    with pytest.raises(ValueError, match="last_rows"):
        ad.trace(x, last_rows=1, ops=captum_vit.adapters.Ops())
    with pytest.raises(TypeError):
        ad.trace(x, no_such_option=True)
    with pytest.raises(dataclasses_error()):
        TraceOptions().grad = True  # frozen


def dataclasses_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


# -- family features once --------------------------------------------------------------------
def test_value_path_is_the_inner_norm_rule():
    ad, x = adapt(make_model("eva02")), make_inputs("eva02")
    p = ad.blocks[0]
    assert "inner_norm" in p.features() and "mlp_norm" in p.features()
    rec = ad.trace(x).blocks[0]
    got = p.value_outputs(rec.u, rec.attn)
    # the rule written out: centred values, divided by the real output's std, times γ
    v = F.linear(rec.u, p.v_weight, p.v_bias)
    b, n, a = v.shape
    o = (rec.attn @ v.reshape(b, n, p.num_heads, p.head_dim).transpose(1, 2))
    o = o.transpose(1, 2).reshape(b, n, a)
    inv = torch.rsqrt(o.var(-1, unbiased=False, keepdim=True) + p.inner_norm.eps)
    want = F.linear((v - v.mean(-1, keepdim=True)) * inv * p.inner_norm.weight, p.proj_weight)
    assert_close_scaled(got, want, 1e-12)
    plain = adapt(make_model("vit")).blocks[0]
    path = plain.value_path()
    assert path.centre is None and path.weight is plain.proj_weight
    assert ValuePath.of(plain.proj_weight, None).inv_std(o) is None


def test_the_block_members_the_parts_module_names_are_in_use():
    """Every ``BlockParts`` member the parts module's design note names is read somewhere
    in the package outside ``parts.py`` (no documented refusal path nothing calls: the
    former ``BlockParts.refuse``); ``features()`` still names a block's features."""
    import re
    from pathlib import Path

    import captum_vit.adapters.parts as parts

    named = set(re.findall(r":meth:`BlockParts\.(\w+)`", parts.__doc__ or ""))
    assert {"value_path", "value_outputs"} <= named
    root = Path(parts.__file__).parents[1]
    text = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "parts.py")
    assert not [m for m in named if not re.search(rf"\.{m}\(", text)]
    assert not hasattr(parts.BlockParts, "refuse")
    eva = adapt(make_model("eva02")).blocks[0]
    assert set(eva.features()) <= set(BLOCK_FEATURES) and "inner_norm" in eva.features()
    assert adapt(make_model("vit")).blocks[0].features() == ()  # a plain block has none


# -- public surface --------------------------------------------------------------------------
def test_no_module_imports_a_private_adapters_module():
    root = Path(captum_vit.__file__).parent
    private = re.compile(r"(from|import)\s+captum_vit\.adapters\._\w+|"
                         r"from\s+captum_vit\.adapters\s+import\s+\(?\s*_")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "adapters" not in p.relative_to(root).parts[:1]
                 and private.search(p.read_text())]
    assert offenders == []


def test_front_is_public():
    from captum_vit import GAE

    assert isinstance(GAE(make_model("vit")), ViTFront)
