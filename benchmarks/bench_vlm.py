"""Explaining a VLM's answer: speed and peak memory against the VLM's own forward+backward.

One random mid-size VLM per family (float32, CPU), built from a config: a vision tower of
12 blocks of width 512 (8 heads, MLP 2,048 unless the family fixes it) at about 1,024 tower
tokens and a 4-layer language model of width 512; a short question around the image
tokens and a 4-token answer. The score is the answer's log-probability
(:class:`captum_vit.targets.VLMAnswer`). ``--model``:

- ``qwen2``: Qwen2-VL, patch 14, merge 2, one 448 px image = 32 × 32 = 1,024 patches
  (256 image tokens);
- ``qwen2_5``: Qwen2.5-VL the same size (RMSNorm, SwiGLU MLP of 1,376, windows of 112 px =
  8 × 8 patches, every fourth block global);
- ``qwen3``: Qwen3-VL, patch 16, merge 2, one 512 px image = 1,024 patches, deepstack
  blocks 3, 6 and 9, a 48 × 48 position table (interpolated);
- ``internvl``: InternVL (InternViT tower with CLS and LayerScale, 448 px tile, patch 14 =
  1,024 patches, pixel shuffle to 256 image tokens; a Qwen2 language model);
- ``gemma3``: Gemma 3 (SigLIP tower without head at its configured 448 px, patch 14 =
  1,024 patches, pooled 2 × 2 to 256 image tokens; a Gemma 3 language model);
- ``idefics3``: Idefics3 (SigLIP tower, 4 tiles of 256 px, patch 16 = 4 × 256 patches,
  pixel shuffle by 2 to 64 tokens a tile; a Llama);
- ``onevision``: LLaVA-OneVision (SigLIP tower without head, 224 px crops, patch 14; one
  448 px image = 2 × 2 crops + the base image = 5 × 256 = 1,280 patches, unpadded and
  packed by the model; a Qwen2);
- ``llava``: LLaVA (CLIP tower at 448 px, patch 14 = 1,024 patches + CLS, the
  second-to-last block read; a Llama).

Measured:

- **Speed** (``--speed``): each method timed alternately with the reference, one
  forward+backward of the whole VLM to the pixels through its own forward (SDPA attention),
  CPU clock of this process (``time.process_time``), median of the per-pair ratios.
- **Memory** (default): every call in a FRESH process (``--child``) that builds the model and
  the inputs, reads its resident set, runs one call and reports the peak resident set
  (``ru_maxrss``) minus that baseline; the reference is the VLM's own forward+backward with
  SDPA attention, and with ``eager`` attention beside it (what issue threads resort to for
  attention weights). Goal: peak ≤ 1.3 × the SDPA forward+backward.

Run from the repository root (``PYTHONPATH=.``)::

    python benchmarks/bench_vlm.py --model internvl [--speed] [--threads 2]

A quick check of a builder: ``--depth 2 --img-size small`` (a small image / tile).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

IMAGE, START, END = 999, 997, 998
METHODS = ("vanilla_grad", "token_ixg", "gae", "attnlrp", "decompx")
SDPA, EAGER = "VLM forward+backward (sdpa)", "VLM forward+backward (eager)"
QUESTION = [*range(10, 18)]
ANSWER = torch.tensor([30, 31, 32, 33])
TEXT = dict(vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=512, intermediate_size=2048,
              num_attention_heads=8, vision_use_head=False)


@dataclass
class Case:
    """A built model, the explained images ``x``, ``score(x)`` through the VLM's own forward
    (``[1]``), the :class:`VLMAnswer` and a small image for the adapter's self-check."""

    model: torch.nn.Module
    x: torch.Tensor
    score: Callable[[torch.Tensor], torch.Tensor]
    target: Any
    check: torch.Tensor


def _logp(logits: torch.Tensor) -> torch.Tensor:
    lp = logits[0, -len(ANSWER) - 1:-1].log_softmax(-1)
    return lp.gather(-1, ANSWER[:, None]).sum()[None]


def _image(side: int, tiles: int = 1) -> torch.Tensor:
    return torch.randn(tiles, 3, side, side, generator=torch.Generator().manual_seed(0))


