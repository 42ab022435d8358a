"""Options shared by the sub-commands (parsing only)."""

from __future__ import annotations

import argparse
from typing import Any

from captum_vit.targets import SIMILARITIES


def add_target_embedding_arguments(p: argparse.ArgumentParser) -> None:
    """``--target-embeddings`` and its scoring options, for models that output an image
    embedding (CLIP, SigLIP, timm ``num_classes=0``; SPEC_NEXT §7.5)."""
    p.add_argument("--target-embeddings", default=None, metavar="FILE",
                   help="for a model that outputs an image embedding: the vectors to score it "
                        "against, [T, D′] in a .npy, .pt or .safetensors file (e.g. text "
                        "embeddings of class prompts, in class order); they act as T classes "
                        "and --classes names them")
    p.add_argument("--similarity", default="cosine", choices=SIMILARITIES,
                   help="score of an image embedding against a target vector")
    p.add_argument("--embedding-scale", type=float, default=1.0,
                   help="multiplies the similarity (CLIP: logit_scale.exp(), e.g. 100)")
    p.add_argument("--embedding-bias", type=float, default=0.0,
                   help="added to the scaled similarity (SigLIP: logit_bias)")


def target_embeddings(args: argparse.Namespace) -> Any:
    """The :class:`~captum_vit.targets.EmbeddingTarget` named by the options, or ``None``."""
    if args.target_embeddings is None:
        return None
    from captum_vit.targets import EmbeddingTarget, read_target_embeddings

    return EmbeddingTarget(read_target_embeddings(args.target_embeddings),
                           similarity=args.similarity, scale=args.embedding_scale,
                           bias=args.embedding_bias)
