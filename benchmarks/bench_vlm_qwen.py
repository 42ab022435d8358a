"""Explaining a Qwen2-VL answer: speed and peak memory against the VLM's own forward+backward.

The model is a random mid-size ``Qwen2VLForConditionalGeneration`` (float32, CPU): a vision
tower of 12 blocks of width 512 (8 heads, patch 14, merge 2) and a 4-layer language model
of width 512; one 448 px image is 32 x 32 = 1,024 patches (256 image tokens in the prompt),
a 12-token question around them and a 4-token answer. The score is the answer's
log-probability (:class:`captum_vit.targets.VLMAnswer`).

- **Speed** (``--speed``): each method timed alternately with the reference, one
  forward+backward of the whole VLM to the pixels through its own forward (SDPA attention),
  median of the per-pair ratios.
- **Memory** (default): every call in a FRESH process (``--child``) that builds the model and
  the inputs, reads its resident set, runs one call and reports the peak resident set
  (``ru_maxrss``) minus that baseline; the reference is the VLM's own forward+backward with
  SDPA attention, and with ``eager`` attention beside it (what issue threads resort to for
  attention weights). Goal: peak ≤ 1.3 × the SDPA forward+backward.

Run from the repository root (``PYTHONPATH=.``)::

    python benchmarks/bench_vlm_qwen.py [--speed] [--img-size 448] [--threads 2]

A quick check of the script: ``--img-size 112 --depth 2``. ``--model qwen2_5`` runs the same
on a Qwen2.5-VL of the same size (RMSNorm, SwiGLU MLP of 1,376, windows of 112 px = 8 × 8
patches, every fourth block global).
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

import torch

IMAGE, START, END = 999, 997, 998
METHODS = ("vanilla_grad", "token_ixg", "gae", "attnlrp", "cp_lrp", "decompx", "rollout")
SDPA, EAGER = "VLM forward+backward (sdpa)", "VLM forward+backward (eager)"


def qwen2_vl(depth: int = 12, attn: str = "sdpa") -> torch.nn.Module:
    """The random mid-size Qwen2-VL (the same weights in every process)."""
    import transformers

    vision = dict(depth=depth, embed_dim=512, num_heads=8, mlp_ratio=4, hidden_size=512,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    text = dict(vocab_size=1000, hidden_size=512, intermediate_size=1408,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 12, 12]})
    cfg = transformers.Qwen2VLConfig(vision_config=vision, text_config=text,
                                     image_token_id=IMAGE, video_token_id=996,
                                     vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


def qwen2_5_vl(depth: int = 12, attn: str = "sdpa") -> torch.nn.Module:
    """The random mid-size Qwen2.5-VL (the same weights in every process)."""
    import transformers

    vision = dict(depth=depth, hidden_size=512, intermediate_size=1376, num_heads=8,
                  out_hidden_size=512, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=list(range(3, depth, 4)) or [depth - 1])
    text = dict(vocab_size=1000, hidden_size=512, intermediate_size=1408,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 12, 12]})
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text,
                                        image_token_id=IMAGE, video_token_id=996,
                                        vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


MODELS = {"qwen2": qwen2_vl, "qwen2_5": qwen2_5_vl}


def case(model: torch.nn.Module, img_size: int
         ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], object]:
    """``(image [1, 3, S, S], score(image) through the VLM's own forward, VLMAnswer)``."""
    from captum_vit.adapters import adapt
    from captum_vit.targets import VLMAnswer

    x = torch.randn(1, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))
    tokens = (img_size // 28) ** 2
    prompt = torch.tensor([1, 5, 6, START, *[IMAGE] * tokens, END, *range(10, 18)])
    answer = torch.tensor([30, 31, 32, 33])
    seq = torch.cat([prompt, answer])[None]
    tower = adapt(VLMAnswer.tower(model))
    grid = torch.tensor([[1, img_size // 14, img_size // 14]])

    def score(z: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=seq, pixel_values=tower.pack(z), image_grid_thw=grid,
                    mm_token_type_ids=(seq == IMAGE).int(), use_cache=False)
        logp = out.logits[0, len(prompt) - 1:-1].log_softmax(-1)
        return logp.gather(-1, answer[:, None]).sum()[None]

    return x, score, VLMAnswer(model, prompt, answer)


def reference(score: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    xg = x.detach().clone().requires_grad_()
    torch.autograd.grad(score(xg).sum(), xg)


def method_call(name: str, model: torch.nn.Module, x: torch.Tensor, target: object
                ) -> Callable[[], object]:
    from captum_vit.registry import build_method
    from captum_vit.targets import VLMAnswer

    method = build_method(name, VLMAnswer.tower(model))
    return lambda: method.attribute(x, target=target)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(name: str, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    model = MODELS[args.model](args.depth, "eager" if name == EAGER else "sdpa")
    x, score, target = case(model, args.img_size)
    call = (lambda: reference(score, x)) if name in (SDPA, EAGER) else \
        method_call(name, model, x, target)
    if name not in (SDPA, EAGER):  # the adapter's one-time self-check at a small size
        small = torch.randn(1, 3, 56, 56)
        from captum_vit.adapters import adapt

        adapt(model.model.visual).self_check(small)
    base = _rss_mb()
    call()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - base}


def measure(name: str, args: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--img-size", str(args.img_size),
         "--depth", str(args.depth), "--threads", str(args.threads),
         "--model", args.model],
        env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def speed(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = MODELS[args.model](args.depth)
    x, score, target = case(model, args.img_size)

    def ref() -> None:
        reference(score, x)

    print("| method | ms/call | ratio vs VLM forward+backward |\n|---|---:|---:|")
    for name in ("reference", *args.methods):
        fn = ref if name == "reference" else method_call(name, model, x, target)
        fn(), ref()  # warm-up (the adapter's self-check)
        ratios, times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ref()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            ratios.append((t2 - t1) / (t1 - t0))
            times.append(t2 - t1)
        print(f"| {name} | {1e3 * statistics.median(times):.0f} | "
              f"{statistics.median(ratios):.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--img-size", type=int, default=448)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default="qwen2", choices=list(MODELS))
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    if args.speed:
        speed(args)
        return
    ref = measure(SDPA, args)
    rows = [(SDPA, ref), (EAGER, measure(EAGER, args))]
    rows += [(name, measure(name, args)) for name in args.methods]
    patches = (args.img_size // 14) ** 2
    print(f"\n{args.model} tower 12x512 (depth {args.depth}), {patches} patches, 4-layer LM, "
          f"float32, {args.threads} threads, torch {torch.__version__}")
    print("| call | peak MB | ratio vs SDPA forward+backward |\n|---|---:|---:|")
    for name, mb in rows:
        print(f"| {name} | {mb:.0f} | {mb / ref:.2f} |")


if __name__ == "__main__":
    main()
