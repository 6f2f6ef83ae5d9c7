"""The service's door to ``torch.cuda`` for its own measurements: stage boundaries and peak memory.

Two numbers the service exports are wrong unless they allow for how a CUDA device works:

* Stage times. Kernels run asynchronously: a stage whose end is stamped while its kernels are
  still queued hands their time to the next stage (the GPU resize landed in ``prefill``).
  :func:`wait_for_queued_work` blocks until the calling thread's work on the device has run.
* Peak memory. ``torch.cuda.max_memory_allocated`` is one counter for the whole process: it
  includes the weights and whatever other requests hold on the device at the time.
  :func:`peak_memory` reads it over one generation and says, with :class:`DeviceUsers`, how many
  other requests had work or tensors on the device meanwhile, so a reading can be taken for what
  it is: the request's own peak when that count is 0, a shared one otherwise.

Only these functions call ``torch.cuda`` for measuring, through a :class:`CudaAPI` that is
``torch.cuda`` itself unless a test passes a hand-written fake (there is no GPU on CI). On a CPU
device neither does anything.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class _Event(Protocol):
    def synchronize(self) -> None: ...


class _Stream(Protocol):
    def record_event(self) -> _Event: ...


class CudaAPI(Protocol):
    """The part of ``torch.cuda`` this module calls: ``torch.cuda`` itself, or a test fake."""

    def current_stream(self, device: torch.device) -> _Stream: ...

    def reset_peak_memory_stats(self, device: torch.device) -> None: ...

    def max_memory_allocated(self, device: torch.device) -> int: ...


def _cuda_device(device: str | torch.device) -> torch.device | None:
    dev = torch.device(device)
    return dev if dev.type == "cuda" else None


def wait_for_queued_work(device: str | torch.device, cuda: CudaAPI = torch.cuda) -> None:
    """Block until the work this thread queued on ``device`` so far has run; nothing on a CPU.

    Called before a stage's end is stamped, so the stage's kernels are charged to that stage.
    """
    dev = _cuda_device(device)
    if dev is None:
        return
    # An event on this thread's current stream, not torch.cuda.synchronize(): that would also
    # wait for kernels another thread (the generation) queues after ours, and charge them here.
    cuda.current_stream(dev).record_event().synchronize()


class DeviceUsers:
    """The requests that hold work or tensors on the model's device now, by a token each.

    A request :meth:`occupy`-es the device from its first queued kernel (preprocessing) until
    it lets go of its last tensor (after generation); a measuring :meth:`window` collects
    every token that was there at any moment while it was open. Thread-safe: the pipeline
    occupies from the event loop, the window opens on the model thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._now: set[int] = set()
        #: Open windows, each the set of tokens seen while it was open.
        self._windows: list[set[int]] = []

    @property
    def count(self) -> int:
        """How many requests occupy the device now."""
        with self._lock:
            return len(self._now)

    @contextlib.contextmanager
    def occupy(self) -> Iterator[int]:
        """Occupy the device for the block; yields this request's token."""
        with self._lock:
            token = self._next
            self._next += 1
            self._now.add(token)
            for seen in self._windows:
                seen.add(token)
        try:
            yield token
        finally:
            with self._lock:
                self._now.discard(token)

    @contextlib.contextmanager
    def window(self, own: int | None = None) -> Iterator[set[int]]:
        """For the block, collect the tokens of every request on the device, ``own`` left out.

        The yielded set is complete once the block has exited.
        """
        seen: set[int]
        with self._lock:
            seen = set(self._now)
            self._windows.append(seen)
        try:
            yield seen
        finally:
            with self._lock:
                # By identity: two open windows may hold equal sets.
                self._windows = [w for w in self._windows if w is not seen]
            if own is not None:
                seen.discard(own)


@dataclass
class PeakReading:
    """What :func:`peak_memory` read; both None on a CPU device, filled when its block exits."""

    #: Peak of the process's allocated device memory while the block ran (weights included).
    nbytes: int | None = None
    #: Other requests that had work or tensors on the device at some moment meanwhile.
    shared_with: int | None = None


@contextlib.contextmanager
def peak_memory(device: str | torch.device, users: DeviceUsers, own: int | None = None,
                cuda: CudaAPI = torch.cuda) -> Iterator[PeakReading]:
    """Measure the process-wide peak of allocated memory on ``device`` over the block.

    ``own`` is the token of the request measured (None for warmup). The allocator's peak is
    reset at the start, which is safe only because one measurement runs at a time (the model
    lock serialises generations, the only callers).
    """
    reading = PeakReading()
    dev = _cuda_device(device)
    if dev is None:
        yield reading
        return
    with users.window(own) as others:
        cuda.reset_peak_memory_stats(dev)
        yield reading
        reading.nbytes = int(cuda.max_memory_allocated(dev))
    reading.shared_with = len(others)
