"""What many tests share: a clock the test moves by hand, a free loopback port, three GPUs'
identities, and a collector's view of one pass."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from mrc_agent.agent.core.collectors.base import (
    Collector,
    PassView,
    Processes,
    TargetState,
    Update,
)
from mrc_agent.agent.core.collectors.gpu import GpuReadings
from mrc_agent.agent.core.hw.base import GPUIdentity
from mrc_agent.agent.core.sample import Sample
from mrc_agent.agent.core.stacks import StackSample, StacksUnavailable
from mrc_agent.agent.core.targets import Target

T = TypeVar("T")

#: Three GPUs of one H200 node, for the collectors' logic tests.
GPU0 = GPUIdentity(0, "GPU-a", "NVIDIA H200")
GPU1 = GPUIdentity(1, "GPU-b", "NVIDIA H200")
GPU2 = GPUIdentity(2, "GPU-c", "NVIDIA H200")


class Clock:
    """A clock the test sets by hand: ``now`` (also readable and settable as ``t``) is what
    every call returns, on whatever time base the code under test expects."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    @property
    def t(self) -> float:
        return self.now

    @t.setter
    def t(self, value: float) -> None:
        self.now = value


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pass_view(now: float = 1.0, targets: Iterable[int] = (), *, wall: float | None = None,
              processes: Mapping[int, TargetState] | None = None,
              util: Mapping[GPUIdentity, float] | None = None,
              points: Mapping[GPUIdentity, Sequence[tuple[float, float]]] | None = None,
              gpus_of_pid: Mapping[int, Iterable[GPUIdentity]] | None = None,
              outputs: Sequence[object] = ()) -> PassView:
    """A collector's view of one pass at ``now``, watching ``targets`` (PIDs), with what the
    collectors before it would have published: the process collector's ``processes``, the gpu
    collector's ``util``/``points``/``gpus_of_pid`` (each given builds its GpuReadings), and
    any other ``outputs``."""
    published: list[object] = list(outputs)
    if processes is not None:
        published.append(Processes(dict(processes)))
    if util is not None or points is not None or gpus_of_pid is not None:
        published.append(GpuReadings(
            dict(util or {}), dict(points or {}),
            {pid: frozenset(g) for pid, g in (gpus_of_pid or {}).items()}))
    view = PassView(now=now, wall=now if wall is None else wall,
                    targets=tuple(Target(pid, "pid") for pid in targets))
    return view.with_outputs(published)


def published(update: Update, kind: type[T]) -> T | None:
    """The output of type ``kind`` a collector's update published, or None."""
    found = [o for o in update.outputs if isinstance(o, kind)]
    return found[-1] if found else None


def run_pass(view: PassView, collectors: Iterable[Collector]) -> tuple[PassView, list[Sample]]:
    """``collectors`` run in order on ``view`` as the runner runs them, each seeing what those
    before it published: (the last view, every sample). A collector that fails raises, as
    one whose update returns an error (:attr:`Update.error`) is raised here."""
    samples: list[Sample] = []
    for collector in collectors:
        update = collector.update(view)
        if update.error is not None:
            raise update.error
        samples.extend(update.samples)
        view = view.with_outputs(update.outputs)
    return view, samples


class FakeSampler:
    """A stack sampler (the austin child's reader) handing out the samples it is given, once;
    ``error`` is why it cannot run, ``fail`` is raised by ``start``, ``history`` reads them
    all again. Counts its starts and stops."""

    def __init__(self, samples: Sequence[StackSample] = (),
                 error: StacksUnavailable | None = None, alive: bool = True,
                 fail: OSError | None = None) -> None:
        self.samples, self.error, self.alive, self.fail = list(samples), error, alive, fail
        self.kept = list(samples)
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1
        if self.fail is not None:
            raise self.fail

    def running(self) -> bool:
        return self.alive

    def take(self) -> list[StackSample]:
        out, self.samples = self.samples, []
        return out

    def history(self, since: float) -> list[StackSample]:
        return [s for s in self.kept if s.t >= since]

    def stop(self) -> None:
        self.stopped += 1
