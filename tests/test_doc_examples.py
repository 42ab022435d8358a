"""The ``Examples::`` blocks of the public API run, so that they cannot rot.

Every docstring of a public name of ``captum_vit``, ``captum_vit.targets`` and
``captum_vit.metrics`` (and of the methods their public classes define or inherit from the
package) that holds ``>>>`` lines is one test: its statements run in order, in a fresh
namespace that provides what the examples assume (``torch``, a tiny random 12-block timm ViT
as ``model``, ``images``/``x``, ``labels``, ``baseline``, ``masks``, ``patch_scores``). A
statement that raises fails the test, and so does a printed output that differs from the one
the docstring shows (compared as doctest does, with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``),
except in the blocks of ``FREE_OUTPUT``, whose outputs depend on the model's size. Blocks
that need what no fixture can give (a CLIP text model, a detector, a processor, a file,
Quantus) are listed in ``SKIP`` with the reason.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import inspect
import io
from typing import Any

import pytest
import torch

import captum_vit
import captum_vit.metrics
import captum_vit.targets

PUBLIC_MODULES = (captum_vit, captum_vit.targets, captum_vit.metrics)

# block id -> why it does not run here
SKIP = {
    "LeGrad": "needs a CLIP/SigLIP vision tower and text embeddings (clip_vision, "
              "pixel_values, text_embedding)",
    "EmbeddingTarget": "needs a CLIP text model and its tokens",
    "export_quantus": "needs Quantus and a data spec (data, lm)",
    "quantus_explain_func": "needs Quantus (x_batch, y_batch)",
    "register_method": "registers a method in the global registry (other tests list it)",
    "metrics:RemovalEngine.masked_logits": "written for a model of 16 patches and 10 classes "
                                           "(the fixture's model has 36 and 1000)",
    "metrics:plot_curves": "plots the curves of earlier results (rnd, ...)",
    "targets:DepthTarget": "needs a Hugging Face depth model",
    "targets:DetectionTarget": "needs a YOLOS detector",
    "targets:HeadTarget": "needs a DINOv2 backbone with a head",
    "targets:TokenTarget": "needs a DINOv2 backbone",
    "targets:SamMaskTarget": "needs a SamModel and its processor",
    "targets:VLMAnswer": "needs a LLaVA model and its processor",
    "targets:clip_text_target": "needs an OpenCLIP model at 224 pixels and its tokenizer",
    "targets:read_target_embeddings": "needs text embeddings written to a file",
    "targets:scoring": "needs a CLIP vision tower (clip_vision)",
}


# block id -> why its printed outputs are not compared
FREE_OUTPUT = {
    "RandomMap": "shows the 196 patches of a 224-pixel ViT-Ti/16; the fixture has 36",
}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _own_members(cls: type) -> list[tuple[str, Any]]:
    """The methods and properties of ``cls`` (its own or inherited) defined in captum_vit."""
    members = []
    for name in sorted(dir(cls)):
        if name.startswith("__"):
            continue
        value = inspect.getattr_static(cls, name)
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if callable(func) and getattr(func, "__module__", "").startswith("captum_vit"):
            members.append((name, func))
    return members


def collect() -> list[tuple[str, str]]:
    """``(block id, docstring)`` of every public docstring with ``>>>`` lines, each text once;
    a block of a subpackage is named ``subpackage:name``."""
    blocks: dict[str, str] = {}
    seen: set[str] = set()
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            prefix = "" if module is captum_vit else module.__name__.split(".")[-1] + ":"
            name = prefix + name
            found = [(name, inspect.getdoc(obj))]
            if inspect.isclass(obj):
                found += [(f"{name}.{attr}", inspect.getdoc(func))
                          for attr, func in _own_members(obj)]
            for block_id, doc in found:
                if doc and ">>>" in doc and doc not in seen:
                    seen.add(doc)
                    blocks[block_id] = doc
    return sorted(blocks.items())


BLOCKS = collect()


def namespace(block_id: str = "") -> dict[str, Any]:
    """What the examples assume: a tiny random timm ViT with 12 blocks (the examples name
    layers up to 11) and a batch of two images; for a subpackage's block, the public names of
    the package and of that subpackage too (its examples use them unimported, as a doctest
    runs in its module)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=48, patch_size=8, embed_dim=24, depth=12, num_heads=3,
                              num_classes=1000).eval()  # ImageNet's classes: examples name them
    images = torch.randn(2, 3, 48, 48)  # 36 patches: the examples remove up to 20
    masks = torch.zeros(2, 48, 48, dtype=torch.bool)
    masks[:, 4:20, 8:26] = True  # a ground-truth region, an eighth of the image
    scope = {"torch": torch, "model": model, "images": images, "x": images,
             "labels": torch.tensor([3, 7]), "baseline": torch.zeros_like(images),
             "masks": masks, "patch_scores": torch.rand(2, 36)}
    if ":" in block_id:
        for module in (captum_vit, importlib.import_module(
                f"captum_vit.{block_id.split(':')[0]}")):
            scope.update({name: getattr(module, name) for name in module.__all__})
    return scope


def run_block(block_id: str, doc: str) -> int:
    """Run the ``>>>`` statements of ``doc``; the number of statements run."""
    examples = doctest.DocTestParser().get_examples(doc, name=block_id)
    scope = namespace(block_id)
    checker = doctest.OutputChecker()
    for number, example in enumerate(examples):
        code = compile(example.source, f"<{block_id} example {number}>", "single")
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(code, scope)  # noqa: S102 - the package's own docstrings
        except Exception as error:  # the failing line, not only the traceback
            raise AssertionError(f"{block_id}: example line {number} failed:\n"
                                 f"{example.source}{type(error).__name__}: {error}") from error
        got = printed.getvalue()
        if example.want and block_id not in FREE_OUTPUT:
            assert checker.check_output(example.want, got, FLAGS), (
                f"{block_id}: example line {number} printed {got!r}, the docstring shows "
                f"{example.want!r}:\n{example.source}")
    return len(examples)


def test_examples_are_collected():
    ids = [block_id for block_id, _ in BLOCKS]
    assert len(ids) > 40 and "PLUS" in ids and "RawAttention.attribute" in ids
    stale = (set(SKIP) | set(FREE_OUTPUT)) - set(ids)
    assert not stale, f"entries for no block: {stale}"


@pytest.mark.parametrize(("block_id", "doc"), BLOCKS, ids=[b for b, _ in BLOCKS])
def test_docstring_example_runs(block_id, doc, capsys):
    if block_id in SKIP:
        pytest.skip(SKIP[block_id])
    assert run_block(block_id, doc) > 0
