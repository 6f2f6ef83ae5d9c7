"""``mrc-agent selfcheck``'s workload layer: GPU work of known size, timed on the GPU.

:class:`Workload` is the small interface the self-check drives; :class:`TorchWorkload` is the
real one (torch, pinned host memory, CUDA events) and ``dry.DryWorkload`` the one
that only reports sizes and durations to a simulated device. Each call blocks until its work
has finished on the GPU and returns a :class:`WorkDone`: how many operations of how many
bytes, the GPU time CUDA events measured and the monotonic window it ran in.

torch is imported only when a :class:`TorchWorkload` is built, so the agent never needs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: Per copy: big enough that launch gaps are negligible (~5 ms at PCIe Gen5 x16), small enough
#: to pin quickly.
COPY_BYTES = 256 << 20
#: Per device-to-device copy: ~20x the H200's L2, so the copy reads DRAM, not cache.
D2D_BYTES = 1 << 30
#: GEMM edge: an 8192^3 bf16 GEMM (1.1 TFLOP, ~2 ms on an H200) fills every SM.
GEMM_N = 8192
#: Operations enqueued between two CUDA event pairs; at most two batches are in flight, so
#: the stream never runs dry and the host never runs far ahead of the GPU.
BATCH = 16

KINDS = ("h2d", "d2h", "d2d", "gemm", "peer")
#: The idle gaps the activity-timeline phase makes, in the order of one round: 50 ms spans two
#: or three 20 ms PM-sampling intervals, 200 ms ten.
GAP_PATTERN_S = (0.05, 0.1, 0.2)


@dataclass(frozen=True)
class WorkDone:
    """What one workload call did: ``count`` operations of ``bytes_per_op`` each, ``gpu_s``
    of GPU time between CUDA events, in the monotonic window ``[start, end]``."""

    kind: str
    count: int
    bytes_per_op: int
    gpu_s: float
    start: float
    end: float

    @property
    def bytes(self) -> int:
        return self.count * self.bytes_per_op

    @property
    def duty(self) -> float:
        """Fraction of the window the GPU spent on this work."""
        wall = self.end - self.start
        return min(1.0, self.gpu_s / wall) if wall > 0 else 0.0

    @property
    def bandwidth(self) -> float:
        """Bytes per second of GPU time."""
        return self.bytes / self.gpu_s if self.gpu_s > 0 else 0.0


@dataclass(frozen=True)
class GapsDone(WorkDone):
    """Busy stretches of GEMMs with idle gaps between them made on purpose: ``gaps`` holds
    ``(planned seconds, start, end)`` per gap, ``start`` when the busy stretch before it had
    finished on the GPU and ``end`` when the next one was enqueued, both monotonic. The
    counts and GPU time are the GEMMs'; the window runs from the first GEMM to the last."""

    gaps: tuple[tuple[float, float, float], ...] = ()

    @property
    def idle_s(self) -> float:
        return sum(end - start for _, start, end in self.gaps)

    @property
    def busy_duty(self) -> float:
        """Fraction of the busy stretches (the window less the gaps) the GEMMs kept the GPU
        busy."""
        busy = self.end - self.start - self.idle_s
        return min(1.0, self.gpu_s / busy) if busy > 0 else 0.0


def gap_sequence(rounds: int, pattern: Sequence[float] = GAP_PATTERN_S) -> list[float]:
    """``rounds`` rounds of ``pattern``, interleaved so each length is spread over the phase."""
    return [g for _ in range(rounds) for g in pattern]


def busy_with_gaps(gemm: Callable[[float], WorkDone], sleep: Callable[[float], None],
                   busy_s: float, gaps: Sequence[float]) -> GapsDone:
    """``gemm(busy_s)``, then for each of ``gaps`` that long idle and ``gemm(busy_s)`` again.
    Each gap runs from one stretch's end (its final synchronisation) to the next one's start
    (its first enqueue), so it holds whatever the sleep overshot."""
    runs = [gemm(busy_s)]
    marks = []
    for gap in gaps:
        sleep(gap)
        runs.append(gemm(busy_s))
        marks.append((gap, runs[-2].end, runs[-1].start))
    first, last = runs[0], runs[-1]
    return GapsDone("idle_gaps", sum(r.count for r in runs), first.bytes_per_op,
                    sum(r.gpu_s for r in runs), first.start, last.end, tuple(marks))


