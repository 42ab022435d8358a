"""Shared test helpers: small random timm ViTs of every supported family, the parity
fixture, a reference attention capture through timm's own forward, and a snapshot of
everything an attribution call must leave unchanged."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from captum_vit.adapters import catalog
from captum_vit.adapters.families._examples import randomize_  # noqa: F401  (tests use it)
from captum_vit.adapters.families.swin import hf_swin_twin  # noqa: F401  (tests use it)

FIXTURES = Path(__file__).parent / "fixtures"


def _have_fashion_mnist() -> bool:
    from captum_vit.data import load_fashion_mnist

    try:
        load_fashion_mnist("test")  # the loader's own root resolution (root, env, Debian)
    except FileNotFoundError:
        return False
    return True


needs_fashion_mnist = pytest.mark.skipif(
    not _have_fashion_mnist(), reason="Debian package dataset-fashion-mnist not installed")

def _examples(keep) -> dict[str, catalog.Example]:
    """The catalogue's examples (name -> Example) for which ``keep(tags, example)``, but
    the support matrix's own columns (tag ``matrix``)."""
    return {name: ex for name, fam, ex in catalog.examples()
            if "matrix" not in fam.example_tags(name) and keep(fam.example_tags(name), ex)}


def classifier_families() -> list[str]:
    """The contract suite's classifier examples (integer targets), read from the catalogue
    now (a family registered in a test takes part)."""
    return list(_examples(lambda tags, ex: ex.suite and ex.target == "class"))


def embedding_families() -> list[str]:
    """The contract suite's embedding examples (vector targets), read from the catalogue."""
    return list(_examples(lambda tags, ex: ex.suite and ex.target == "embedding"))


def windowed_families() -> list[str]:
    """Every example with windowed attention (tag ``windowed``: no true token removal)."""
    return list(_examples(lambda tags, ex: "windowed" in tags))


# The tables below are views of the family catalogue (captum_vit.adapters.catalog):
# example name -> Example, selected by library and tags (never by family name).
FAMILIES = _examples(lambda tags, ex: "reference" in tags)
"""timm VisionTransformer examples the per-method references read (tag ``reference``)."""
OTHER_FAMILIES = _examples(lambda tags, ex: ex.library == "timm" and "reference" not in tags
                           and "hierarchical" not in tags)
"""The other timm examples (BEiT, Eva, attention pools, SAM, head-less)."""
TIMM_EMBED_FAMILIES = _examples(lambda tags, ex: ex.library == "timm"
                                and ex.target == "embedding")
"""timm models built with num_classes=0: the pooled embedding, vector targets."""
HF_FAMILIES = _examples(lambda tags, ex: ex.library == "transformers" and "video" not in tags
                        and "hierarchical" not in tags)
"""Hugging Face image models built from a config (classifiers, towers, backbones, SAM)."""
EMBED_FAMILIES = _examples(lambda tags, ex: ex.library == "transformers" and ex.suite
                           and ex.target == "embedding" and "video" not in tags
                           and "hierarchical" not in tags)
"""Hugging Face models that output an image embedding (the contract suite's)."""
TORCHVISION_FAMILIES = _examples(lambda tags, ex: ex.library == "torchvision")
OPEN_CLIP_FAMILIES = _examples(lambda tags, ex: ex.library == "open_clip")
VIDEO_FAMILIES = _examples(lambda tags, ex: "video" in tags and ex.suite)
HF_VIDEO_EXTRA = _examples(lambda tags, ex: "video" in tags and not ex.suite)
SWIN_FAMILIES = _examples(lambda tags, ex: "hierarchical" in tags and ex.library == "timm")
HF_SWIN_FAMILIES = _examples(lambda tags, ex: "hierarchical" in tags
                             and ex.library == "transformers")
"""Hugging Face Swin classifiers: the timm SWIN_FAMILIES' twins (weights mapped)."""
SAM_FAMILIES = tuple(_examples(lambda tags, ex: "windowed" in tags
                               and "hierarchical" not in tags and "video" not in tags))
