"""GPM collector: NVML GPM activity ratios and rates (Hopper and newer), and the SM/DRAM
activity quotient that stands in for the compute-to-memory signal when the profiling counters
are unavailable (an activity ratio, not an instruction count).

On a MIG device GPM measures the device's whole GPU instance, shared by every compute instance
in it (``agent.core.hw.nvml.gpm``). Its values are exported once per GPU instance, under the
first of its compute instances the agent reports (in NVML's enumeration order), so a sum over
the reported MIG devices counts each GPU instance once; a pod given any one compute instance
still sees its GPU instance's activity under that one's ``uuid``. :data:`GPM_SCOPE_INFO` is on
every reported MIG device and names its GPU instance, the join from a compute instance to the
values. A whole GPU has no scope series: its GPM is its own, like every other series of its
``uuid``."""

from __future__ import annotations

from dataclasses import dataclass

from mrc_agent.agent.core.attribution import MODE_TARGETS, Attribution
from mrc_agent.agent.core.collectors.base import (
    GPU,
    BuildContext,
    CollectorDef,
    PassView,
    Processes,
    Update,
    field_samples,
    require,
)
from mrc_agent.agent.core.hw.base import GpmSource, GPUIdentity
from mrc_agent.agent.core.sample import Sample, gauge, info

NAME = "gpm"

SM_ACTIVE = gauge(
    NAME, "mrc_gpu_sm_active_ratio", GPU,
    "GPM SM activity: fraction of time SMs had at least one warp resident (GPM_SM_UTIL).")
SM_OCCUPANCY = gauge(
    NAME, "mrc_gpu_sm_occupancy_ratio", GPU,
    "GPM SM occupancy: resident warps over the maximum (GPM_SM_OCCUPANCY).")
TENSOR_ACTIVE = gauge(NAME, "mrc_gpu_tensor_pipe_active_ratio", GPU,
                      "GPM tensor-pipe activity, any precision (GPM_ANY_TENSOR_UTIL).")
DRAM_BANDWIDTH = gauge(
    NAME, "mrc_gpu_dram_bandwidth_utilization_ratio", GPU,
    "GPM DRAM bandwidth utilisation: bytes moved over the peak (GPM_DRAM_BW_UTIL).")
PCIE_TX = gauge(NAME, "mrc_gpu_gpm_pcie_tx_bytes_per_second", GPU,
                "PCIe transmit rate measured by GPM over the sampling window.")
PCIE_RX = gauge(NAME, "mrc_gpu_gpm_pcie_rx_bytes_per_second", GPU,
                "PCIe receive rate measured by GPM over the sampling window.")
NVLINK_TX = gauge(NAME, "mrc_gpu_gpm_nvlink_tx_bytes_per_second", GPU,
                  "NVLink transmit rate, all links, measured by GPM over the sampling window.")
NVLINK_RX = gauge(NAME, "mrc_gpu_gpm_nvlink_rx_bytes_per_second", GPU,
                  "NVLink receive rate, all links, measured by GPM over the sampling window.")
SM_TO_DRAM_ACTIVITY = gauge(
    NAME, "mrc_gpu_gpm_sm_to_dram_activity", GPU,
    "GPM activity proxy for compute per memory traffic: SM activity ratio divided by DRAM "
    "bandwidth utilisation ratio. Not an instruction count; stands in when the profiling "
    "counters are unavailable.")

GPM_SCOPE_INFO = info(
    NAME, "mrc_gpu_gpm_scope_info", GPU + ("scope", "gpu_instance"),
    "GPM scope of a MIG device (present for MIG devices only): scope gpu_instance means GPM "
    "measures the whole GPU instance gpu_instance, not this compute instance alone (NVML "
    "samples GPM per GPU instance), so the GPM series are exported once per GPU instance, "
    "under the first of its compute instances the agent reports; join on (gpu, "
    "gpu_instance) to read them for any of its compute instances.")

METRICS = (SM_ACTIVE, SM_OCCUPANCY, TENSOR_ACTIVE, DRAM_BANDWIDTH, PCIE_TX, PCIE_RX, NVLINK_TX,
           NVLINK_RX, SM_TO_DRAM_ACTIVITY, GPM_SCOPE_INFO)

_GPM_FIELDS = {
    "sm_util": SM_ACTIVE,
    "sm_occupancy": SM_OCCUPANCY,
    "tensor_util": TENSOR_ACTIVE,
    "dram_bw_util": DRAM_BANDWIDTH,
    "pcie_tx_bytes_per_second": PCIE_TX,
    "pcie_rx_bytes_per_second": PCIE_RX,
    "nvlink_tx_bytes_per_second": NVLINK_TX,
    "nvlink_rx_bytes_per_second": NVLINK_RX,
}

#: Below this DRAM utilisation the SM/DRAM activity quotient is noise, so it is not exported.
MIN_DRAM_UTIL_FOR_PROXY = 0.01


@dataclass(frozen=True)
class GpmReadings:
    """The gpm collector's output: the watched GPUs it sampled this pass (the
    compute-to-memory signal's source falls back to GPM where it sampled)."""

    gpus: tuple[GPUIdentity, ...]


class GpmCollector:
    name = NAME

    def __init__(self, source: GpmSource | None, gpus: str = MODE_TARGETS) -> None:
        self._source = source
        self._gpus = gpus

    def update(self, view: PassView) -> Update:
        out: list[Sample] = []
        samples = require(self._source).sample_gpm()
        att = view.decide_gpus(self._gpus, [s.gpu for s in samples])
        # (physical GPU index, GPU instance id) of the GPU instances whose values are out.
        exported: set[tuple[int, int]] = set()
        for s in samples:
            if not att.watches(s.gpu):
                continue  # not a GPU of this pod's targets (agent.core.attribution)
            labels = s.gpu.labels
            if s.gpu_instance is not None or s.gpu.is_mig:
                # "" where a trace names a MIG device but not its GPU instance.
                instance = "" if s.gpu_instance is None else str(s.gpu_instance)
                out.append((GPM_SCOPE_INFO.name, labels + ("gpu_instance", instance), {}))
                if s.gpu_instance is not None:
                    key = (s.gpu.index, s.gpu_instance)
                    if key in exported:
                        continue  # another compute instance of it carries its values
                    exported.add(key)
            out.extend(field_samples(s, _GPM_FIELDS, labels))
            if (s.sm_util is not None and s.dram_bw_util is not None
                    and s.dram_bw_util >= MIN_DRAM_UTIL_FOR_PROXY):
                out.append((SM_TO_DRAM_ACTIVITY.name, labels, s.sm_util / s.dram_bw_util))
        return Update(out, (att, GpmReadings(tuple(s.gpu for s in samples
                                                   if att.watches(s.gpu)))))


def _build(ctx: BuildContext) -> GpmCollector:
    return GpmCollector(ctx.sources.gpm, ctx.gpus)


DEFINITION = CollectorDef(
    name=NAME, default_on=True, factory=_build, metrics=METRICS,
    reads=(Processes, Attribution), provides=(Attribution, GpmReadings),
    description="NVML GPM activity ratios and rates (Hopper and newer).")
