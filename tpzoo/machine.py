"""This machine's memory, and refusing a host-side index that cannot fit in it (imports without torch): a run
too large for the machine is refused in one line naming the sizes, before anything is allocated."""

from __future__ import annotations

import os


def host_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_index_fits(need: int, what: str) -> None:
    """ValueError when an index of ``need`` bytes (``what``: what it indexes, and how many) exceeds the host's
    memory."""
    have = host_memory()
    if need > have:
        raise ValueError(f"{what} need an index of {gib(need)}, more than this machine's {gib(have)} of memory; "
                         f"train for fewer iterations (--train-iters, --train-samples) or with a smaller batch")
