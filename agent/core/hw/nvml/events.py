"""XID critical-error events: one NVML event set per GPU, polled without blocking.

Each GPU gets its own event set when the session opens it, so every event is attributed to its
GPU without comparing handles. Each device sample drains the set with a zero timeout. The
cumulative count and the last XID code outlive NVML sessions (keyed by GPU UUID): a re-init
after a GPU error must not reset the counter.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.base import DeviceSample
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, quietly

#: A burst of XID events is drained up to this many per GPU per sample; the rest stay queued in
#: NVML for the next sample, so one sample never spins on a storm.
MAX_EVENTS_PER_POLL = 256


class XidEvents:
    """Registers each GPU's XID event set and counts the events it delivers."""

    def __init__(self, memo: Memo) -> None:
        self._memo = memo
        self._total: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def attach(self, lib: Any, gpu: Gpu) -> None:
        """Give a newly opened GPU its event set (``None`` where events are not supported)."""
        gpu.event_set = self._register(lib, gpu)

    def release(self, lib: Any, gpu: Gpu) -> None:
        """Free the GPU's event set at teardown; NVML errors are ignored."""
        if gpu.event_set is not None:
            quietly(lib, "freeing an event set", partial(lib.nvmlEventSetFree, gpu.event_set))

    def poll(self, lib: Any, gpu: Gpu, s: DeviceSample) -> None:
        """Drain the GPU's pending events and set ``s``'s XID count and last XID."""
        if gpu.event_set is None:
            return
        uuid = gpu.identity.uuid
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                # Timeout 0: return at once; NVML_ERROR_TIMEOUT here only means "no event".
                event = lib.nvmlEventSetWait(gpu.event_set, 0)
            except lib.NVMLError as err:
                if err.value == lib.NVML_ERROR_TIMEOUT:
                    break
                raise
            if int(event.eventType) & int(lib.nvmlEventTypeXidCriticalError):
                self._total[uuid] = self._total.get(uuid, 0) + 1
                self._last[uuid] = int(event.eventData)
        s.xid_errors_total = float(self._total.get(uuid, 0))
        last = self._last.get(uuid)
        s.last_xid = float(last) if last is not None else None

    def _register(self, lib: Any, gpu: Gpu) -> Any | None:
        """An event set for this GPU's XID errors, or None where events are not supported."""
        event_set = self._memo.optional(lib, gpu, "xid_events", lib.nvmlEventSetCreate)
        if event_set is None:
            return None

        def register() -> bool:
            lib.nvmlDeviceRegisterEvents(gpu.handle, lib.nvmlEventTypeXidCriticalError, event_set)
            return True

        try:
            registered = self._memo.optional(lib, gpu, "xid_events", register)
        except lib.NVMLError:
            quietly(lib, "freeing an event set", lambda: lib.nvmlEventSetFree(event_set))
            raise
        if registered is None:
            quietly(lib, "freeing an event set", lambda: lib.nvmlEventSetFree(event_set))
            return None
        # Registered: from now on this GPU reports a count (0 until the first event).
        self._total.setdefault(gpu.identity.uuid, 0)
        return event_set
