"""A pod's two internet directions as a value, and a container holding one thing per direction.

Uploads (pod -> internet) and downloads (internet -> pod) are shaped, demanded, allocated and
counted by the same code with a `Direction` passed in, never by an `ingress_` twin of each name.
The edges keep their own words and translate here, once: the CRD writes uploads at the top level
and downloads in an `ingress` block, the metric names say `egress`/`ingress`, and the JSON wire
keeps its historical field names (core/wire.py). A device hook (tc's ingress/egress) is a
different thing and never a Direction: on a pod's veth the hook called ingress carries its upload.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Direction(enum.Enum):
    UPLOAD = "upload"  # pod -> internet
    DOWNLOAD = "download"  # internet -> pod

    @property
    def metric_word(self) -> str:
        """The word metric names and the CRD use for this direction (netagent_pod_<word>_bytes)."""
        return "egress" if self is Direction.UPLOAD else "ingress"

    @property
    def view_word(self) -> str:
        """The key /state, the leader's /v1/status and the CLI's tables use for this direction."""
        return "uploads" if self is Direction.UPLOAD else "downloads"

    @property
    def crd_block(self) -> str | None:
        """Where the CRD keeps this direction's values: None = top level, else the block's key."""
        return None if self is Direction.UPLOAD else "ingress"

    def __str__(self) -> str:
        return self.value

    # identity hash in C (members are singletons; Enum's own hashes the name in Python): dict keys such as
    # (pod, direction) on the controller's per-report path (core/quota.Ledger) cost a third as much
    __hash__ = object.__hash__


DIRECTIONS: tuple[Direction, Direction] = (Direction.UPLOAD, Direction.DOWNLOAD)


@dataclass(frozen=True, slots=True)
class PerDirection(Generic[T]):
    """One value per direction, indexed by `Direction` (`limits[d]`); immutable."""

    upload: T
    download: T

    def __getitem__(self, d: Direction) -> T:
        return self.upload if d is Direction.UPLOAD else self.download

    def items(self) -> Iterator[tuple[Direction, T]]:
        yield Direction.UPLOAD, self.upload
        yield Direction.DOWNLOAD, self.download

    def map(self, fn: Callable[[T], U]) -> PerDirection[U]:
        return PerDirection(fn(self.upload), fn(self.download))

    def replace(self, d: Direction, value: T) -> PerDirection[T]:
        """A copy with direction `d`'s value swapped for `value`."""
        return PerDirection(value, self.download) if d is Direction.UPLOAD else PerDirection(self.upload, value)

    @staticmethod
    def build(fn: Callable[[Direction], U]) -> PerDirection[U]:
        """One value per direction, computed from the direction: PerDirection.build(lambda d: ...)."""
        return PerDirection(fn(Direction.UPLOAD), fn(Direction.DOWNLOAD))

    @staticmethod
    def same(value: U) -> PerDirection[U]:
        return PerDirection(value, value)
