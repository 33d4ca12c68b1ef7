"""One direction's machinery on this node: a lane.

Uploads and downloads are allocated, demanded, sampled and shaped by the same code; what differs
is the lane it works on: the direction's allocations (lease, floor, adoption), the pods' demand
the sampler measures, the classes' measured frames per IP byte, and in single-node mode the local
allocator of the direction's budget. The agent holds one lane per direction (`PerDirection[Lane]`)
and loops over them; a download lane that is not `shaped` is counted only (no download shaper).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from core.direction import Direction
from core.policy import ResolvedPod

from .allocations import Allocations, AllocationSet
from .demand import PodDemand
from .frames import FrameRatios

# Single-node mode's allocator (netagent.local.LocalAllocator): (pods, demand, budget) -> allocations.
# Injected, so the agent in controller mode never loads the engine (numpy).
LocalAllocate = Callable[[list[ResolvedPod], dict[str, PodDemand], int], AllocationSet]


@dataclass(eq=False)
class Lane:
    direction: Direction
    allocations: Allocations
    frames: FrameRatios  # each class's measured frames per IP byte (netagent.frames), written by the sampler
    demand: dict[str, PodDemand] = field(default_factory=dict)  # pod key -> demand, written by the sampler
    local: LocalAllocate | None = None  # single-node mode: the engine on this direction's budget
    shaped: bool = True  # False: this direction is counted, not shaped (downloads with --shape-ingress off)
