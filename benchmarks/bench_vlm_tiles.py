"""Explaining a tiled VLM's answer (SmolVLM-shaped): the read-gradient path against the columns.

The model is a random ``SmolVLMForConditionalGeneration`` (float32, CPU): a SigLIP tower of
``--depth`` blocks of width 384 (6 heads, patch 16) on 224 px tiles (196 patches, 49 image
features after the pixel shuffle by 2) and a 4-layer Llama of width 512. One image is split
into 2 × 2 tiles plus the global image (5 tiles, 245 image tokens), a short question and a
4-token answer; the score is the answer's log-probability
(:class:`captum_vit.targets.VLMAnswer` on ``target.images()``).

Timed (CPU clock of this process, ``time.process_time``, with ``--threads`` torch threads:
a machine shared with other jobs inflates it less than wall time), each call ``--repeats``
times, the smallest kept, as a ratio to the reference, one forward+backward of the whole VLM
to the pixels through its own forward:

- ``vanilla_grad`` and ``gae`` on the tiles, through the read gradient (one language-model
  sequence per prompt) and through the columns (``target.linearises = False``: every tile
  row scored in every tile's place, ``N²`` sequences, the path before);
- ``per_token_maps`` for the 4 answer tokens (``gae``, ``token_ixg``): one language-model
  run for all tokens against one ``attribute`` call per token through the columns.

Run from the repository root (``PYTHONPATH=.``)::

    python benchmarks/bench_vlm_tiles.py [--depth 12] [--threads 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch

IMAGE = 999
TILES = 5  # 2 × 2 tiles and the global image


def smolvlm(depth: int) -> torch.nn.Module:
    """The random SmolVLM-shaped model (the same weights every run)."""
    import transformers

    vision = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=depth,
                  num_attention_heads=6, image_size=224, patch_size=16)
    text = dict(model_type="llama", vocab_size=1000, hidden_size=512, intermediate_size=1408,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=1024, pad_token_id=0)
    cfg = transformers.SmolVLMConfig(vision_config=vision, text_config=text,
                                     image_token_id=IMAGE, scale_factor=2)
    torch.manual_seed(0)
    return transformers.SmolVLMForConditionalGeneration(cfg).eval()


def case(model: torch.nn.Module) -> tuple[dict, torch.Tensor]:
    """``(processor-like batch, answer)``: one prompt with 5 tiles' image tokens."""
    g = torch.Generator().manual_seed(0)
    px = torch.randn(1, TILES, 3, 224, 224, generator=g)
    per_tile = (224 // 16) ** 2 // 4
    ids = torch.tensor([[1, 5, 6, *[IMAGE] * (TILES * per_tile), 7, 8, 9]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": px,
             "pixel_attention_mask": torch.ones(1, TILES, 224, 224, dtype=torch.long)}
    return batch, torch.tensor([30, 31, 32, 33])


def timed(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from captum_vit.registry import build_method
    from captum_vit.targets import VLMAnswer
    from captum_vit.targets.vlm import per_token_maps

    model = smolvlm(args.depth)
    batch, answer = case(model)
    target = VLMAnswer(model, batch, answer)
    tokens = VLMAnswer(model, batch, answer, per_token=True)
    x = target.images()
    tower = VLMAnswer.tower(model)

    def columns(t: VLMAnswer) -> VLMAnswer:
        slow = copy.copy(t)
        slow.linearises = False
        return slow

    def reference() -> None:
        px = batch["pixel_values"].clone().requires_grad_()
        seq = torch.cat([batch["input_ids"][0], answer])[None]
        logits = model(input_ids=seq, pixel_values=px,
                       pixel_attention_mask=batch["pixel_attention_mask"],
                       use_cache=False).logits[0, -len(answer) - 1:-1]
        score = logits.log_softmax(-1).gather(-1, answer[:, None]).sum()
        torch.autograd.grad(score, px)

    reference()  # warm-up (and the adapters' one self-check per input size)
    for name in ("vanilla_grad", "gae", "token_ixg"):
        build_method(name, tower).attribute(x, target=target)
    ref = timed(reference, args.repeats)
    rows: list[tuple[str, float]] = []
    for name in ("vanilla_grad", "gae"):
        m = build_method(name, tower)
        rows.append((f"{name}, read gradient", timed(lambda m=m: m.attribute(x, target=target),
                                                     args.repeats)))
        rows.append((f"{name}, columns (N² sequences)",
                     timed(lambda m=m: m.attribute(x, target=columns(target)), args.repeats)))
    slow_tokens = columns(tokens)
    for name in ("gae", "token_ixg"):
        m = build_method(name, tower)
        rows.append((f"per_token_maps {name}, K = 4, one LM run",
                     timed(lambda m=m: per_token_maps(m, x, tokens), args.repeats)))
        rows.append((f"per_token_maps {name}, K = 4, a call per token (columns)",
                     timed(lambda m=m: [m.attribute(x, target=slow_tokens.token(t))
                                        for t in range(4)], args.repeats)))
    ref2 = timed(reference, args.repeats)
    print(f"depth {args.depth}, {TILES} tiles, threads {args.threads}, CPU-clock seconds")
    print(f"| call | s | vs VLM forward+backward |\n|---|---:|---:|\n"
          f"| VLM forward+backward | {ref:.2f} | 1.00 (again at the end: {ref2 / ref:.2f}) |")
    for label, t in rows:
        print(f"| {label} | {t:.2f} | {t / ref:.2f} |")


if __name__ == "__main__":
    main()
