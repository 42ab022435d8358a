"""Processes: the device, rank and world size of an evaluation under ``torchrun``, and the
gathering of every rank's shard.

With a process group initialised (:func:`distributed`), rank ``r`` of ``K`` evaluates the
batches ``i ≡ r (mod K)`` (:func:`shard`) and :func:`gather` collects every rank's
results on every rank; the evaluation loop (:func:`captum_vit.metrics.suite.evaluate`)
uses both, so a single process is the case ``K = 1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process: ``(0, 1)`` without a process group.

    Returns:
        tuple[int, int]: the rank and the number of processes.

    Examples::

        >>> from captum_vit.metrics.parallel import rank_world
        >>> rank_world()
        (0, 1)
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(n_batches: int) -> range:
    """The batch indices this process evaluates: ``rank, rank + K, ...`` below ``n_batches``.

    Args:
        n_batches (int): the number of batches of the whole evaluation.

    Returns:
        range: this rank's batch indices.

    Examples::

        >>> from captum_vit.metrics.parallel import shard
        >>> list(shard(5))            # a single process takes every batch
        [0, 1, 2, 3, 4]
    """
    rank, world = rank_world()
    return range(rank, n_batches, world)


def gather(part: Any) -> list[Any]:
    """Every rank's ``part`` (picklable), in rank order, on every rank; ``[part]`` for a
    single process (``torch.distributed.all_gather_object``).

    Args:
        part (Any): this rank's results.

    Returns:
        list: one entry per rank.

    Examples::

        >>> from captum_vit.metrics.parallel import gather
        >>> gather({"a": 1})
        [{'a': 1}]
    """
    _, world = rank_world()
    if world == 1:
        return [part]
    parts: list[Any] = [None] * world
    torch.distributed.all_gather_object(parts, part)
    return parts


@contextmanager
def distributed(device: str = "auto") -> Iterator[tuple[torch.device, int, int]]:
    r"""The device, rank and world size of this process; under ``torchrun``
    (``WORLD_SIZE`` > 1) a process group (nccl on CUDA, gloo on CPU) is set up for the
    block and torn down after it (behind a barrier).

    Args:
        device (str, optional): ``"auto"`` (CUDA when available), ``"cpu"`` or
            ``"cuda"``; under torchrun CUDA ranks use their ``LOCAL_RANK`` device.

    Yields:
        tuple: ``(device, rank, world)``.

    Examples::

        >>> from captum_vit.metrics.parallel import distributed
        >>> with distributed("cpu") as (device, rank, world):
        ...     results = evaluate(model.to(device), data, ["gae"], ["deletion"])
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spec = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dev = torch.device(spec)
    if spec == "cuda" and world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    dist = torch.distributed
    started = world > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        yield dev, int(os.environ.get("RANK", "0")), world
    finally:
        if started and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


__all__ = ["distributed", "gather", "rank_world", "shard"]
