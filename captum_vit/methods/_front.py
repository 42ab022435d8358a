"""The shared ``attribute`` of the methods and the one template of its docstring.

Captum's methods each write ``attribute`` with a long docstring (Args / Returns /
Examples); here most methods take the same arguments, so the arguments every method shares
(``inputs``, ``target``, ``output``, ``score`` where it is the only option, and ``heads``
of the methods with per-head maps) are written
once (:data:`COMMON_ARGS`) and :func:`fill_doc` puts them into each docstring's
placeholders, keeping ``help()`` and Sphinx complete. A method whose ``attribute`` takes
only ``score`` and ``output`` inherits it from :class:`ScoredAttribution` and writes only
what is its own (the ``score`` wording, what it returns, its examples); each subclass gets
its own documented ``attribute`` (Captum's ``@log_usage`` wrapper, as NoiseTunnel needs).
"""

from __future__ import annotations

import inspect
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from captum.log import log_usage
from torch import Tensor

from captum_vit._base import SCORES, TargetLike, ViTGradientAttribution, check_choice

COMMON_ARGS: dict[str, str] = {
    "inputs": "inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).",
    "target": "target (int, list, Tensor, optional): class per image. ``None`` (default)\n"
              "    explains the predicted class of each image (Captum's ``None`` means a\n"
              "    scalar output; here it means \"predicted\").",
    "output": "output (str, optional): ``\"pixels\"`` (default), ``\"grid\"`` or "
              "``\"tokens\"``.",
    "score": "score (str, optional): ``\"logit\"`` (default) or ``\"probability\"``.",
    "heads": "heads (str, optional): ``\"mean\"`` (default): one map, the head average;\n"
             "    ``\"all\"``: one map per head of the read block (the class docstring says\n"
             "    which), shaped ``[B, H, P]`` (tokens), ``[B, H, gh, gw]`` (grid) or\n"
             "    ``[B, H, H_img, W_img]`` (pixels: one channel per head instead of the\n"
             "    image's channels).",
    "plus_args": "inputs (Tensor): validated images [B, C, H, W].\n"
                 "target (Tensor or None): class per image; ``None`` = predicted.\n"
                 "layers (sequence of int): sorted start blocks.",
}
"""The description of each shared ``attribute`` argument (placeholder ``{name}``), and
``{plus_args}``: the first arguments of every ``plus_maps`` (the PLUS / SkipPLUS fast
path, :class:`~captum_vit.methods.PLUSFastPath`)."""

F = TypeVar("F", bound=Callable[..., Any])


def fill_doc(func: F) -> F:
    """Decorator: replace the placeholders ``{inputs}``, ``{target}``, ``{output}``,
    ``{score}``, ``{heads}`` and ``{plus_args}`` standing alone on a line of ``func``'s
    docstring by :data:`COMMON_ARGS`, indented as the placeholder.

    Args:
        func (Callable): a function or method with a docstring.

    Returns:
        Callable: ``func`` with its docstring filled in.

    Examples::

        >>> @fill_doc
        ... def attribute(self, inputs, target=None, *, output="pixels"):
        ...     '''
        ...     Args:
        ...         {inputs}
        ...         {target}
        ...         {output}
        ...     '''
    """
    func.__doc__ = _filled(func.__doc__ or "", COMMON_ARGS)
    return func


def fill_doc_with(fragments: Mapping[str, str]) -> Callable[[F], F]:
    """Decorator factory: :func:`fill_doc` with more placeholders, ``fragments`` (a
    module's own shared descriptions, e.g. the options of a family of classes); works on
    functions and classes.

    Args:
        fragments (Mapping[str, str]): text per placeholder name, beside
            :data:`COMMON_ARGS`.

    Returns:
        Callable: the decorator.

    Examples::

        >>> @fill_doc_with({"layer": "layer (int, optional): the block read."})
        ... class MyCAM:
        ...     '''
        ...     Args:
        ...         {layer}
        ...     '''
    """
    table = {**COMMON_ARGS, **fragments}

    def fill(obj: F) -> F:
        obj.__doc__ = _filled(obj.__doc__ or "", table)
        return obj

    return fill


PLUS_RETURNS = """Returns:
    Tensor: token maps [len(layers), B, N].

Examples::

    >>> from captum_vit import SkipPLUS
    >>> attr = SkipPLUS(model, "{name}").attribute(images, target=labels)"""
"""The Returns and Examples sections of every ``plus_maps`` (placeholder
``{plus_returns}``; ``name`` is the method's registered name)."""


def plus_doc(name: str) -> Callable[[F], F]:
    """Decorator of a ``plus_maps`` (the PLUS / SkipPLUS fast path): :func:`fill_doc`'s
    placeholders, and ``{plus_returns}``, its Returns and Examples sections
    (:data:`PLUS_RETURNS`, the example over the registered ``name``).

    Args:
        name (str): the method's registered name.

    Returns:
        Callable: the decorator.

    Examples::

        >>> class MyMethod(PLUSFastPath, ViTGradientAttribution):
        ...     @plus_doc("my_method")
        ...     def plus_maps(self, inputs, target, layers, *, aggregate="subnetwork"):
        ...         '''The map of every sub-network.
        ...
        ...         Args:
        ...             {plus_args}
        ...             aggregate (str): ``"subnetwork"`` only.
        ...
        ...         {plus_returns}
        ...         '''
    """
    return fill_doc_with({"plus_returns": PLUS_RETURNS.format(name=name)})