class Workload(Protocol):
    """GPU work of known size on the GPU under test (and its NVLink peers)."""

    def uuids(self) -> list[str]:
        """The UUIDs of the CUDA devices, in CUDA order (index 0 is the GPU under test)."""
        ...

    def peers(self) -> list[tuple[int, int]]:
        """Ordered pairs of CUDA devices with peer access."""
        ...

    def copy(self, kind: str, seconds: float) -> WorkDone:
        """Back-to-back copies of one ``kind`` (h2d, d2h, d2d) for about ``seconds``."""
        ...

    def gemm(self, seconds: float | None = None, count: int | None = None) -> WorkDone:
        """bf16 GEMMs for about ``seconds``, or exactly ``count`` of them."""
        ...

    def peer_copy(self, src: int, dst: int, seconds: float) -> WorkDone:
        """Device ``src`` -> device ``dst`` copies for about ``seconds``."""
        ...

    def idle(self, seconds: float) -> None:
        ...

    def idle_gaps(self, busy_s: float, gaps: Sequence[float]) -> GapsDone:
        """bf16 GEMMs for about ``busy_s``, then idle for each of ``gaps`` in turn with
        ``busy_s`` of GEMMs after each (:func:`busy_with_gaps`)."""
        ...

    def close(self) -> None:
        ...


class CudaUnavailable(RuntimeError):
    """No CUDA GPU to run the workload on (no torch, a CPU build, no device)."""


