""":class:`NvmlBackend`, the NVML adapter's face: the parts of this package, composed.

It owns one of each part (session, memo, device reader, PCIe reader, NVLink counters, GPM
sampler, XID events), holds the session lock around every public call, and turns an
``NVMLError`` escaping a part into the project's error through the session. It also answers
``doctor``'s :meth:`NvmlBackend.info`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mrc_agent.agent.core.hw.base import DeviceSample, GpmSample, HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.nvml.device import DeviceReader, default_sample_clocks
from mrc_agent.agent.core.hw.nvml.events import XidEvents
from mrc_agent.agent.core.hw.nvml.gpm import DEFAULT_GPM_INTERVAL_S, GpmSampler
from mrc_agent.agent.core.hw.nvml.mig import MigDevices
from mrc_agent.agent.core.hw.nvml.nvlink import NvlinkCounters
from mrc_agent.agent.core.hw.nvml.pcie import (
    DEFAULT_PCIE_PERIOD_S,
    DEFAULT_PCIE_STALE_AFTER_S,
    PcieReader,
)
from mrc_agent.agent.core.hw.nvml.pcie_counters import NarrowCounterReader, PcieCounters
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, NvmlSession, decode_text


class NvmlBackend:
    """NVML device and GPM source; implements ``DeviceSource`` and ``GpmSource``.

    ``lib`` is the ``pynvml`` module or a stand-in with the same names; ``None`` imports
    ``pynvml`` on first use. ``clock`` is the monotonic clock samples are stamped with;
    ``wall_clock`` is the Unix-epoch clock; ``sample_clocks`` (default: it, the boot clock and
    the monotonic clock) the clocks NVML's utilisation-sample timestamps may be on, one of
    which is identified per GPU from its first batch.
    All public methods are safe to call from several threads.

    GPM is sampled at most every ``gpm_interval`` seconds (at least
    :data:`~mrc_agent.agent.core.hw.nvml.gpm.MIN_GPM_INTERVAL_S`), timed on ``gpm_clock`` (default
    ``clock``); calls in between return the last window's values again.

    PCIe throughput is read by a daemon thread
    (:data:`~mrc_agent.agent.core.hw.nvml.pcie.PCIE_THREAD_NAME`) started by the first successful
    :meth:`sample_devices` and stopped by :meth:`close`: one round over the GPUs, then a pause of
    ``pcie_period`` seconds. Samples report its latest values, or ``None`` when they are older than
    ``pcie_stale_after`` seconds. ``pcie_thread=False`` starts no thread; the values then only come
    from calling ``PcieReader.run_round`` on ``_pcie`` (what the tests do).

    PCIe byte counters under 64 bits wide are read by a second daemon thread
    (:data:`~mrc_agent.agent.core.hw.nvml.pcie_counters.NARROW_THREAD_NAME`) often enough
    that none wraps unseen; ``pcie_thread=False`` starts neither (``_narrow.run_round``).
    """

    def __init__(
        self,
        lib: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        pcie_period: float = DEFAULT_PCIE_PERIOD_S,
        pcie_stale_after: float = DEFAULT_PCIE_STALE_AFTER_S,
        pcie_thread: bool = True,
        gpm_interval: float = DEFAULT_GPM_INTERVAL_S,
        gpm_clock: Callable[[], float] | None = None,
        sample_clocks: dict[str, Callable[[], float]] | None = None,
    ) -> None:
        # Everything remembered per GPU UUID (unsupported queries, GPM support, XID counts,
        # the last utilisation timestamp) lives in the parts, not in the session: a re-init
        # after a GPU error must not forget capabilities, reset the XID counter or re-read old
        # utilisation samples.
        self._clock = clock
        self._memo = Memo()
        self._xid = XidEvents(self._memo)
        self._gpm = GpmSampler(
            self._memo, clock=gpm_clock or clock, interval=gpm_interval
        )
        self._nvlink = NvlinkCounters(self._memo)
        self._mig = MigDevices(self._memo)
        self._session = NvmlSession(
            lib, self._memo, open_gpu=self._xid.attach, close_gpu=self._release_gpu
        )
        self._pcie_counters = PcieCounters(self._memo, clock)
        self._narrow = NarrowCounterReader(
            self._session, self._memo, self._pcie_counters, thread=pcie_thread
        )
        self._pcie = PcieReader(
            self._session,
            self._memo,
            clock,
            period=pcie_period,
            stale_after=pcie_stale_after,
            thread=pcie_thread,
            skip=self._pcie_counters.live,
        )
        self._device = DeviceReader(
            self._memo,
            clock,
            sample_clocks or default_sample_clocks(wall_clock),
            pcie=self._pcie,
            pcie_counters=self._pcie_counters,
            nvlink=self._nvlink,
            xid=self._xid,
        )

    # --- public API --------------------------------------------------------------------------

    def sample_devices(self) -> list[DeviceSample]:
        """One :class:`DeviceSample` per GPU. Raises SourceUnavailable or HardwareError."""
        session = self._session
        with session.lock:
            gpus = session.ensure_ready()
            lib = session.require_lib()
            try:
                samples = []
                for gpu in gpus:
                    samples.append(self._device.sample(lib, gpu))
                    samples.extend(
                        self._device.sample_mig(lib, mig) for mig in self._mig.devices(lib, gpu)
                    )
            except lib.NVMLError as err:
                raise session.failure(err, "sampling devices") from err
            session.note_success()
            if not all(self._pcie_counters.live(gpu.identity.uuid) for gpu in gpus):
                self._pcie.start()  # only for GPUs the byte counters do not serve
            self._narrow.start()  # only once a GPU's byte counters are narrow
            return samples

    def sample_gpm(self) -> list[GpmSample]:
        """One :class:`GpmSample` per GPM-capable GPU; a GPU's first call only primes it.

        Raises ``SourceUnavailable("gpm_unsupported")`` when no GPU supports GPM.
        """
        session = self._session
        with session.lock:
            gpus = session.ensure_ready()
            lib = session.require_lib()
            out: list[GpmSample] = []
            try:
                for gpu in gpus:
                    if not self._gpm.supported(lib, gpu):
                        continue
                    # In MIG mode GPM is sampled per GPU instance, never for the whole GPU.
                    for part in self._mig.devices(lib, gpu) or [gpu]:
                        sample = self._gpm.sample(lib, part)
                        if sample is not None:
                            out.append(sample)
            except lib.NVMLError as err:
                raise session.failure(err, "sampling GPM") from err
            if not self._gpm.any_supported(gpus):
                raise session.unavailable(
                    "gpm_unsupported", "no GPU supports NVML GPM (Hopper or newer is required)"
                )
            session.note_success()
            return out

    def info(self) -> dict[str, Any]:
        """What ``doctor`` prints: versions, GPUs and their capabilities, and any error text.

        Never raises for NVML trouble: a failure is reported in ``reason``/``error``.
        """
        with self._session.lock:
            out: dict[str, Any] = {
                "available": False,
                "reason": None,
                "error": None,
                "driver_version": None,
                "nvml_version": None,
                "cuda_driver_version": None,
                "gpus": [],
            }
            try:
                gpus = self._session.ensure_ready()
            except SourceUnavailable as err:
                out["reason"], out["error"] = err.reason, str(err)
                return out
            except HardwareError as err:
                out["error"] = str(err)
                return out
            lib = self._session.require_lib()
            out["available"] = True
            errors: list[str] = []
            versions: tuple[tuple[str, Callable[[], Any]], ...] = (
                ("driver_version", lambda: decode_text(lib.nvmlSystemGetDriverVersion())),
                ("nvml_version", lambda: decode_text(lib.nvmlSystemGetNVMLVersion())),
                (
                    "cuda_driver_version",
                    lambda: _cuda_version(lib.nvmlSystemGetCudaDriverVersion()),
                ),
            )
            for key, query in versions:
                try:
                    out[key] = query()
                except lib.NVMLError as err:
                    errors.append(f"{key}: {err}")
            for gpu in gpus:
                out["gpus"].append(self._gpu_info(lib, gpu))
            if errors:
                out["error"] = "; ".join(errors)
            return out

    def compare_pcie(
        self, seconds: float = 1.0, sleep: Callable[[float], None] = time.sleep
    ) -> dict[str, dict[str, float | None]]:
        """Both PCIe readings over one window, per GPU UUID, for ``doctor`` to print side by
        side: the byte counters' rate over ``seconds`` and the throughput call taken inside
        that window (``None`` where a GPU lacks one). Bytes per second, TX and RX."""
        with self._session.lock:
            gpus = self._session.ensure_ready()
            lib = self._session.require_lib()
            start = self._device.pcie_counters(lib, gpus)
            begun = self._clock()
        throughput = self._pcie.read_once(lib, gpus)  # 20 ms per direction, without the lock
        sleep(max(0.0, seconds - (self._clock() - begun)))
        with self._session.lock:
            end = self._device.pcie_counters(lib, gpus)
            took = self._clock() - begun
        out: dict[str, dict[str, float | None]] = {}
        for gpu in gpus:
            uuid = gpu.identity.uuid
            a, b = start.get(uuid), end.get(uuid)
            row: dict[str, float | None] = {
                "counter_tx": None, "counter_rx": None, "call_tx": None, "call_rx": None}
            if a is not None and b is not None and took > 0:
                row["counter_tx"] = (b[0] - a[0]) / took
                row["counter_rx"] = (b[1] - a[1]) / took
            if uuid in throughput:
                row["call_tx"], row["call_rx"] = throughput[uuid]
            out[uuid] = row
        return out

    def run_background_round(self) -> None:
        """One round of what the PCIe threads read, in the caller's thread: for a caller that
        starts neither (``pcie_thread=False``) and moves a clock of its own on, as ``tracegen``
        does. Never raises for NVML errors."""
        self._pcie.run_round()
        self._narrow.run_round()

    def close(self) -> None:
        """Stop the PCIe thread, free event sets and GPM buffers and shut NVML down.

        Safe to call twice. A later :meth:`sample_devices` starts NVML and the thread again.
        """
        # Stopped first and outside the lock: the threads take it for their snapshot of the GPUs.
        self._pcie.stop()
        self._narrow.stop()
        with self._session.lock:
            self._session.shutdown()
            self._pcie.clear()

    # --- parts -------------------------------------------------------------------------------

    def _release_gpu(self, lib: Any, gpu: Gpu) -> None:
        """At teardown: free what the parts set up on this GPU, GPM buffers then event set."""
        for mig in gpu.mig_devices or []:
            self._gpm.release(lib, mig)
        self._gpm.release(lib, gpu)
        self._xid.release(lib, gpu)

    def _gpu_info(self, lib: Any, gpu: Gpu) -> dict[str, Any]:
        errors: list[str] = []
        gpm: bool | None = None
        links: int | None = None
        try:
            gpm = self._gpm.supported(lib, gpu)
        except lib.NVMLError as err:
            errors.append(f"gpm: {err}")
        try:
            links = len(self._nvlink.active_links(lib, gpu))
        except lib.NVMLError as err:
            errors.append(f"nvlink: {err}")
        mig: list[str] | None = None
        try:
            mig = [d.identity.uuid for d in self._mig.devices(lib, gpu)]
        except lib.NVMLError as err:
            errors.append(f"mig: {err}")
        return {
            "index": gpu.index,
            "uuid": gpu.identity.uuid,
            "name": gpu.identity.name,
            "gpm_supported": gpm,
            "nvlink_active_links": links,
            "mig_devices": mig,
            "unsupported": self._memo.unsupported(gpu.identity.uuid),
            "errors": errors,
        }


def _cuda_version(raw: int) -> str:
    """nvmlSystemGetCudaDriverVersion's integer (e.g. 12040) as "12.4"."""
    return f"{raw // 1000}.{raw % 1000 // 10}"
