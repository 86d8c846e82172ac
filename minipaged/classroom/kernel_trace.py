"""Which elements a Triton kernel read and wrote, recorded by Triton's interpreter: an access trace.

In the interpreter a kernel runs as numpy, one program after another, and every ``tl.load`` / ``tl.store``
reaches the interpreter's builder as one array of addresses and one mask. Recording those calls while the
kernel runs tells, for each program id, exactly which elements of which tensor it touched::

    with AccessTrace(key_cache=kc, table=table, out=out) as trace:
        my_kernel[(num_seqs,)](kc, table, out, ...)
    trace.cells("key_cache", "load")                     # {(block, slot), ...}: what was read
    trace.by_program("key_cache", "load")                # {program id: {(block, slot), ...}}

A lane whose mask is off touches nothing and is not recorded: a kernel that masks the tail of the last block
reads only the sequence's slots. An address inside none of the named tensors is refused *before* the
interpreter touches it (the interpreter would read raw memory: garbage, or a crash), with the program id and
the nearest tensor, so a wrong address is an error that names itself instead of a wrong number.

This patches two methods of Triton's interpreter builder (``create_masked_load``, ``create_masked_store``;
plain loads and stores go through them) while the ``with`` block runs, and restores them after. That is
Triton's private API: where a release moves it, ``AccessTrace`` raises ``TraceUnavailable`` saying so.
Compiled kernels on a GPU cannot be traced this way (chapter 05 draws them from their launch plan instead).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

Kind = Literal["load", "store"]
Program = tuple[int, int, int]
_LOCK = threading.Lock()  # one trace at a time: the builder is one object per process


class TraceUnavailable(RuntimeError):
    """The kernel does not run in Triton's interpreter here, or this Triton has no builder hooks to record."""


class OutOfBounds(IndexError):
    """A program's load or store hit an address inside no tensor it was given."""


@dataclass(frozen=True)
class Access:
    """One ``tl.load`` or ``tl.store`` of one program, on one tensor: the flat indices of its active lanes."""

    program: Program
    kind: Kind
    tensor: str
    flat: np.ndarray  # element offsets into the tensor (contiguous), only the lanes whose mask was on


@dataclass
class _Span:
    name: str
    start: int
    end: int  # one past the last byte
    itemsize: int
    shape: tuple[int, ...]


