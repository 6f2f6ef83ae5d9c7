"""The GPU sources a set of collectors reads, typed by the hardware Protocols of
:mod:`mrc_agent.agent.core.hw.base`. :func:`mrc_agent.agent.core.wiring.make_sources` builds
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mrc_agent.agent.core.hw.base import DeviceSource, GpmSource, ProfilingSource


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class Sources:
    """The GPU sources the collectors read; ``None`` where the backend is 'none' (or, for
    ``profiling``, where it was not asked for). ``owned`` lists what :meth:`close` closes."""

    device: DeviceSource | None = None
    gpm: GpmSource | None = None
    profiling: ProfilingSource | None = None
    owned: tuple[Closable, ...] = ()

    def close(self) -> None:
        """Close what was opened for these sources (one object may be several sources, and
        is listed once)."""
        for part in self.owned:
            part.close()
