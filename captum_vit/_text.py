"""Small helpers for the wording of user-facing messages."""

from __future__ import annotations


def count_noun(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word`` in the right number: ``"1 image"``, ``"2 images"``.

    Args:
        n (int): the count.
        word (str): the singular.
        plural (str, optional): the plural where it is not ``word + "s"`` (``"entries"``).

    Returns:
        str: e.g. ``count_noun(3, "entry", "entries") == "3 entries"``.
    """
    return f"{n} {word if n == 1 else plural or word + 's'}"
