"""The ``Examples::`` blocks of the public API run, so that they cannot rot.

Every docstring of a public name of ``captum_vit``, ``captum_vit.targets`` and
``captum_vit.metrics`` (and of the methods their public classes define or inherit from the
package) that holds ``>>>`` lines is one test: its statements run in order, in a fresh
namespace that provides what the examples assume (``torch``, a tiny random 12-block timm ViT
as ``model``, ``images``/``x``, ``labels``, ``baseline``, ``masks``, ``patch_scores``). A
statement that raises fails the test, and so does a printed output that differs from the one
the docstring shows (compared as doctest does, with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``),
except in the blocks of ``FREE_OUTPUT``, whose outputs depend on the model's size. Blocks
that name what the common namespace lacks (a CLIP or SigLIP tower, a text model, a detector,
a depth model, a DINOv2-shaped backbone, a LLaVA or an Idefics3 and its processor, Quantus'
arrays) get tiny random models built for them (``EXTRA``); every block runs in a temporary
folder, and a block that registers a method removes it afterwards. A block that truly cannot
run offline would be listed in ``SKIP`` with the reason pytest prints; none is.
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

# block id -> why it does not run here (printed by pytest as the skip reason). Every
# block runs today: a block that needs what no offline fixture can give is listed here.
SKIP: dict[str, str] = {}


def _clip_scope() -> dict[str, Any]:
    """Tiny random CLIP and SigLIP vision towers (embedding size 32), a CLIP text model,
    pixel values and text-side vectors (what the CLIP / SigLIP examples name)."""
    import transformers

    torch.manual_seed(0)
    tower = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64)
    clip_vision = transformers.CLIPVisionModelWithProjection(
        transformers.CLIPVisionConfig(projection_dim=32, **tower)).eval()
    siglip_vision = transformers.SiglipVisionModel(
        transformers.SiglipVisionConfig(**tower)).eval()
    text = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, projection_dim=32)).eval()
    return {"clip_vision": clip_vision, "vision_model": clip_vision,
            "siglip_vision": siglip_vision, "clip_text_model": text,
            "tokens": {"input_ids": torch.randint(0, 100, (3, 8))},
            "pixel_values": torch.randn(2, 3, 32, 32),
            "text_embedding": torch.randn(32), "null_embedding": torch.randn(32),
            "class_text_embeds": torch.randn(5, 32), "text_embeds": torch.randn(5, 32)}


def _removal_scope() -> dict[str, Any]:
    """A model of 16 patches and 10 classes and four images, as the example's shapes say."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=24, depth=2, num_heads=3,
                              num_classes=10).eval()
    return {"model": model, "x": torch.randn(4, 3, 32, 32)}


def _quantus_scope() -> dict[str, Any]:
    """Quantus' arrays: the fixture's images and labels as NumPy."""
    pytest.importorskip("quantus")
    scope = namespace()
    return {"x_batch": scope["images"].numpy(), "y_batch": scope["labels"].numpy()}


def _dinov2_scope() -> dict[str, Any]:
    """A random DINOv2-S/14 shaped timm backbone (width 384, LayerScale, no head; 9 blocks,
    the examples read block 8) and two 224-pixel images: a 16 x 16 patch grid."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    dinov2 = VisionTransformer(img_size=224, patch_size=14, embed_dim=384, depth=9,
                               num_heads=6, init_values=1e-5, num_classes=0).eval()
    return {"dinov2": dinov2, "images": torch.randn(2, 3, 224, 224)}


def _depth_scope() -> dict[str, Any]:
    """A tiny random Depth Anything model (a DINOv2 backbone, patch 14) at 518 pixels."""
    import transformers

    backbone = transformers.Dinov2Config(
        image_size=518, patch_size=14, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=64, reshape_hidden_states=False,
        out_features=["stage1", "stage2", "stage3", "stage4"])
    torch.manual_seed(0)
    depth_model = transformers.DepthAnythingForDepthEstimation(transformers.DepthAnythingConfig(
        backbone_config=backbone, patch_size=14, neck_hidden_sizes=[8, 16, 16, 32],
        fusion_hidden_size=16, head_hidden_size=8, reassemble_hidden_size=32,
        reassemble_factors=[4, 2, 1, 0.5])).eval()
    return {"depth_model": depth_model, "pixel_values": torch.randn(1, 3, 518, 518)}


def _yolos_scope() -> dict[str, Any]:
    """A tiny random YOLOS detector: 10 detection queries, 20 classes, 32 x 48 images."""
    import transformers

    torch.manual_seed(0)
    yolos = transformers.YolosForObjectDetection(transformers.YolosConfig(
        image_size=[32, 48], patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=20,
        num_detection_tokens=10, use_mid_position_embeddings=False)).eval()
    return {"yolos": yolos, "images": torch.randn(2, 3, 32, 48)}


def _open_clip_scope() -> dict[str, Any]:
    """Two 224-pixel images for an OpenCLIP ViT-B/32 (the example builds the model)."""
    pytest.importorskip("open_clip")
    return {"images": torch.randn(2, 3, 224, 224)}


def _llava_scope() -> dict[str, Any]:
    """A tiny random LLaVA saved in the current folder (``path``), a processor built offline
    (a word-level tokenizer over the prompt's words, CLIP's image processor at 32 pixels:
    16 patches, the CLS row dropped as LLaVA's default strategy does) and a PIL image."""
    import numpy as np
    import transformers
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<image>", "USER", ":", "Colour", "?", "ASSISTANT", "red"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1)
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=32, patch_size=8),
        text_config=transformers.LlamaConfig(
            vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        image_token_id=words.index("<image>"))
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained("llava")
    pixels = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    return {"LlavaForConditionalGeneration": transformers.LlavaForConditionalGeneration,
            "path": "llava", "processor": processor, "image": Image.fromarray(pixels)}