class TorchWorkload:
    """The workload on real GPUs through torch; built only where CUDA is available."""

    def __init__(self, copy_bytes: int = COPY_BYTES, d2d_bytes: int = D2D_BYTES,
                 gemm_n: int = GEMM_N) -> None:
        try:
            import torch
        except ImportError as exc:
            raise CudaUnavailable(f"torch is not installed ({exc})") from exc
        if not torch.cuda.is_available():
            build = getattr(torch.version, "cuda", None)
            raise CudaUnavailable(
                f"torch {torch.__version__} sees no CUDA GPU"
                + ("" if build else " (a CPU-only build)"))
        self.torch: Any = torch
        self.dev = torch.device("cuda", 0)
        torch.cuda.set_device(self.dev)
        u8 = torch.uint8
        self.host_src = torch.full((copy_bytes,), 7, dtype=u8).pin_memory()
        self.host_dst = torch.empty(copy_bytes, dtype=u8, pin_memory=True)
        self.dev_buf = torch.empty(copy_bytes, dtype=u8, device=self.dev)
        self.d2d_src = torch.ones(d2d_bytes, dtype=u8, device=self.dev)
        self.d2d_dst = torch.empty(d2d_bytes, dtype=u8, device=self.dev)
        bf16 = torch.bfloat16
        self.a = torch.randn(gemm_n, gemm_n, dtype=bf16, device=self.dev)
        self.b = torch.randn(gemm_n, gemm_n, dtype=bf16, device=self.dev)
        self.c = torch.empty(gemm_n, gemm_n, dtype=bf16, device=self.dev)
        self._peer_bufs: dict[int, Any] = {}
        # First calls initialise cuBLAS and the copy paths; not part of any measurement.
        for kind in ("h2d", "d2h", "d2d"):
            self._op(kind)()
        self._op("gemm")()
        torch.cuda.synchronize(self.dev)

    def uuids(self) -> list[str]:
        # torch prints CUDA's UUID as 8-4-4-4-12 hex; NVML spells it "GPU-" + the same.
        out = []
        for i in range(self.torch.cuda.device_count()):
            raw = str(getattr(self.torch.cuda.get_device_properties(i), "uuid", ""))
            hexpart = raw.lower().removeprefix("gpu-")
            out.append(f"GPU-{hexpart}" if hexpart else "")
        return out

    def peers(self) -> list[tuple[int, int]]:
        n = self.torch.cuda.device_count()
        return [(a, b) for a in range(n) for b in range(n)
                if a != b and self.torch.cuda.can_device_access_peer(a, b)]

    def _op(self, kind: str) -> Callable[[], None]:
        # torch's in-place ops return the tensor; the loop wants calls that return nothing.
        def h2d() -> None:
            self.dev_buf.copy_(self.host_src, non_blocking=True)

        def d2h() -> None:
            self.host_dst.copy_(self.dev_buf, non_blocking=True)

        def d2d() -> None:
            self.d2d_dst.copy_(self.d2d_src)

        def gemm() -> None:
            self.torch.matmul(self.a, self.b, out=self.c)

        ops = {"h2d": h2d, "d2h": d2h, "d2d": d2d, "gemm": gemm}
        if kind not in ops:
            raise ValueError(f"unknown workload kind {kind!r}")
        return ops[kind]

    def _loop(self, kind: str, op: Callable[[], None], bytes_per_op: int,
              seconds: float | None, count: int | None) -> WorkDone:
        torch = self.torch
        pending: list[tuple[Any, Any]] = []
        done = 0
        start = time.monotonic()
        while True:
            if count is not None and done >= count:
                break
            if count is None and time.monotonic() - start >= (seconds or 0.0):
                break
            k = BATCH if count is None else min(BATCH, count - done)
            first = torch.cuda.Event(enable_timing=True)
            last = torch.cuda.Event(enable_timing=True)
            first.record()
            for _ in range(k):
                op()
            last.record()
            pending.append((first, last))
            done += k
            if len(pending) >= 2:
                pending[-2][1].synchronize()  # releases the GIL while it waits
        torch.cuda.synchronize()
        end = time.monotonic()
        gpu_s = sum(a.elapsed_time(b) for a, b in pending) / 1e3
        return WorkDone(kind, done, bytes_per_op, gpu_s, start, end)

    def copy(self, kind: str, seconds: float) -> WorkDone:
        size = {"h2d": self.host_src, "d2h": self.host_dst, "d2d": self.d2d_src}[kind].numel()
        return self._loop(kind, self._op(kind), int(size), seconds, None)

    def gemm(self, seconds: float | None = None, count: int | None = None) -> WorkDone:
        # bytes_per_op: the three matrices, a lower bound of what one GEMM moves
        size = 3 * self.a.numel() * self.a.element_size()
        return self._loop("gemm", self._op("gemm"), int(size), seconds, count)

    def peer_copy(self, src: int, dst: int, seconds: float) -> WorkDone:
        torch = self.torch
        if src != 0:
            raise ValueError("peer copies start on device 0, the GPU under test")
        if dst not in self._peer_bufs:
            self._peer_bufs[dst] = torch.empty_like(self.dev_buf, device=f"cuda:{dst}")
        target = self._peer_bufs[dst]

        def peer() -> None:
            target.copy_(self.dev_buf, non_blocking=True)

        work = self._loop("peer", peer, int(self.dev_buf.numel()), seconds, None)
        torch.cuda.synchronize(dst)
        return work

    def idle(self, seconds: float) -> None:
        time.sleep(seconds)

    def idle_gaps(self, busy_s: float, gaps: Sequence[float]) -> GapsDone:
        return busy_with_gaps(lambda s: self.gemm(seconds=s), time.sleep, busy_s, gaps)

    def close(self) -> None:
        self._peer_bufs.clear()
        self.torch.cuda.empty_cache()


#: The mixed workload the trace is recorded under: a slice of each kind, then idle.
MIXED_SEQUENCE = ("h2d", "gemm", "d2h", "d2d", "idle")


def run_mixed(work: Workload, stop: threading.Event, slice_s: float) -> list[WorkDone]:
    """Cycle through :data:`MIXED_SEQUENCE`, ``slice_s`` seconds each, until ``stop`` is set."""
    done: list[WorkDone] = []
    while not stop.is_set():
        for kind in MIXED_SEQUENCE:
            if stop.is_set():
                break
            if kind == "idle":
                stop.wait(slice_s)
            elif kind == "gemm":
                done.append(work.gemm(seconds=slice_s))
            else:
                done.append(work.copy(kind, slice_s))
    return done
