"""Bags in slide order from batches that run across slides: :class:`BagAssembler`.

Encoded batches arrive in patch order, each holding the tail of one slide and the head of the
next; slide plans arrive (from the planner) a little ahead of their patches. The assembler keeps
each slide's rows until its last one is in, then hands the finished bag out, in slide order: a
slide without patches is an empty bag as soon as the slides before it are done, and a skipped
slide (its plan failed, or one of its patches could not be read) is reported in its turn and its
rows dropped, including rows that arrive after the failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from featurestore.extract.wsi_patches import PatchKey, Skipped, SlidePlan


@dataclass
class Finished:
    """A slide's turn: its bag (``features`` is None when the slide was skipped, with ``reason``)."""

    position: int
    plan: SlidePlan | Skipped
    features: torch.Tensor | None
    reason: str | None = None


class BagAssembler:
    """Collects rows per slide and yields finished slides in order (module docstring)."""

    def __init__(self, dim: int, device: torch.device) -> None:
        self.dim = dim
        self.device = device
        self.plans: dict[int, SlidePlan | Skipped] = {}
        self._pieces: dict[int, list[torch.Tensor]] = {}
        self._counts: dict[int, int] = {}
        self._skipped: dict[int, str] = {}
        self.next = 0  # the position of the next slide to finish

    def plan(self, plan: SlidePlan | Skipped) -> None:
        """Record a slide's plan (the patch sampler calls this before yielding its patches)."""
        self.plans[plan.position] = plan
        if isinstance(plan, Skipped):
            self.skip(plan.position, plan.reason)

    def skip(self, position: int, reason: str) -> None:
        """Drop a slide: the first reason counts; its rows so far and later are discarded."""
        if position not in self._skipped:
            self._skipped[position] = reason
            self._pieces.pop(position, None)

    def add(self, keys: list[PatchKey], features: torch.Tensor) -> None:
        """Rows ``features[i]`` for ``keys[i]``; consecutive keys of one slide are kept as one piece."""
        start, n = 0, len(keys)
        while start < n:
            position = keys[start].position
            stop = start
            while stop < n and keys[stop].position == position:
                stop += 1
            if position not in self._skipped:
                self._pieces.setdefault(position, []).append(features[start:stop])
                self._counts[position] = self._counts.get(position, 0) + stop - start
            start = stop

    def finished(self) -> Iterator[Finished]:
        """The slides whose turn has come: every earlier one finished, all their rows in."""
        while self.next in self.plans:
            position, plan = self.next, self.plans[self.next]
            if position in self._skipped:
                yield Finished(position, plan, None, self._skipped[position])
            elif self._counts.get(position, 0) == len(plan):  # type: ignore[arg-type]
                parts = self._pieces.pop(position, [])
                yield Finished(position, plan, torch.cat(parts) if parts else
                               torch.empty((0, self.dim), device=self.device))
            else:
                return
            self.next += 1


__all__ = ["BagAssembler", "Finished"]