"""SAM's image encoder (windowed attention): timm's classifier, Hugging Face's embedding."""


def embedding_dim(model: nn.Module) -> int:
    """The image-embedding size of an EMBEDDING_FAMILIES model."""
    if type(model).__module__.startswith("open_clip."):
        visual = getattr(model, "visual", model)
        return int(visual.transformer.width if visual.proj is None else visual.proj.shape[1])
    if not hasattr(model, "config"):  # timm, num_classes=0
        return int(model.num_features)
    cfg = model.config
    if hasattr(cfg, "output_channels"):  # SAM: the neck's channels
        return int(cfg.output_channels)
    return int(getattr(cfg, "projection_dim", 0) if hasattr(model, "visual_projection")
               else cfg.hidden_size)


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_transformers = pytest.mark.skipif(not have_transformers(),
                                        reason="the hf extra (transformers) is not installed")
def have_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchvision = pytest.mark.skipif(not have_torchvision(),
                                       reason="torchvision is not installed")
def have_open_clip() -> bool:
    try:
        import open_clip  # noqa: F401
    except ImportError:
        return False
    return True


needs_open_clip = pytest.mark.skipif(not have_open_clip(),
                                     reason="the openclip extra (open_clip_torch) is not installed")
ALL_FAMILIES = classifier_families()
"""Every classifier example of the contract suite (timm, Hugging Face, torchvision, videos,
windowed)."""
WINDOWED_FAMILIES = windowed_families()
"""The examples with windowed attention (no true token removal, see WINDOW_REFUSERS)."""
TOKEN_FAMILIES = [f for f in ALL_FAMILIES if f not in WINDOWED_FAMILIES]
"""Every classifier example whose tokens can be removed (global attention)."""
EMBEDDING_FAMILIES = embedding_families()
"""Every contract-suite example that outputs an image embedding."""


from captum_vit.registry import method_entries, windowed_methods  # noqa: E402

WINDOW_REFUSERS = set(windowed_methods(refused=True))
"""Methods that refuse windowed models (Swin, SAM) by name: those declaring
``removes_tokens`` (TIS; use RISE or ViT-CX), read from the registry."""


VIDEO_WINDOW_REFUSERS = {"rise", "vit_cx"}
"""Methods whose masks of a video are over tokens (true token removal): they refuse a video
model with windowed attention (TimeSformer's divided space-time) by name."""

SLOT_REFUSERS = {e.name for e in method_entries()
                 if getattr(e.cls, "reads_window_slots", False)}
"""Methods that read a windowed block slot by slot (``reads_window_slots``: BT-H, BT-T,
TAM, GlobEnc, ALTI): an example tagged ``shared_windows`` (windows that share a token)
refuses them by name; compositions over them too."""


def refuses_shared_windows(method: str) -> bool:
    """Whether ``method`` (a name or a composition ``plus:<base>``) reads window slots."""
    return method.split(":")[-1] in SLOT_REFUSERS


_NEEDS = {"transformers": "needs_transformers", "torchvision": "needs_torchvision",
          "open_clip": "needs_open_clip"}


def family_marks(family: str, method: str | None = None) -> tuple:
    """pytest marks of an example: one of an optional library skips without it; a method
    that refuses windowed models by name (``method`` in :data:`WINDOW_REFUSERS` on an
    example tagged ``windowed``) is expected to raise its ValueError (strict: a test that
    passes anyway must not take this mark; pass no ``method`` and expect the refusal in the
    test)."""
    try:
        fam, ex = catalog.example(family)
    except ValueError:
        return ()
    marks: tuple = (globals()[_NEEDS[ex.library]],) if ex.library in _NEEDS else ()
    tags = fam.example_tags(family)
    if "shared_windows" in tags and method is not None and refuses_shared_windows(method):
        marks += (pytest.mark.xfail(raises=ValueError, strict=True,
                                    reason=f"{method} refuses windows that share a token"),)
    if "windowed" in tags and "video" in tags and method in VIDEO_WINDOW_REFUSERS:
        marks += (pytest.mark.xfail(raises=ValueError, strict=True,
                                    reason=f"{method} refuses windowed video models by name"),)
    if "windowed" in tags and method in WINDOW_REFUSERS:
        marks += (pytest.mark.xfail(raises=ValueError, strict=True,
                                    reason=f"{method} refuses windowed models by name"),)
    elif "pooling" in fam.example_tags(family) and method is not None \
            and not pools_queries(method, family):
        marks += (pytest.mark.xfail(raises=ValueError, strict=True,
                                    reason=f"{method} refuses query pooling by name"),)
    return marks


