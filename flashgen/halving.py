"""Successive halving: the rules that decide which configurations each rung of a halving search times.

Rung 0 times every fitting configuration briefly (`reps0` timed calls, about a tenth of a normal trial's); the
fastest 1/eta of those are timed again with eta times the calls at rung 1, and so on until at most `keep` remain,
which the search's side-by-side retime then ranks. A short median is noisy, but a configuration far from the
best is rarely timed near it, and those near it survive to the longer rungs. The whole space costs about
n * (1 + 1/eta + 1/eta^2 ...) measurements, n * eta / (eta - 1) at most, instead of a full trial each.

Nothing here reads a study: `flashgen.search` records every measurement with its rung and asks these rules
which configurations the next rung takes, so a rerun recomputes the same rungs from what was recorded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)

ETA = 3  # the fraction of a rung kept for the next
RUNG0_REPS = 5  # timed calls of a rung-0 measurement: a tenth of a normal trial's 50
MAX_REPS = 400  # the longest rungs' cap: more calls only add time once a median is stable


@dataclass(frozen=True)
class Schedule:
    eta: int = ETA
    reps0: int = RUNG0_REPS
    keep: int = 5  # the halving ends once at most this many configurations are timed (the retime's top)
    max_reps: int = MAX_REPS

    def __post_init__(self) -> None:
        if self.eta < 2:
            raise ValueError(f"eta={self.eta}: a rung must keep at most half of the one before (eta >= 2)")
        if self.reps0 < 1 or self.keep < 1:
            raise ValueError(f"reps0={self.reps0}, keep={self.keep}: both must be at least 1")

    def reps(self, rung: int) -> int:
        """Timed calls of a measurement at `rung`."""
        return min(max(self.max_reps, self.reps0), self.reps0 * self.eta ** rung)

    def finished(self, timed: int) -> bool:
        """Whether a rung that timed `timed` configurations is the last one."""
        return timed <= self.keep

    def promoted(self, timed: Sequence[tuple[K, float]]) -> list[K]:
        """The configurations the next rung takes: the fastest ceil(n / eta) of a rung's (key, ms) in rung order
        (a tie goes to the earlier one)."""
        n = math.ceil(len(timed) / self.eta)
        ranked = sorted(range(len(timed)), key=lambda i: (timed[i][1], i))[:n]
        return [timed[i][0] for i in sorted(ranked)]

    def sizes(self, n: int) -> list[int]:
        """Each rung's configurations when all `n` pass: n, ceil(n / eta), ... down to at most `keep`."""
        out = [n]
        while not self.finished(out[-1]):
            out.append(math.ceil(out[-1] / self.eta))
        return out
