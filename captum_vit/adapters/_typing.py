"""Typing helpers private to the adapters.

``nn.Module.__getattr__`` is typed as returning ``Tensor | Module``, so a static checker
cannot follow a path such as ``model.blocks[0].attn.qkv.weight`` through a third-party
model (timm, Hugging Face transformers, torchvision, open_clip): the structure lives in
the model's attributes, not in its class's annotations. An adapter that reads a family's
modules by name types the model (and the submodules it walks) as :data:`ModelTree`,
i.e. ``Any``, and checks at run time what it reads: every adapter's constructor raises a
``TypeError`` naming the part that does not have the family's structure.
"""

from __future__ import annotations

from typing import Any, TypeAlias

ModelTree: TypeAlias = Any
"""A third-party ``nn.Module`` (or one of its submodules) read by attribute names."""