_POOLS: dict[tuple[str, str], bool] = {}


def pools_queries(method: str, family: str) -> bool:
    """Whether ``method`` (a registry name, compositions included) runs through the query
    pooling of the example ``family`` (its ``pools_queries`` declaration, read from the
    method built on the example; methods reading token-mixing matrices refuse by name)."""
    key = (method, family)
    if key not in _POOLS:
        from captum_vit.registry import build_method

        _POOLS[key] = bool(getattr(build_method(method, make_model(family)), "pools_queries",
                                   False))
    return _POOLS[key]


def make_model(family: str = "vit", *, seed: int = 0, depth: int = 3,
               dtype: torch.dtype = torch.float64, num_classes: int = 5) -> nn.Module:
    """A small random model of the catalogue's example ``family``, eval mode."""
    return catalog.example(family)[1].model(seed=seed, depth=depth, dtype=dtype,
                                            num_classes=num_classes)


def make_hf_model(family: str, *, seed: int = 0, depth: int = 3,
                  dtype: torch.dtype = torch.float64, num_classes: int = 5) -> nn.Module:
    """A small random Hugging Face model of ``family`` (see HF_FAMILIES), eval mode."""
    return make_model(family, seed=seed, depth=depth, dtype=dtype, num_classes=num_classes)


def make_torchvision_model(family: str = "torchvision", *, seed: int = 0, depth: int = 3,
                           dtype: torch.dtype = torch.float64, num_classes: int = 5,
                           **overrides) -> nn.Module:
    """A small random torchvision ``VisionTransformer`` of ``family``; ``overrides`` go to
    the constructor (e.g. ``representation_size=7``)."""
    return catalog.example(family)[1].model(seed=seed, depth=depth, dtype=dtype,
                                            num_classes=num_classes, **overrides)


def make_open_clip_model(family: str = "open_clip", *, seed: int = 0, depth: int = 3,
                         dtype: torch.dtype = torch.float64, **overrides) -> nn.Module:
    """A small random OpenCLIP model of ``family`` (the dual ``open_clip.CLIP`` or its
    ``visual`` tower); ``overrides`` go to the vision config (``embed_dim`` to the model)."""
    pytest.importorskip("open_clip")
    return catalog.example(family)[1].model(seed=seed, depth=depth, dtype=dtype, **overrides)


def make_video_model(family: str = "hf_videomae", *, seed: int = 0, depth: int = 3,
                     dtype: torch.dtype = torch.float64, num_classes: int = 5,
                     **overrides) -> nn.Module:
    """A small random Hugging Face VideoMAE of ``family``; ``overrides`` go to the
    ``VideoMAEConfig`` (e.g. ``tubelet_size=1``)."""
    return catalog.example(family)[1].model(seed=seed, depth=depth, dtype=dtype,
                                            num_classes=num_classes, **overrides)


def make_swin_model(family: str = "timm_swin", *, seed: int = 0, depths: tuple = (2, 2),
                    dtype: torch.dtype = torch.float64, num_classes: int = 5,
                    **overrides) -> nn.Module:
    """A small random timm ``SwinTransformer`` of ``family`` (patch 4, width 16, heads
    (2, 4)), eval mode; ``overrides`` go to the constructor."""
    return catalog.example(family)[1].model(seed=seed, dtype=dtype, num_classes=num_classes,
                                            depths=depths, **overrides)


