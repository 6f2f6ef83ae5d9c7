"""GPU collector: NVML device state — utilisation, memory, PCIe, NVLink, power, clocks,
errors and per-target device memory.

It only translates :class:`mrc_agent.agent.core.hw.base.DeviceSample` into metric samples; which
library answered (NVML or a replayed trace) is the source's business. It leaves each GPU's
utilisation (and its fine-grained points) and the GPUs each target holds memory on to the derived
collector in its output, :class:`GpuReadings`.

It also decides which GPUs are reported this pass (:mod:`mrc_agent.agent.core.attribution`: by
default the GPUs the targets can use), publishes that decision for the gpm and profiling
collectors (its last one when it fails), and skips the other GPUs; :func:`attribution_samples`
exports the decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mrc_agent.agent.core import attribution
from mrc_agent.agent.core.attribution import MODE_TARGETS, Attribution
from mrc_agent.agent.core.collectors.base import (
    GPU,
    PROC,
    BuildContext,
    CollectorDef,
    FinisherDef,
    PassView,
    Processes,
    Update,
    field_samples,
    require,
)
from mrc_agent.agent.core.hw.base import DeviceSource, GPUIdentity
from mrc_agent.agent.core.sample import Sample, counter, gauge, info

NAME = "gpu"

UTILIZATION = gauge(
    NAME, "mrc_gpu_utilization_ratio", GPU,
    "Fraction of the last NVML sample period during which a kernel ran on the GPU.")
MEMORY_UTILIZATION = gauge(
    NAME, "mrc_gpu_memory_utilization_ratio", GPU,
    "Fraction of the last NVML sample period during which device memory was read or "
    "written.")
MEMORY_USED = gauge(NAME, "mrc_gpu_memory_used_bytes", GPU, "Device memory in use.")
MEMORY_TOTAL = gauge(NAME, "mrc_gpu_memory_total_bytes", GPU, "Device memory installed.")
#: Where both PCIe rates come from.
_PCIE_RATE_SOURCE = (
    "over the last sampling interval from NVML's PCIe byte counters where the driver has them, "
    "else NVML's 20 ms throughput reading (mrc_gpu_source_info says which).")
PCIE_TX = gauge(NAME, "mrc_gpu_pcie_tx_bytes_per_second", GPU,
                "PCIe transmit throughput (device to host): " + _PCIE_RATE_SOURCE)
PCIE_RX = gauge(NAME, "mrc_gpu_pcie_rx_bytes_per_second", GPU,
                "PCIe receive throughput (host to device): " + _PCIE_RATE_SOURCE)
PCIE_TX_BYTES = counter(NAME, "mrc_gpu_pcie_tx_bytes_total", GPU,
                        "PCIe bytes transmitted (device to host), NVML's PCIe byte counter.")
PCIE_RX_BYTES = counter(NAME, "mrc_gpu_pcie_rx_bytes_total", GPU,
                        "PCIe bytes received (host to device), NVML's PCIe byte counter.")
PCIE_DROPPED = counter(
    NAME, "mrc_gpu_pcie_dropped_intervals_total", GPU + ("direction", "reason"),
    "Intervals between two reads of NVML's PCIe byte counter that were left out of "
    "mrc_gpu_pcie_tx_bytes_total or mrc_gpu_pcie_rx_bytes_total, so those totals under-read: "
    "reason gap (reads too far apart to tell how often a 32-bit counter wrapped) or "
    "impossible (an increase the link cannot carry).")
PCIE_REPLAYS = counter(NAME, "mrc_gpu_pcie_replays_total", GPU,
                       "PCIe replay events (link errors).")
NVLINK_TX = counter(NAME, "mrc_gpu_nvlink_tx_bytes_total", GPU,
                    "NVLink data bytes transmitted over all links (NVML's aggregate scope "
                    "where the driver has it).")
NVLINK_RX = counter(NAME, "mrc_gpu_nvlink_rx_bytes_total", GPU,
                    "NVLink data bytes received over all links (NVML's aggregate scope where "
                    "the driver has it).")
NVLINK_LINK_TX = counter(NAME, "mrc_gpu_nvlink_link_tx_bytes_total", GPU + ("link",),
                         "NVLink data bytes transmitted on one link (only while the links "
                         "sum to the aggregate).")
NVLINK_LINK_RX = counter(NAME, "mrc_gpu_nvlink_link_rx_bytes_total", GPU + ("link",),
                         "NVLink data bytes received on one link (only while the links sum "
                         "to the aggregate).")
#: Label of :data:`SOURCE_INFO` per key of ``DeviceSample.sources``.
SOURCE_KEYS = ("pcie", "nvlink", "util_clock")
SOURCE_INFO = info(
    NAME, "mrc_gpu_source_info", GPU + SOURCE_KEYS,
    "Which NVML reading is live on this GPU where there is a choice: pcie (byte_counters or "
    "throughput_call), nvlink (aggregate, per_link_sum or per_link_repeats_aggregate) and "
    "util_clock (the clock utilisation-sample timestamps were found on: realtime, boottime, "
    "monotonic or unknown); empty where the GPU has none.")
POWER = gauge(NAME, "mrc_gpu_power_watts", GPU, "Board power draw.")
SM_CLOCK = gauge(NAME, "mrc_gpu_sm_clock_hertz", GPU, "Current SM clock.")
TEMPERATURE = gauge(NAME, "mrc_gpu_temperature_celsius", GPU, "GPU core temperature.")
ECC_ERRORS = counter(NAME, "mrc_gpu_ecc_errors_total", GPU + ("kind",),
                     "Volatile ECC errors since the driver loaded, corrected or uncorrected.")
XID_ERRORS = counter(NAME, "mrc_gpu_xid_errors_total", GPU,
                     "Critical XID errors seen since the agent started.")
LAST_XID = gauge(NAME, "mrc_gpu_last_xid", GPU, "Code of the last critical XID error seen.")
PROCESS_MEMORY_USED = gauge(NAME, "mrc_gpu_process_memory_used_bytes", GPU + PROC,
                            "Device memory held by a target process on this GPU.")

METRICS = (UTILIZATION, MEMORY_UTILIZATION, MEMORY_USED, MEMORY_TOTAL, PCIE_TX, PCIE_RX,
           PCIE_TX_BYTES, PCIE_RX_BYTES, PCIE_DROPPED, SOURCE_INFO, PCIE_REPLAYS, NVLINK_TX,
           NVLINK_RX, NVLINK_LINK_TX, NVLINK_LINK_RX, POWER, SM_CLOCK, TEMPERATURE, ECC_ERRORS,
           XID_ERRORS, LAST_XID, PROCESS_MEMORY_USED)

#: DeviceSample attribute -> metric, for the plain one-value-per-GPU fields.
_DEVICE_FIELDS = {
    "gpu_util": UTILIZATION,
    "mem_util": MEMORY_UTILIZATION,
    "mem_used_bytes": MEMORY_USED,
    "mem_total_bytes": MEMORY_TOTAL,
    "pcie_tx_bytes_per_second": PCIE_TX,
    "pcie_rx_bytes_per_second": PCIE_RX,
    "pcie_tx_bytes_total": PCIE_TX_BYTES,
    "pcie_rx_bytes_total": PCIE_RX_BYTES,
    "pcie_replays_total": PCIE_REPLAYS,
    "nvlink_tx_bytes_total": NVLINK_TX,
    "nvlink_rx_bytes_total": NVLINK_RX,
    "power_watts": POWER,
    "sm_clock_hertz": SM_CLOCK,
    "temperature_celsius": TEMPERATURE,
    "xid_errors_total": XID_ERRORS,
    "last_xid": LAST_XID,
}


@dataclass(frozen=True)
class GpuReadings:
    """The gpu collector's output for the derived signals: each watched GPU's latest
    utilisation and its fine-grained (time, utilisation) points, and the GPUs on which each
    target PID holds memory."""

    util: Mapping[GPUIdentity, float]
    util_points: Mapping[GPUIdentity, Sequence[tuple[float, float]]]
    gpus_of_pid: Mapping[int, frozenset[GPUIdentity]]


#: No GPU readings: what the derived collectors see where the gpu collector gave none.
NO_READINGS = GpuReadings(MappingProxyType({}), MappingProxyType({}), MappingProxyType({}))


class GpuCollector:
    name = NAME

    def __init__(self, source: DeviceSource | None, gpus: str = MODE_TARGETS) -> None:
        self._source = source
        self._gpus = gpus
        self._last: Attribution | None = None
        #: GPUs whose source has given fine-grained utilisation samples.
        self._fine: set[GPUIdentity] = set()

    def update(self, view: PassView) -> Update:
        out: list[Sample] = []
        processes = view.get(Processes)
        names = {pid: st.process for pid, st in (processes.by_pid if processes else {}).items()}
        try:
            samples = require(self._source).sample_devices()
        except Exception as exc:
            # A failed pass keeps the last decision: gpm and profiling go on reporting this
            # pod's GPUs, not for one pass every GPU of the node.
            if self._last is None:
                raise
            return Update([], (self._last,), error=exc)
        att = self._last = attribution.decide(self._gpus, view.target_views(), samples)
        util: dict[GPUIdentity, float] = {}
        points: dict[GPUIdentity, Sequence[tuple[float, float]]] = {}
        held: dict[int, set[GPUIdentity]] = {}
        for s in samples:
            if not att.watches(s.gpu):
                continue  # another pod's GPU
            labels = s.gpu.labels
            out.extend(field_samples(s, _DEVICE_FIELDS, labels))
            if s.sources:
                out.append((SOURCE_INFO.name,
                            labels + tuple(s.sources.get(k, "") for k in SOURCE_KEYS), {}))
            for (direction, reason), n in sorted(s.pcie_dropped_intervals.items()):
                out.append((PCIE_DROPPED.name, labels + (direction, reason), n))
            for link, (tx, rx) in sorted(s.nvlink_links.items()):
                out.append((NVLINK_LINK_TX.name, labels + (str(link),), tx))
                out.append((NVLINK_LINK_RX.name, labels + (str(link),), rx))
            if s.ecc_corrected_total is not None:
                out.append((ECC_ERRORS.name, labels + ("corrected",), s.ecc_corrected_total))
            if s.ecc_uncorrected_total is not None:
                out.append((ECC_ERRORS.name, labels + ("uncorrected",),
                            s.ecc_uncorrected_total))
            for listed, used in sorted(s.process_memory_bytes.items()):
                # Only targets: other tenants' processes would be unbounded and not ours. NVML
                # may list a target by its namespace PID; its series carry the agent's PID.
                pid = att.owner(s.gpu, listed)
                if pid is not None:
                    name = names.get(pid, "")
                    out.append((PROCESS_MEMORY_USED.name, labels + (str(pid), name), used))
                    held.setdefault(pid, set()).add(s.gpu)
            if s.gpu_util is not None:
                util[s.gpu] = s.gpu_util
                if s.util_samples:
                    self._fine.add(s.gpu)
                # A GPU that has given fine samples waits for them: a point stamped now would
                # hide the samples its buffer posts later with earlier stamps. Only a GPU that
                # never gave any (no buffer, or stamps on no known clock) has the rate stand for
                # the pass.
                points[s.gpu] = (s.util_samples if s.gpu in self._fine
                                 else [(view.now, s.gpu_util)])
        readings = GpuReadings(MappingProxyType(util), MappingProxyType(points),
                               MappingProxyType({p: frozenset(g) for p, g in held.items()}))
        return Update(out, (att, readings))



def attribution_samples(view: PassView) -> list[Sample]:
    """Pass finisher: which GPUs this pass reported and why (none when no collector with GPUs
    ran: every one off, or failed before it ever decided)."""
    decided = view.get(Attribution)
    return attribution.samples(decided) if decided is not None else []


def _build(ctx: BuildContext) -> GpuCollector:
    return GpuCollector(ctx.sources.device, ctx.gpus)


DEFINITION = CollectorDef(
    name=NAME, default_on=True, factory=_build, metrics=METRICS,
    reads=(Processes,), provides=(Attribution, GpuReadings),
    description="NVML device state: utilisation, memory, PCIe, NVLink, power, clocks, errors.")
#: Exports, once per pass, which GPUs the pass reported and why.
FINISHER = FinisherDef("attribution", attribution_samples, attribution.METRICS)