def _idefics3_scope() -> dict[str, Any]:
    """A tiny random Idefics3 saved in the current folder (``path``: 32-pixel tiles, 4 image
    tokens each), its processor built offline (a word-level tokenizer with the tile tokens,
    the image processor splitting at 32 pixels) and a 40 x 70 PIL image (2 x 2 tiles)."""
    import numpy as np
    import transformers
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
               *[f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]]
    words = ["<unk>", "User", ":", "Colour", "?", "Assistant", "red", *special]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessor(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
        tokenizer=tokenizer, image_seq_len=4)
    torch.manual_seed(0)
    cfg = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(words), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0),
        image_token_id=words.index("<image>"), scale_factor=2)
    transformers.Idefics3ForConditionalGeneration(cfg).save_pretrained("idefics3")
    pixels = np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)
    return {"Idefics3ForConditionalGeneration": transformers.Idefics3ForConditionalGeneration,
            "path": "idefics3", "processor": processor, "image": Image.fromarray(pixels)}


def _sam_scope() -> dict[str, Any]:
    """A tiny random SAM saved in the current folder (``path``; 32-pixel images, an 8 x 8
    token grid), its processor at that size and an 800 x 1000 PIL image."""
    import numpy as np
    import transformers
    from PIL import Image

    cfg = transformers.SamConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                           image_size=32, patch_size=4, window_size=3, global_attn_indexes=[1],
                           output_channels=16, mlp_dim=64, num_pos_feats=8),
        prompt_encoder_config=dict(hidden_size=16, image_size=32, patch_size=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 mlp_dim=32, iou_head_hidden_dim=16))
    torch.manual_seed(0)
    transformers.SamModel(cfg).save_pretrained("sam")
    processor = transformers.SamProcessor(image_processor=transformers.SamImageProcessor(
        size={"longest_edge": 32}, pad_size={"height": 32, "width": 32},
        mask_size={"longest_edge": 8}, mask_pad_size={"height": 8, "width": 8}))
    pixels = np.random.default_rng(0).integers(0, 256, (800, 1000, 3), dtype=np.uint8)
    return {"SamModel": transformers.SamModel, "path": "sam", "processor": processor,
            "image": Image.fromarray(pixels)}


# block id -> what its example names beyond the common fixture (a function: the models are
# built only for the blocks that use them)
EXTRA: dict[str, Any] = {
    "LeGrad": _clip_scope,
    "EmbeddingTarget": _clip_scope,
    "targets:scoring": _clip_scope,
    "targets:read_target_embeddings": _clip_scope,
    "metrics:RemovalEngine.masked_logits": _removal_scope,
    "quantus_explain_func": _quantus_scope,
    "targets:HeadTarget": _dinov2_scope,
    "targets:TokenTarget": _dinov2_scope,
    "targets:DepthTarget": _depth_scope,
    "targets:DetectionTarget": _yolos_scope,
    "targets:clip_text_target": _open_clip_scope,
    "targets:VLMAnswer": _llava_scope,
    "targets:VLMAnswer.images": _idefics3_scope,
    "targets:SamMaskTarget": _sam_scope,
}

# block id -> names to remove from the method table after the block (its example
# registers a method; the other tests list the table)
REGISTERS = {"register_method": ("my_method",)}


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
    if block_id in EXTRA:
        scope.update(EXTRA[block_id]())
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
    stale = (set(SKIP) | set(FREE_OUTPUT) | set(EXTRA) | set(REGISTERS)) - set(ids)
    assert not stale, f"entries for no block: {stale}"


@pytest.mark.docs_build  # executed by CI's docs step (.ci/docs) with the rest of the docs
@pytest.mark.parametrize(("block_id", "doc"), BLOCKS, ids=[b for b, _ in BLOCKS])
def test_docstring_example_runs(block_id, doc, tmp_path, monkeypatch):
    if block_id in SKIP:
        pytest.skip(SKIP[block_id])
    monkeypatch.chdir(tmp_path)  # examples that save a file write it here
    monkeypatch.setenv("MPLBACKEND", "Agg")
    try:
        assert run_block(block_id, doc) > 0
    finally:
        if block_id in REGISTERS:
            from captum_vit.methods.table import lookup, unregister_method

            for name in REGISTERS[block_id]:
                if lookup(name) is not None:
                    unregister_method(name)


def test_a_failing_example_fails_its_block():
    """A block whose statement raises, or prints other than it shows, is a failure."""
    with pytest.raises(AssertionError, match="example line 1 failed"):
        run_block("raises", ">>> a = 1\n>>> 1 / 0\n")
    with pytest.raises(AssertionError, match="the docstring shows"):
        run_block("prints", ">>> print(2)\n3\n")
