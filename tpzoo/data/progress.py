"""What a data step says while it runs, on stderr (stdout stays for the commands' own output).

    with Progress("tokenizing", "documents", title=f"tokenizing 2 files into {prefix}") as bar:
        for batch in batches:
            bar.update(len(batch), tokens=n_tokens)

On a terminal: the title, a tqdm bar, and a done line. Elsewhere (a log file, a pipe) a few plain
lines, so logs stay short: the title, the count every ``interval`` seconds, and the done line

    tokenizing: done, 1,100 documents, 1,234,567 tokens in 2.7 s

Nothing shows before the first ``update`` made ``delay`` seconds (default ``QUIET_SECONDS``) or more
after the start: a quick step stays silent, and a step that fails before its first item prints
nothing but its error.
Only one process of a job should pass ``enabled=True``: ``is_main_process()`` (rank 0), or the one
that builds a cached folder.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")
QUIET_SECONDS = 3.0  # steps quicker than this say nothing (unless they pass delay=0)


def is_main_process() -> bool:
    """True on rank 0 of a job (torchrun's ``$RANK``), or outside one."""
    return os.environ.get("RANK", "0") == "0"


def say(text: str) -> None:
    """One line on stderr (above a running tqdm bar)."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


class Progress:
    """Progress of one step over ``total`` (or an unknown number of) ``unit``; see the module docstring."""

    def __init__(
        self,
        desc: str,
        unit: str,
        total: int | None = None,
        *,
        title: str | None = None,
        enabled: bool = True,
        delay: float | None = None,
        interval: float = 60.0,
        interactive: bool | None = None,
    ) -> None:
        self.desc, self.unit, self.total, self.title = desc, unit, total, title
        self.enabled, self.interval = enabled, interval
        self.delay = QUIET_SECONDS if delay is None else delay
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.n, self.totals = 0, {}
        self.start = self.last_line = time.perf_counter()
        self.shown = self.long = False
        self.bar: Any = None

    def _counts(self) -> str:
        of = f"/{self.total:,}" if self.total is not None else ""
        return ", ".join([f"{self.n:,}{of} {self.unit}"] + [f"{v:,} {k}" for k, v in self.totals.items()])

    def _show(self) -> None:
        self.shown = True
        if self.title:
            say(self.title)
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(desc=self.desc, total=self.total, unit=" " + self.unit, initial=self.n,
                            file=sys.stderr, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1, **totals: int) -> None:
        """Count ``n`` more units; ``totals`` (e.g. ``tokens=...``) are running totals shown beside them."""
        self.n += n
        self.totals.update(totals)
        if not self.enabled:
            return
        now = time.perf_counter()
        first = not self.shown
        if first:
            if now - self.start < self.delay:
                return
            self._show()
        if self.bar is not None:
            if totals or first:
                self.bar.set_postfix({k: f"{v:,}" for k, v in self.totals.items()}, refresh=first)
            if not first:  # a new bar starts at the count so far
                self.bar.update(n)
        elif now - self.last_line >= self.interval:
            self.last_line, self.long = now, True
            say(f"{self.desc}: {self._counts()}, {now - self.start:.0f} s")

    def iterate(self, items: Iterable[T]) -> Iterator[T]:
        """Yield ``items``, counting one unit after each."""
        for item in items:
            yield item
            self.update()

    def stage(self, text: str) -> None:
        """Name a sub-step (``writing the index``): the bar's description, or a line once the step is long."""
        if self.bar is not None:
            self.bar.set_description(f"{self.desc}: {text}")
        elif self.shown and self.long:
            say(f"{self.desc}: {text}")

    def close(self) -> None:
        """End the step: the done line (with the counts and seconds) if the step showed."""
        if self.enabled and not self.shown and time.perf_counter() - self.start >= self.delay:
            self._show()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled and self.shown:
            say(f"{self.desc}: done, {self._counts()} in {time.perf_counter() - self.start:.1f} s")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        elif self.bar is not None:  # a failed step ends without its done line
            self.bar.close()
