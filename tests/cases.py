"""Many named checks in one spawn of ranks, each reported as its own pytest case.

Inside the ranks, every check runs under ``log.case(name)``: a failure is recorded under its name
and the next check still runs. The spawn returns each rank's log; a parametrized test per name
then asserts its own outcome, so ``pytest -k 'llama and tp2'`` selects checks by name and a failure
names its case while the others still pass or fail on their own:

    def checks(log: CaseLog) -> CaseLog:          # runs on every rank
        with log.case("gpt-tp2"):
            ...
        return log

    @pytest.fixture(scope="module")
    def logs():
        return spawn(checks, 4, CaseLog())

    @pytest.mark.parametrize("name", NAMES)
    def test_check(logs, name):
        assert_case(logs, name)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class CaseLog:
    """Outcomes of named checks on one rank, and the largest relative error per category."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.failures: dict[str, str] = {}
        self.max: dict[str, float] = {}

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        self.ran.append(name)
        try:
            yield
        except Exception as e:  # recorded; the other cases still run
            self.failures[name] = f"{type(e).__name__}: {e}"

    def close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, category: str, tol: float = 1e-5,
              scale: float = 1e-30) -> None:
        """Assert max |actual - expected| / max(max |expected|, scale) <= tol; keep the largest per category.
        ``scale``: the size below which a tensor counts as small (its error is then judged against it)."""
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        err = (actual.double() - expected.double()).abs().max().item()
        rel = err / max(expected.double().abs().max().item(), scale)
        self.max[category] = max(self.max.get(category, 0.0), rel)
        assert rel <= tol, f"{what}: relative error {rel:.3g} exceeds {tol}"

    check = close


def assert_case(logs: list[CaseLog], name: str) -> None:
    """The check ``name`` ran and passed on every rank (the first failing rank's message otherwise)."""
    for rank, log in enumerate(logs):
        assert name in log.ran, f"rank {rank} never ran {name!r}"
        assert name not in log.failures, f"rank {rank}: {log.failures[name]}"


def assert_case_of(spawns: list[list[CaseLog]], name: str) -> None:
    """``assert_case`` on the one of several spawns' logs whose rank 0 ran ``name`` (the first when none did)."""
    assert_case(next((logs for logs in spawns if name in logs[0].ran), spawns[0]), name)
