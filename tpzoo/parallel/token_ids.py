"""Token ids and targets in range, checked without a host-device sync inside the model.

A model cannot ask the host whether its ids are valid (``bool(t.all())`` waits for the device and
breaks a torch.compile graph). So there are two checks:

- inside forward, ``assert_in_range`` queues a device-side assertion (``torch._assert_async``):
  nothing waits for it; on the CPU a bad id raises RuntimeError at once, on CUDA the kernel fails
  and the error surfaces at the next synchronisation (CUDA_LAUNCH_BLOCKING=1 pins it down);
- before a batch goes to the device, ``check_token_ids`` (host side, once per batch) raises an
  IndexError naming the bad values, for a clear message on any device.

Both accept ids in [0, vocab_size), and targets equal to ``ignore_index`` when one is given.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _allowed(vocab_size: int, ignore_index: int | None) -> str:
    extra = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
    return f"[0, {vocab_size}){extra}"


def in_range(ids: Tensor, vocab_size: int, ignore_index: int | None = None) -> Tensor:
    """Bool tensor like ``ids``: True where 0 <= id < vocab_size (or id == ignore_index)."""
    valid = (ids >= 0) & (ids < vocab_size)
    return valid if ignore_index is None else valid | (ids == ignore_index)


def assert_in_range(ids: Tensor, vocab_size: int, name: str, ignore_index: int | None = None) -> None:
    """Device-side assertion that every id lies in [0, vocab_size) (or is ``ignore_index``); no sync.
    The message names ``name`` and the allowed range (the bad values would need a sync)."""
    torch._assert_async(in_range(ids, vocab_size, ignore_index).all(),
                        f"{name} must lie in {_allowed(vocab_size, ignore_index)}")


def check_token_ids(ids: Tensor, vocab_size: int, name: str, ignore_index: int | None = None) -> None:
    """Host-side check, once per batch before it moves: IndexError naming ``name``, the allowed range
    and the smallest and largest bad values (e.g. "input_ids must lie in [0, 101); got 101..130").
    Synchronises when ``ids`` live on a GPU: call it on the host copy."""
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    valid = in_range(ids, vocab_size, ignore_index)
    if not bool(valid.all()):
        bad = ids[~valid]
        raise IndexError(f"{name} must lie in {_allowed(vocab_size, ignore_index)}; "
                         f"got {bad.min().item()}..{bad.max().item()}")
