"""The GPUs the simulated ``pynvml`` (:mod:`.nvml`) answers for, as plain dicts in NVML's own
units: :func:`gpu` lists every key with its default, :func:`mig_device` and :func:`nvlink`
describe a MIG device and an NVLink link. A scenario builds these, hands them to
``FakeNvml``, and changes them between samples (or just before each call, through
``FakeNvml.refresh``) to advance counters, queue XID events, lose a GPU and so on.
"""

from __future__ import annotations

from typing import Any


def gpu(**overrides: Any) -> dict[str, Any]:
    """A GPU description with realistic defaults (an H100-like board), in NVML's own units."""
    index = overrides.pop("index", 0)
    data: dict[str, Any] = {
        "uuid": f"GPU-0000000{index}-fake-uuid",
        "name": "NVIDIA H100 80GB HBM3",
        # nvmlDeviceGetUtilizationRates, percent
        "util": {"gpu": 50, "memory": 25},
        # nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES): (wall-clock microseconds, percent)
        "util_samples": [],
        # True: GetSamples also answers the sample stamped exactly lastSeenTimeStamp again (the
        # boundary sample, which a driver's buffer may repeat)
        "util_samples_repeat_boundary": False,
        # nvmlDeviceGetMemoryInfo, bytes. v1 ``used`` includes ``reserved``; v2 does not.
        "memory": {"total": 80 * 2**30, "used": 10 * 2**30, "reserved": 512 * 2**20},
        # nvmlDeviceGetPcieThroughput (KB/s), nvmlDeviceGetPcieReplayCounter, and
        # nvmlDeviceGetMaxPcieLinkGeneration / Width and the device-only
        # nvmlDeviceGetGpuMaxPcieLinkGeneration (None: answers NOT_SUPPORTED, an older driver)
        "pcie": {"tx_kb_per_s": 1000, "rx_kb_per_s": 2000, "replays": 0,
                 "max_link_generation": 5, "max_link_width": 16,
                 "gpu_max_link_generation": 5},
        # NVML_FI_DEV_PCIE_COUNT_TX_BYTES / _RX_BYTES raw values (None: a driver without them)
        # and the NVML_VALUE_TYPE_* name they come back as (32-bit ones wrap at 2**32)
        "pcie_count": {"tx_bytes": None, "rx_bytes": None,
                       "value_type": "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG"},
        # link index -> state and cumulative NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX (KiB).
        # The link count NVML reports is len(nvlink). scopeId UINT_MAX answers the sum over
        # links, or is refused (NOT_SUPPORTED) on a driver without the aggregate scope; an
        # error code here is what the aggregate scope answers instead (INVALID_ARGUMENT, ...).
        "nvlink": {},
        "nvlink_aggregate_scope": True,
        # True: every per-link read answers the aggregate (the per-link reads reported to
        # return all links' total on some drivers)
        "nvlink_per_link_is_aggregate": False,
        # KiB the aggregate scope answers beyond the per-link sum (a driver whose two disagree)
        "nvlink_aggregate_extra_kib": 0,
        "power_mw": 300_000,
        "sm_clock_mhz": 1980,
        "temperature_c": 40,
        "ecc": {"corrected": 0, "uncorrected": 0},
        # NVML_GPM_METRIC_* id -> value in NVML's unit; None = GPM not supported on this GPU.
        "gpm": None,
        # NVML_GPM_METRIC_* id -> the error code its nvmlGpmMetric_t.nvmlReturn answers instead
        "gpm_metric_errors": {},
        # (pid, usedGpuMemory bytes or None)
        "compute_processes": [],
        "graphics_processes": [],
        # XID codes waiting to be delivered through an event set, oldest first
        "xid_events": [],
        # function names that answer NVML_ERROR_NOT_SUPPORTED on this GPU
        "not_supported": set(),
        # field ids, or (field id, link) pairs, whose nvmlFieldValue_t.nvmlReturn is
        # NOT_SUPPORTED on this GPU
        "fields_not_supported": set(),
        # field id -> the error code its nvmlFieldValue_t.nvmlReturn answers (e.g. GPU_IS_LOST)
        "field_errors": {},
        # True: every call with this GPU's handle answers NVML_ERROR_GPU_IS_LOST
        "lost": False,
        # nvmlDeviceGetCudaComputeCapability's (major, minor) and nvmlDeviceGetArchitecture's
        # NVML_DEVICE_ARCH_* name (e.g. "HOPPER"); None: answers NOT_SUPPORTED
        "compute_capability": None,
        "architecture": None,
        # MIG devices (see mig_device()); non-empty means MIG mode is on: the whole GPU then
        # answers NOT_SUPPORTED for utilisation, utilisation samples and GPM samples, as NVML
        # does, and GPM is sampled per GPU instance (nvmlGpmMigSampleGet)
        "mig": [],
        # nvmlDeviceGetMigMode's (current, pending) when set; else both follow ``mig``
        "mig_mode": None,
    }
    data.update(overrides)
    return data


def mig_device(gi: int, **overrides: Any) -> dict[str, Any]:
    """One MIG device (GPU instance ``gi``) for ``gpu(mig=[...])``, in NVML's units."""
    data: dict[str, Any] = {
        "uuid": f"MIG-0000000{gi}-fake-mig-uuid",
        "gpu_instance": gi,
        "memory": {"total": 18 * 2**30, "used": 2 * 2**30, "reserved": 0},
        "compute_processes": [],
        "graphics_processes": [],
        # NVML_GPM_METRIC_* id -> value: this GPU instance's GPM metrics
        "gpm": {},
        "not_supported": set(),
        "lost": False,
    }
    data.update(overrides)
    return data


def nvlink(tx_kib: int = 0, rx_kib: int = 0, active: bool = True) -> dict[str, Any]:
    """One NVLink link for ``gpu(nvlink={0: nvlink(...), ...})``."""
    return {"active": active, "tx_kib": tx_kib, "rx_kib": rx_kib}