def _filled(doc: str, fragments: Mapping[str, str]) -> str:
    lines = []
    for line in doc.split("\n"):
        name = line.strip()[1:-1] if line.strip().startswith("{") else ""
        if line.strip() == "{" + name + "}" and name in fragments:
            pad = line[:len(line) - len(line.lstrip())]
            lines.append(textwrap.indent(fragments[name], pad))
        else:
            lines.append(line)
    return "\n".join(lines)


class _DocumentedFront(ViTGradientAttribution):
    """Gives every subclass that does not define ``attribute`` its own copy of the
    inherited one, documented from :attr:`score_doc`, :attr:`returns_doc` and
    :attr:`examples_doc` (class attributes, plain text)."""

    target_doc = COMMON_ARGS["target"]
    """The ``target`` argument's description."""
    score_doc: str | None = None
    """The ``score`` argument's description (``None``: no ``score`` argument)."""
    returns_doc = "the attribution map in the requested ``output`` format."
    """What ``attribute`` returns (after ``Tensor:``)."""
    examples_doc = ""
    """The examples of ``attribute`` (``>>>`` lines)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "attribute" not in cls.__dict__:
            base = inspect.unwrap(cls.attribute)  # under Captum's @log_usage() and more
            own = types.FunctionType(base.__code__, base.__globals__, base.__name__,
                                     base.__defaults__, base.__closure__)
            own.__kwdefaults__ = dict(base.__kwdefaults__ or {})
            own.__annotations__ = dict(base.__annotations__)
            own.__module__, own.__qualname__ = cls.__module__, f"{cls.__qualname__}.attribute"
            own.__doc__ = _attribute_doc(cls, "heads" in inspect.signature(base).parameters)
            cls.attribute = log_usage()(own)
        super().__init_subclass__(**kwargs)  # after: ViTFront wraps the class's own attribute


class ScoredAttribution(_DocumentedFront):
    """Base of the methods whose ``attribute`` takes ``score`` and ``output`` only; a
    subclass documents it with ``score_doc``, ``returns_doc`` and ``examples_doc``.

    Examples::

        >>> from captum_vit.methods._front import ScoredAttribution
        >>> class MyMethod(ScoredAttribution):
        ...     examples_doc = ">>> attr = MyMethod(model).attribute(images)"
        ...     def _token_maps(self, inputs, target, *, score="logit", **_):
        ...         ...
    """

    score_doc = COMMON_ARGS["score"]

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str = "logit",
                  output: str = "pixels") -> Tensor:
        check_choice("score", score, SCORES)
        return self._attribute(inputs, target, output, score=score)


class HeadsAttribution(_DocumentedFront):
    """Base of the methods with per-head maps whose ``attribute`` takes ``score``,
    ``heads`` and ``output``; a subclass sets ``per_head = True`` and documents
    ``attribute`` with ``score_doc``, ``returns_doc`` and ``examples_doc``.

    Examples::

        >>> from captum_vit.methods._front import HeadsAttribution
        >>> class MyMethod(HeadsAttribution):
        ...     per_head = True
        ...     examples_doc = ">>> attr = MyMethod(model).attribute(images, heads='all')"
        ...     def _head_maps(self, inputs, target, *, score="logit", **_):
        ...         ...
    """

    score_doc = COMMON_ARGS["score"]

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str = "logit",
                  heads: str = "mean", output: str = "pixels") -> Tensor:
        check_choice("score", score, SCORES)
        return self._attribute(inputs, target, output, score=score, heads=heads)


class PlainAttribution(_DocumentedFront):
    """Base of the methods whose ``attribute`` takes ``output`` only (no options); a
    subclass documents it with ``returns_doc`` and ``examples_doc``."""

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  output: str = "pixels") -> Tensor:
        return self._attribute(inputs, target, output)


def _hanging(text: str, indent: str) -> str:
    """``text``'s first line, then its other lines (dedented as a block) indented by
    ``indent``: a docstring entry written in a class attribute."""
    first, _, rest = textwrap.dedent(text).strip().partition("\n")
    rest = textwrap.indent(textwrap.dedent(rest), indent)
    return first.strip() + ("\n" + rest if rest else "")


def _attribute_doc(cls: type[_DocumentedFront], heads: bool) -> str:
    examples = textwrap.indent(textwrap.dedent(cls.examples_doc).strip("\n"), "    ")
    return _filled("\n".join([
        "", "Args:", "    {inputs}", "    " + _hanging(cls.target_doc, "        "),
        *(["    " + _hanging(cls.score_doc, "        ")] if cls.score_doc else []),
        *(["    {heads}"] if heads else []), "    {output}", "", "Returns:",
        "    Tensor: " + _hanging(cls.returns_doc, "    "), "", "Examples::", "", examples,
        ""]), COMMON_ARGS)