class AccessTrace:
    """Record every load and store of the kernels launched inside ``with``; see the module docstring.

    The tensors are given by name: contiguous CPU tensors (the ones the kernel's pointer arguments point at).
    ``accesses`` holds what was recorded, one ``Access`` per load or store of a program on a tensor.
    """

    def __init__(self, **tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(
                    f"{name}: a trace reads contiguous CPU tensors (the interpreter's), got a "
                    f"{'non-contiguous ' if not t.is_contiguous() else ''}{t.device.type} tensor"
                )
        self.tensors: dict[str, torch.Tensor] = dict(tensors)
        self.accesses: list[Access] = []
        self._spans = sorted(
            (
                _Span(n, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size(), tuple(t.shape))
                for n, t in tensors.items()
                if t.numel()
            ),
            key=lambda s: s.start,
        )
        self._builder: Any = None

    # ---- recording ------------------------------------------------------------------------------------------
    def __enter__(self) -> AccessTrace:
        from ..kernels.validation import triton_interpreter_ready

        if not triton_interpreter_ready():
            raise TraceUnavailable(
                "an access trace needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported; "
                "importing minipaged.kernels first does it on a machine without a GPU)"
            )
        try:
            from triton.runtime import interpreter

            builder = interpreter.interpreter_builder
            load, store = type(builder).create_masked_load, type(builder).create_masked_store
        except (ImportError, AttributeError) as e:
            raise TraceUnavailable(f"this Triton's interpreter has no builder to record loads and stores: {e}") from e
        if not _LOCK.acquire(blocking=False):
            raise RuntimeError("another AccessTrace is recording: traces cannot nest")

        def traced_load(ptrs: Any, mask: Any, other: Any, *args: Any) -> Any:
            self._record(builder, "load", ptrs.data, mask.data)
            return load(builder, ptrs, mask, other, *args)

        def traced_store(ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
            self._record(builder, "store", ptrs.data, mask.data)
            return store(builder, ptrs, value, mask, *args)

        builder.create_masked_load, builder.create_masked_store = traced_load, traced_store
        self._builder = builder
        return self

    def __exit__(self, *exc: object) -> None:
        builder, self._builder = self._builder, None
        for name in ("create_masked_load", "create_masked_store"):
            builder.__dict__.pop(name, None)  # the class's own methods show through again
        _LOCK.release()

    def _record(self, builder: Any, kind: Kind, ptrs: np.ndarray, mask: np.ndarray) -> None:
        program: Program = tuple(int(i) for i in builder.grid_idx)  # type: ignore[assignment]
        addresses = np.broadcast_to(ptrs, np.broadcast_shapes(ptrs.shape, mask.shape))[
            np.broadcast_to(mask, np.broadcast_shapes(ptrs.shape, mask.shape))
        ].astype(np.uint64)
        if addresses.size == 0:
            return
        left = np.ones(addresses.shape, dtype=bool)
        for span in self._spans:
            inside = (addresses >= span.start) & (addresses < span.end)
            if inside.any():
                offsets = addresses[inside] - np.uint64(span.start)
                if (offsets % np.uint64(span.itemsize)).any():
                    raise OutOfBounds(
                        f"program {program}: a {kind} of {span.name} at an address that is not the "
                        f"start of an element (byte offsets mixed with element offsets?)"
                    )
                flat = (offsets // np.uint64(span.itemsize)).astype(np.int64)
                self.accesses.append(Access(program, kind, span.name, flat))
                left &= ~inside
        if left.any():
            raise OutOfBounds(self._outside(program, kind, addresses[left]))

    def _outside(self, program: Program, kind: Kind, addresses: np.ndarray) -> str:
        first = int(addresses.min())
        if not self._spans:
            return f"program {program}: a {kind} at address {first:#x}, but the trace was given no tensors"
        nearest = min(self._spans, key=lambda s: min(abs(first - s.start), abs(first - (s.end - 1))))
        where = (first - nearest.start) // nearest.itemsize
        numel = (nearest.end - nearest.start) // nearest.itemsize
        return (
            f"program {program}: {addresses.size} lane(s) of a {kind} fall outside every tensor; the first is "
            f"element {where} of {nearest.name}, which has {numel} elements (shape {list(nearest.shape)}). "
            "Check the offsets and the mask of that tl." + kind
        )

    # ---- reading the trace -------------------------------------------------------------------------------------
    def programs(self) -> list[Program]:
        return sorted({a.program for a in self.accesses})

    def _select(self, tensor: str, kind: Kind, program: Program | None = None) -> Iterator[Access]:
        if tensor not in self.tensors:
            raise KeyError(f"no tensor {tensor!r} in this trace; it has {', '.join(self.tensors) or 'none'}")
        return (a for a in self.accesses if a.tensor == tensor and a.kind == kind and program in (None, a.program))

    def elements(self, tensor: str, kind: Kind, program: Program | None = None) -> np.ndarray:
        """Sorted, unique flat indices of ``tensor`` that ``kind`` touched (in ``program``, or in any)."""
        chunks = [a.flat for a in self._select(tensor, kind, program)]
        return np.unique(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.int64)

    def cells(self, tensor: str, kind: Kind, dims: int = 2, program: Program | None = None) -> set[tuple[int, ...]]:
        """The first ``dims`` coordinates of every touched element: ``(block, slot)`` of a
        ``[num_blocks, block_size, ...]`` cache with the default 2."""
        shape = self.tensors[tensor].shape
        flat = self.elements(tensor, kind, program)
        coords = np.unravel_index(flat, tuple(shape))[:dims]
        return set(zip(*(c.tolist() for c in coords)))

    def by_program(self, tensor: str, kind: Kind, dims: int = 2) -> dict[Program, set[tuple[int, ...]]]:
        """``cells`` for each program that touched ``tensor`` with ``kind``."""
        return {p: got for p in self.programs() if (got := self.cells(tensor, kind, dims, program=p))}

    def count(self, tensor: str, kind: Kind) -> int:
        """Element accesses in all (a tile read twice counts twice): what the kernel moved, in elements."""
        return int(sum(a.flat.size for a in self._select(tensor, kind)))