def make_inputs(family: str = "vit", batch: int = 3, *, seed: int = 1,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random inputs of the example ``family`` (videos ``[B, T, C, H, W]``)."""
    return catalog.example(family)[1].inputs(batch, seed=seed, dtype=dtype)


def load_parity():
    """The parity fixture (config A): model (float64, eval), x, targets, logits, maps, meta."""
    meta = json.loads((FIXTURES / "meta.json").read_text())
    model = VisionTransformer(**meta["model"]["kwargs"])
    model.load_state_dict(load_file(str(FIXTURES / "model.safetensors")), strict=True)
    model = model.double().eval()
    inp = load_file(str(FIXTURES / "inputs.safetensors"))
    maps = load_file(str(FIXTURES / "maps.safetensors"))
    return model, inp["x"], inp["targets"], inp["logits"], maps, meta


def _is_tensor_sequence(value) -> bool:
    """A tuple or list holding tensors (or ``None``), not a list of numbers."""
    return isinstance(value, tuple | list) and any(
        v is None or isinstance(v, torch.Tensor | tuple | list) for v in value)


def assert_close_scaled(actual, expected, rel: float = 1e-12, scale: float | None = None,
                        msg: str | None = None, check_dtype: bool = True) -> None:
    """``max|actual - expected| <= rel * max(scale, max|expected|)``, rtol 0.

    For two DIFFERENT computations of one quantity (a fast path and a generic one, a batch
    and its images one by one, our code and a reference): which GEMM / softmax / reduction
    kernels run depends on the processor, the thread count and the shapes, so their last
    bits may differ. The allowed difference follows the scale of the quantity, the largest
    magnitude of ``expected`` over the whole tensor, or ``scale`` where that is larger (a
    map that is itself rounding-sized, e.g. ~1e-7 on a model whose logits are O(1), is
    compared at the logits' scale). float64: ``rel = 1e-12`` (a few thousand ulps) is the
    norm; float32: ~1e-5. A NaN fails; infinities must be equal. Tuples and lists of
    tensors are compared item by item (``None`` only with ``None``), each at its own scale.
    Set ``CAPTUM_VIT_TEST_TOLERANCE_LOG=FILE`` to append each comparison's largest
    difference and allowed one to FILE (tab-separated: test id, calling line, msg,
    difference, allowed, rel).
    """
    where = f"{msg}: " if msg else ""
    if _is_tensor_sequence(actual) or _is_tensor_sequence(expected):
        assert isinstance(actual, tuple | list) and isinstance(expected, tuple | list) \
            and len(actual) == len(expected), f"{where}{type(actual)} vs {type(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if a is None or e is None:
                assert a is None and e is None, f"{where}item {i}: {a!r} vs {e!r}"
            else:
                assert_close_scaled(a, e, rel, scale, f"{msg or ''}[{i}]", check_dtype)
        return
    a = torch.as_tensor(actual).detach().cpu()
    e = torch.as_tensor(expected).detach().cpu()
    assert a.shape == e.shape, f"{where}shape {tuple(a.shape)} != {tuple(e.shape)}"
    if check_dtype:
        assert a.dtype == e.dtype, f"{where}dtype {a.dtype} != {e.dtype}"
    a, e = a.double(), e.double()
    finite = torch.isfinite(e)
    assert not (a.isnan().any() or e.isnan().any()), f"{where}NaN"
    assert torch.equal(a[torch.isinf(e)], e[torch.isinf(e)]), f"{where}infinities differ"
    a, e = a[finite], e[finite]
    big = e.abs().max().item() if e.numel() else 0.0
    ref_scale = max(big, float(scale or 0.0))
    allowed = rel * ref_scale
    err = (a - e).abs().max().item() if e.numel() else 0.0
    log = os.environ.get("CAPTUM_VIT_TEST_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back  # the calling test's line
        site = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        with open(log, "a") as f:
            f.write(f"{test}\t{site}\t{msg or ''}\t{err:.3g}\t{allowed:.3g}\t{rel:g}\n")
    assert err <= allowed, (
        f"{where}largest |difference| {err:.3g} > allowed {allowed:.3g} "
        f"(= {rel:g} x scale {ref_scale:.3g})")


def assert_close_to_reference(actual: torch.Tensor, reference: torch.Tensor,
                              rel: float = 1e-8) -> None:
    """``max|actual - reference| <= rel * max|reference|`` (fixture tolerance style)."""
    assert_close_scaled(actual, reference, rel=rel, check_dtype=False)


class ReferenceCapture:
    """Attention probabilities [B, H, N, N] and their gradients captured through timm's
    OWN forward (on a deep copy with fused attention switched off), independent of the
    adapter. Use ``refs = ReferenceCapture(model)``; ``logits = refs(x)``; ``refs.attn``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.attn: list[torch.Tensor] = []
        self.block_inputs: list[torch.Tensor] = []
        for blk in self.model.blocks:
            blk.attn.fused_attn = False
            blk.attn.attn_drop.register_forward_hook(self._grab_attn)
            blk.register_forward_pre_hook(self._grab_input)

    def _grab_attn(self, module, args, out):
        out.retain_grad()
        self.attn.append(out)

    def _grab_input(self, module, args):
        args[0].retain_grad()
        self.block_inputs.append(args[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.attn.clear()
        self.block_inputs.clear()
        return self.model(x)


def snapshot(model: nn.Module) -> dict:
    """Everything an attribution call must leave unchanged (a Hugging Face model's config,
    attention implementation included, too)."""
    state = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        state["config"] = (config.to_dict(), getattr(config, "_attn_implementation", None))
    for name, p in model.named_parameters():
        state[f"param:{name}"] = (p.detach().clone(), p.requires_grad,
                                  None if p.grad is None else p.grad.clone())
    for name, b in model.named_buffers():
        state[f"buffer:{name}"] = b.clone()
    for name, m in model.named_modules():
        hooks = tuple(len(getattr(m, h, {})) for h in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
            "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"))
        flags = {k: v for k, v in vars(m).items() if isinstance(v, bool | int | float | str)}
        state[f"module:{name}"] = (type(m), m.training, hooks, flags)
    return state


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if key.startswith("param:"):
            assert torch.equal(old[0], new[0]), f"{key} value changed"
            assert old[1] == new[1], f"{key} requires_grad changed"
            assert (old[2] is None) == (new[2] is None), f"{key} .grad changed"
            if old[2] is not None:
                assert torch.equal(old[2], new[2]), f"{key} .grad changed"
        elif key.startswith("buffer:"):
            assert torch.equal(old, new), f"{key} changed"
        else:
            assert old == new, f"{key} changed: {old} -> {new}"


class TokenNames:
    """A tokenizer stand-in for ``VLMAnswer(..., tokenizer=)``: token ``i`` reads ``<i>``."""

    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def assert_token_maps_sum(model, method, x, ids, answer) -> None:
    """``per_token_maps`` of ``method`` on a 3-token ``answer`` for two images: labelled by
    the tokenizer, non-constant, summing to the whole answer's map (float64, ≤ 1e-10), and
    the default column of the per-token target is the whole answer's map."""
    from captum_vit.targets import VLMAnswer
    from captum_vit.targets.vlm import per_token_maps

    target = VLMAnswer(model, ids, answer, per_token=True, tokenizer=TokenNames())
    assert target.labels == [[f"<{int(t)}>" for t in answer]]
    maps = per_token_maps(method, x, target, output="tokens")
    whole = method.attribute(x, target=VLMAnswer(model, ids, answer), output="tokens")
    assert maps.shape == (2, len(answer), *whole.shape[1:])
    assert (maps.flatten(2).std(2) > 0).all()
    assert_close_scaled(maps.sum(1), whole, rel=1e-10)
    assert_close_scaled(method.attribute(x, target=target, output="tokens"), whole, rel=1e-12)
