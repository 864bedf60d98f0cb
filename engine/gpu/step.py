"""The GPU runner's step: `model.Step` plus what the paged Triton forward needs per step.

`Model.prepare` describes the forward (segments, rows per layer kind, Engram ids, head rows);
`GpuModel.prepare` wraps that in a `GpuStep` and adds the runner's state, which the model file
does not know about:

    tables        PagedTables: pool-row tables (window, entry and key rows; engine/gpu/tables.py)
    buffer        the one device buffer every input tensor views (moved in one host->device copy)
    input_bytes   buffer[:input_bytes] holds every tensor of `tensors()` (the commit's follow)

A CUDA graph's static step is a GpuStep whose tensors are the graph's buffers
(engine/gpu/decode_graph.py): `tensors` / `set_tensors` cover the model's inputs then the tables'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashpd.engine.gpu.tables import PagedTables
from flashpd.model.model import Step


@dataclass
class GpuStep(Step):
    tables: PagedTables | None = None
    buffer: torch.Tensor | None = None
    input_bytes: int = 0

    @classmethod
    def of(cls, step: Step) -> GpuStep:
        """The model's step, carried over field by field (no tensor is copied)."""
        return cls(**{f.name: getattr(step, f.name) for f in dataclasses.fields(Step)})

    def tensors(self) -> list[torch.Tensor]:
        out = super().tensors()
        if self.tables is not None:
            out += self.tables.tensors()
        return out

    def set_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        tensors = list(tensors)
        n = len(Step.tensors(self))
        super().set_tensors(tensors[:n])
        if self.tables is not None:
            self.tables.set_tensors(tensors[n:])
        elif n != len(tensors):
            raise ValueError(f"{len(tensors)} tensors for a step of {n}")
