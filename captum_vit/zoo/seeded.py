"""Seeded re-initialisation of a randomly built model, for examples and tests.

Some libraries initialise a model built from a config so that its output is numerically
zero: transformers 5.x draws SAM's weights with a standard deviation of 1e-10, so a
``SamModel(SamConfig(...))`` gives an image embedding of about 1e-22 and every map of it
about 1e-26. :func:`seeded_init` redraws every parameter at a scale that keeps the
activations of order one, reproducibly from a seed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["seeded_init"]


def seeded_init(model: nn.Module, seed: int = 0) -> nn.Module:
    r"""Redraw every parameter of ``model`` in place from ``seed``, at a scale whose
    activations are of order one: a random model for examples and tests whose output is
    not numerically zero. Not a training initialisation.

    The rule, by parameter: a matrix or higher (linear and convolution weights, embedding
    tables, position embeddings, class tokens) :math:`\sim \mathcal{N}(0, 1/\text{fan}_
    \text{in})` with :math:`\text{fan}_\text{in}` the product of all but the first
    dimension; a vector named ``bias`` :math:`\sim \mathcal{N}(0, 0.02^2)`; any other
    vector (norm weights, layer scales) ``1``; scalars (e.g. CLIP's ``logit_scale``) are
    kept. Buffers are kept. The draws come from a CPU generator seeded with ``seed``, in
    the order of :meth:`~torch.nn.Module.named_parameters`, so the same seed gives the same
    model on any device and dtype.

    Args:
        model (nn.Module): the model, changed in place.
        seed (int, optional): the seed of the draws. Default 0.

    Returns:
        nn.Module: ``model`` itself.

    Examples::

        >>> import transformers
        >>> from captum_vit.zoo import seeded_init
        >>> sam = transformers.SamModel(transformers.SamConfig(...)).eval()
        >>> sam = seeded_init(sam, seed=0)    # an image embedding of order one
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 0:
                continue
            if p.dim() >= 2:
                std = 1.0 / math.sqrt(math.prod(p.shape[1:]))
                new = torch.randn(p.shape, generator=g, dtype=torch.float64) * std
            elif name.rsplit(".", 1)[-1] == "bias":
                new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.02
            else:
                new = torch.ones(p.shape, dtype=torch.float64)
            p.copy_(new.to(dtype=p.dtype, device=p.device))
    return model
