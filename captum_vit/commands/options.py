"""Options shared by the sub-commands (parsing only).

Importing this module does not import torch (``captum-vit --help`` uses it).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` of the commands: every option with a default shows it ("(default:
    ...)", unless its text already says), prose paragraphs of descriptions and epilogs
    are wrapped while indented lines (examples) are kept as written, and reST literals
    (double backquotes) are written plainly."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").replace("``", "")
        default = action.default
        if ("default" in text.lower() or default is None or isinstance(default, bool)
                or default == argparse.SUPPRESS or not action.option_strings
                or text == argparse.SUPPRESS):
            return text
        if isinstance(default, list | tuple):
            default = " ".join(map(str, default))
        return f"{text} (default: {str(default).replace('%', '%%')})"

    def _format_text(self, text: str) -> str:
        """Wrap every paragraph of prose to the terminal; keep paragraphs with indented
        lines (examples) as written."""
        text = text.replace("``", "")
        if "%(prog)" in text:
            text = text % {"prog": self._prog}
        width = max(self._width - self._current_indent, 11)
        indent = " " * self._current_indent
        paragraphs = []
        for para in text.strip("\n").split("\n\n"):
            if any(line.startswith(" ") for line in para.splitlines()):
                paragraphs.append(para)
            else:
                paragraphs.append(textwrap.fill(" ".join(para.split()), width,
                                                initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(paragraphs) + "\n\n"


def parse_class(value: str | int | None, class_names: Sequence[str] | None, num_classes: int,
                *, option: str = "--target") -> int | None:
    """The class index named by a command-line value: an integer index, or a class name
    of the model (matched ignoring case, spaces and punctuation; see
    :func:`captum_vit.data.classes.class_index`).

    Args:
        value (str, int or None): e.g. ``"7"``, ``"Sneaker"`` or ``"sneaker"``; ``None``
            stays ``None`` (the predicted class).
        class_names (Sequence[str], optional): the model's class names (``None`` when
            unknown: then only indices are accepted).
        num_classes (int): the number of classes (or target vectors).
        option (str, optional): the option's name, for messages. Default ``"--target"``.

    Returns:
        int or None: the class index.

    Raises:
        ValueError: an index out of range, or a name that is no class of the model (the
            message lists valid names).

    Examples::

        >>> from captum_vit.commands.options import parse_class
        >>> parse_class("Sneaker", ["T-shirt/top", "Sneaker"], 2), parse_class("0", None, 2)
        (1, 0)
    """
    if value is None:
        return None
    text = str(value).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        index = int(text)
        if not 0 <= index < num_classes:
            raise ValueError(f"{option} must be in [0, {num_classes}), got {index}")
        return index
    if not class_names:
        raise ValueError(f"{option} {text!r}: this model has no class names, so give a "
                         f"class index in [0, {num_classes}) (or name the classes with "
                         "--classes FILE, one per line)")
    from captum_vit.data.classes import class_index

    try:
        return class_index(text, class_names)
    except ValueError as e:
        raise ValueError(f"{option} {e}; or give a class index in [0, {num_classes})"
                         ) from None


def add_target_embedding_arguments(p: argparse.ArgumentParser) -> None:
    """``--target-embeddings`` and its scoring options, for models that output an image
    embedding (CLIP, SigLIP, timm ``num_classes=0``).

    Args:
        p (argparse.ArgumentParser): the command's parser.
    """
    from captum_vit.targets import SIMILARITIES

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
    """The :class:`~captum_vit.targets.EmbeddingTarget` named by the options, or ``None``.

    Args:
        args (argparse.Namespace): the parsed options.

    Returns:
        EmbeddingTarget or None
    """
    if args.target_embeddings is None:
        return None
    from captum_vit.targets import EmbeddingTarget, read_target_embeddings

    return EmbeddingTarget(read_target_embeddings(args.target_embeddings),
                           similarity=args.similarity, scale=args.embedding_scale,
                           bias=args.embedding_bias)


TARGET_KIND_HELP = ("what is explained: 'class' (default: the class's logit, softmax "
                    "probabilities), 'multilabel' (the class's logit with sigmoid "
                    "probabilities: labels do not compete) or 'contrastive:A,B' (logit of A "
                    "minus logit of B; A and B class indices or names)")


def add_target_kind_argument(p: argparse.ArgumentParser) -> None:
    """``--target-kind`` (:func:`target_kind`)."""
    p.add_argument("--target-kind", default="class", metavar="KIND", help=TARGET_KIND_HELP)


def target_kind(value: str, class_names: Sequence[str] | None, num_classes: int
                ) -> tuple[str, tuple[int, int] | None]:
    """Parse ``--target-kind``: ``("class", None)``, ``("multilabel", None)`` or
    ``("contrastive", (a, b))``.

    Raises:
        ValueError: another kind, or a contrast without two distinct classes.

    Examples::

        >>> target_kind("contrastive:Sneaker,0", ["T-shirt/top", "Sneaker"], 2)
        ('contrastive', (1, 0))
    """
    kind, _, rest = str(value).strip().partition(":")
    kind = kind.strip().lower().replace("-", "")
    if kind in ("class", "multilabel") and not rest:
        return kind, None
    if kind == "contrastive":
        parts = [s for s in rest.split(",") if s.strip()]
        if len(parts) != 2:
            raise ValueError(f"--target-kind contrastive needs two classes, "
                             f"'contrastive:A,B'; got {value!r}")
        a, b = (parse_class(s, class_names, num_classes, option="--target-kind")
                for s in parts)
        if a == b:
            raise ValueError(f"--target-kind {value!r} contrasts a class with itself")
        return kind, (int(a), int(b))  # type: ignore[arg-type]
    raise ValueError(f"--target-kind must be 'class', 'multilabel' or 'contrastive:A,B'; "
                     f"got {value!r}")