def _finish(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    model = model.eval()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


# -- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: one packed image ---------------------------------------
def _qwen(kind: str, depth: int, attn: str, small: bool) -> Case:
    import transformers

    from captum_vit.adapters import adapt
    from captum_vit.targets import VLMAnswer

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [8, 12, 12]}
    text = dict(TEXT, bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    ids = dict(image_token_id=IMAGE, video_token_id=996, vision_start_token_id=START,
               vision_end_token_id=END)
    patch = 16 if kind == "qwen3" else 14
    if kind == "qwen2":
        vision = dict(depth=depth, embed_dim=512, num_heads=8, mlp_ratio=4, hidden_size=512,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg = transformers.Qwen2VLConfig(vision_config=vision, text_config=text, **ids)
        cls = transformers.Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5":
        vision = dict(depth=depth, hidden_size=512, intermediate_size=1376, num_heads=8,
                      out_hidden_size=512, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=list(range(3, depth, 4)) or [depth - 1])
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, **ids)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        deep = sorted({depth // 4, depth // 2, 3 * depth // 4})
        vision = dict(depth=depth, hidden_size=512, intermediate_size=2048, num_heads=8,
                      out_hidden_size=512, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, hidden_act="gelu_pytorch_tanh",
                      num_position_embeddings=2304, deepstack_visual_indexes=deep)
        rope["mrope_interleaved"] = True
        text.update(head_dim=64)
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text, **ids)
        cls = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    model = _finish(cls(cfg), attn)
    side = patch * (8 if small else 32)
    x = _image(side)
    prompt = torch.tensor([1, 5, 6, START, *[IMAGE] * (side // (2 * patch)) ** 2, END,
                           *QUESTION])
    seq = torch.cat([prompt, ANSWER])[None]
    tower = adapt(VLMAnswer.tower(model))
    grid = torch.tensor([[1, side // patch, side // patch]])

    def score(z: torch.Tensor) -> torch.Tensor:
        return _logp(model(input_ids=seq, pixel_values=tower.pack(z), image_grid_thw=grid,
                           mm_token_type_ids=(seq == IMAGE).int(), use_cache=False).logits)

    return Case(model, x, score, VLMAnswer(model, prompt, ANSWER), _image(4 * patch))


# -- InternVL: one 448 px tile --------------------------------------------------------------
def _internvl(depth: int, attn: str, small: bool) -> Case:
    import transformers

    from captum_vit.targets import VLMAnswer

    side = 112 if small else 448
    vision = dict(model_type="internvl_vision", hidden_size=512, num_hidden_layers=depth,
                  num_attention_heads=8, intermediate_size=2048, image_size=side,
                  patch_size=14, attention_bias=True)
    tokens = (side // 28) ** 2
    cfg = transformers.InternVLConfig(vision_config=vision,
                                      text_config=dict(TEXT, model_type="qwen2"),
                                      image_token_id=IMAGE, image_seq_length=tokens)
    torch.manual_seed(0)
    model = _finish(transformers.InternVLForConditionalGeneration(cfg), attn)
    prompt = torch.tensor([1, 5, 6, START, *[IMAGE] * tokens, END, *QUESTION])
    seq = torch.cat([prompt, ANSWER])[None]

    def score(z: torch.Tensor) -> torch.Tensor:
        return _logp(model(input_ids=seq, pixel_values=z, use_cache=False).logits)

    return Case(model, _image(side), score, VLMAnswer(model, prompt, ANSWER), _image(56))


# -- Gemma 3: SigLIP at its configured size, pooled ----------------------------------------
def _gemma3(depth: int, attn: str, small: bool) -> Case:
    import transformers

    from captum_vit.targets import VLMAnswer

    side = 112 if small else 448
    tokens = (side // 28) ** 2  # 2 × 2 average pooling of the patch grid
    text = dict(TEXT, model_type="gemma3_text", head_dim=64, sliding_window=512)
    cfg = transformers.Gemma3Config(
        vision_config=dict(SIGLIP, num_hidden_layers=depth, image_size=side, patch_size=14),
        text_config=text, mm_tokens_per_image=tokens, image_token_id=IMAGE,
        boi_token_id=START, eoi_token_id=END)
    torch.manual_seed(0)
    model = _finish(transformers.Gemma3ForConditionalGeneration(cfg), attn)
    with torch.no_grad():  # initialised to zeros: the answer would not read the image
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor([1, 5, 6, START, *[IMAGE] * tokens, END, *QUESTION])
    seq = torch.cat([prompt, ANSWER])[None]

    def score(z: torch.Tensor) -> torch.Tensor:
        return _logp(model(input_ids=seq, pixel_values=z, token_type_ids=(seq == IMAGE).long(),
                           use_cache=False).logits)

    return Case(model, _image(side), score, VLMAnswer(model, prompt, ANSWER), _image(56))


# -- Idefics3: 4 tiles, pixel shuffle ------------------------------------------------------
def _idefics3(depth: int, attn: str, small: bool) -> Case:
    import transformers

    from captum_vit.targets import VLMAnswer

    side, tiles = (64, 2) if small else (256, 4)
    vision = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=depth,
                  num_attention_heads=8, image_size=side, patch_size=16)
    cfg = transformers.Idefics3Config(
        vision_config=vision, text_config=dict(TEXT, model_type="llama", pad_token_id=0),
        image_token_id=IMAGE, scale_factor=2)
    torch.manual_seed(0)
    model = _finish(transformers.Idefics3ForConditionalGeneration(cfg), attn)
    per_tile = (side // 16) ** 2 // 4
    ids = torch.tensor([[1, 5, 6, *[IMAGE] * (tiles * per_tile), *QUESTION]])
    mask = torch.ones(1, tiles, side, side, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": _image(side, tiles)[None], "pixel_attention_mask": mask}
    target = VLMAnswer(model, batch, ANSWER)
    seq = torch.cat([ids[0], ANSWER])[None]

    def score(z: torch.Tensor) -> torch.Tensor:
        return _logp(model(input_ids=seq, pixel_values=z[None], pixel_attention_mask=mask,
                           use_cache=False).logits)

    return Case(model, target.images(), score, target, _image(64))


# -- LLaVA-OneVision: anyres crops + the base image, packed by the model --------------------
def _onevision(depth: int, attn: str, small: bool) -> Case:
    import transformers

    from captum_vit.targets import VLMAnswer

    crop = 56 if small else 224
    pins = [[crop, crop], [crop, 2 * crop], [2 * crop, crop], [2 * crop, 2 * crop]]
    cfg = transformers.LlavaOnevisionConfig(
        vision_config=dict(SIGLIP, num_hidden_layers=depth, image_size=crop, patch_size=14),
        text_config=dict(TEXT, model_type="qwen2"), image_token_id=IMAGE,
        image_grid_pinpoints=pins)
    torch.manual_seed(0)
    model = _finish(transformers.LlavaOnevisionForConditionalGeneration(cfg), attn)
    sizes = torch.tensor([[2 * crop, 2 * crop]])
    px = _image(crop, 5)[None]  # 2 × 2 crops + the base image
    with torch.no_grad():
        n = len(model.model.get_image_features(px, sizes).pooler_output[0])
    ids = torch.tensor([[1, 5, 6, *[IMAGE] * n, *QUESTION]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": px,
             "image_sizes": sizes, "batch_num_images": torch.ones(1, dtype=torch.long)}
    target = VLMAnswer(model, batch, ANSWER)
    seq = torch.cat([ids[0], ANSWER])[None]

    def score(z: torch.Tensor) -> torch.Tensor:
        return _logp(model(input_ids=seq, pixel_values=z[None], image_sizes=sizes,
                           use_cache=False).logits)

    return Case(model, target.images(), score, target, _image(56))


# -- LLaVA: CLIP at 448 px ------------------------------------------------------------------
def _llava(depth: int, attn: str, small: bool) -> Case:
    import transformers

    from captum_vit.targets import VLMAnswer

    side = 112 if small else 448
    vision = dict(model_type="clip_vision_model", hidden_size=512, intermediate_size=2048,
                  num_hidden_layers=depth, num_attention_heads=8, image_size=side,
                  patch_size=14)
    cfg = transformers.LlavaConfig(vision_config=vision,
                                   text_config=dict(TEXT, model_type="llama"),
                                   image_token_id=IMAGE, image_seq_length=(side // 14) ** 2)
    torch.manual_seed(0)
    model = _finish(transformers.LlavaForConditionalGeneration(cfg), attn)
    prompt = torch.tensor([1, 5, 6, *[IMAGE] * (side // 14) ** 2, *QUESTION])
    seq = torch.cat([prompt, ANSWER])[None]

    def score(z: torch.Tensor) -> torch.Tensor:
        return _logp(model(input_ids=seq, pixel_values=z, use_cache=False).logits)

    return Case(model, _image(side), score, VLMAnswer(model, prompt, ANSWER), _image(56))


MODELS: dict[str, Callable[[int, str, bool], Case]] = {
    "qwen2": lambda d, a, s: _qwen("qwen2", d, a, s),
    "qwen2_5": lambda d, a, s: _qwen("qwen2_5", d, a, s),
    "qwen3": lambda d, a, s: _qwen("qwen3", d, a, s),
    "internvl": _internvl, "gemma3": _gemma3, "idefics3": _idefics3,
    "onevision": _onevision, "llava": _llava,
}


def build(args: argparse.Namespace, attn: str = "sdpa") -> Case:
    return MODELS[args.model](args.depth, attn, args.img_size == "small")


def reference(case: Case) -> None:
    xg = case.x.detach().clone().requires_grad_()
    torch.autograd.grad(case.score(xg).sum(), xg)


def method_call(name: str, case: Case) -> Callable[[], object]:
    from captum_vit.registry import build_method
    from captum_vit.targets import VLMAnswer

    method = build_method(name, VLMAnswer.tower(case.model))
    return lambda: method.attribute(case.x, target=case.target)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(name: str, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    case = build(args, "eager" if name == EAGER else "sdpa")
    if name in (SDPA, EAGER):
        def call() -> None:
            reference(case)
    else:
        call = method_call(name, case)  # type: ignore[assignment]
        from captum_vit.adapters import adapt
        from captum_vit.targets import VLMAnswer

        # the adapter's one-time self-check at a small size
        adapt(VLMAnswer.tower(case.model)).self_check(case.check)
    base = _rss_mb()
    call()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - base}


def measure(name: str, args: argparse.Namespace) -> float | str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--img-size", args.img_size,
         "--depth", str(args.depth), "--threads", str(args.threads), "--model", args.model],
        env=env, capture_output=True, text=True)
    if out.returncode:
        err = (out.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{name}: failed: {err}", file=sys.stderr, flush=True)
        return f"fails: {err[:120]}"
    mb = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
    print(f"{name}: {mb:.0f} MB", file=sys.stderr, flush=True)
    return mb


def speed(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    case = build(args)

    def ref() -> None:
        reference(case)

    print(f"{args.model}, depth {args.depth}, {tuple(case.x.shape)} pixels, "
          f"{args.threads} threads, CPU clock")
    print("| method | CPU s/call | ratio vs VLM forward+backward |\n|---|---:|---:|",
          flush=True)
    ref()  # warm-up
    for name in args.methods:
        try:
            fn = ref if name == "reference" else method_call(name, case)
            fn()  # warm-up (the adapter's self-check)
        except Exception as e:  # noqa: BLE001 - report the failure, go on
            print(f"| {name} | fails: {type(e).__name__}: {str(e)[:120]} | |", flush=True)
            continue
        ratios, times = [], []
        for _ in range(args.repeats):
            t0 = time.process_time()
            ref()
            t1 = time.process_time()
            fn()
            t2 = time.process_time()
            ratios.append((t2 - t1) / (t1 - t0))
            times.append(t2 - t1)
        print(f"| {name} | {statistics.median(times):.2f} | "
              f"{statistics.median(ratios):.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2", choices=list(MODELS))
    ap.add_argument("--img-size", default="full", choices=["full", "small"],
                    help="the family's mid-size image/tiles, or a small one (a quick check)")
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", nargs="*", default=list(METHODS),
                    help="with --speed, 'reference' times the reference against itself")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    if args.speed:
        speed(args)
        return
    rows = [(name, measure(name, args)) for name in (SDPA, EAGER, *args.methods)]
    ref = rows[0][1]
    print(f"\n{args.model}, tower depth {args.depth}, img {args.img_size}, 4-layer LM, "
          f"float32, {args.threads} threads, torch {torch.__version__}")
    print("| call | peak MB | ratio vs SDPA forward+backward |\n|---|---:|---:|")
    for name, mb in rows:
        if isinstance(mb, str) or isinstance(ref, str):
            print(f"| {name} | {mb} | |")
        else:
            print(f"| {name} | {mb:.0f} | {mb / ref:.2f} |")


if __name__ == "__main__":
    main()
