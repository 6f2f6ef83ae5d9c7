"""The agent's metric catalogue: one definition list that drives the exposition and the
generated ``docs/metrics.md``.

Names follow ``mrc_<subsystem>_<name>_<unit>[_total]`` with base units. Label sets are declared
here and nowhere else; every label is bounded (GPU index/UUID/model, target PID and process
name, a fixed ``mode``/``kind``/``link`` set). The names marked *contract* are used by the
dashboards and alert rules and must not change.
"""

from __future__ import annotations

from exporters.exposition.snapshot import MetricSpec

#: Labels of per-target series.
PROC = ("pid", "process")
#: Labels of per-GPU series: index, UUID and model name (e.g. "NVIDIA H200").
GPU = ("gpu", "uuid", "gpu_model")

#: Idle-window histogram buckets, seconds. A data-loader or preprocessing stall shows as
#: multi-second gaps; the lowest bucket is about the smallest gap NVML's utilisation sampling
#: (1/6 s on datacenter parts) can resolve, the highest covers a stuck request.
IDLE_WINDOW_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def _m(name: str, kind: str, collector: str, labels: tuple[str, ...], help_: str,
       buckets: tuple[float, ...] = ()) -> MetricSpec:
    return MetricSpec(name=name, kind=kind, help=help_, labels=labels,  # type: ignore[arg-type]
                      collector=collector, buckets=buckets)


AGENT = [
    _m("mrc_agent_build_info", "info", "agent", (),
       "Version of the agent and of Python it runs on."),
    _m("mrc_agent_collector_success", "gauge", "agent", ("collector",),
       "Whether the collector's last update succeeded (1) or failed or had no data (0)."),
    _m("mrc_agent_collector_available", "gauge", "agent", ("collector",),
       "Whether the collector's source applies on this host (0: no GPU, no NVML, no GPM, "
       "no profiling permission, or disabled backend)."),
    _m("mrc_agent_collector_duration_seconds", "gauge", "agent", ("collector",),
       "Wall time the collector's last update took."),
    _m("mrc_agent_samples_total", "counter", "agent", (),
       "Sampling passes completed since the agent started."),
    _m("mrc_agent_sample_overruns_total", "counter", "agent", (),
       "Sampling ticks skipped because a pass took longer than the interval."),
    _m("mrc_agent_sample_duration_seconds", "gauge", "agent", (),
       "Wall time the last sampling pass took, all collectors together."),
    _m("mrc_agent_last_sample_timestamp_seconds", "gauge", "agent", (),
       "Unix time at which the snapshot being served was taken."),
    _m("mrc_agent_interval_seconds", "gauge", "agent", (), "Configured sampling interval."),
    _m("mrc_agent_targets", "gauge", "agent", (),
       "Number of target processes watched in the last sampling pass."),
    _m("mrc_agent_compute_memory_source_info", "info", "agent", ("source", "reason"),
       "Which source feeds the compute-to-memory signal: cupti_pm_sampling (true "
       "instructions and DRAM bytes), gpm_activity_proxy (GPM activity ratios), or none, "
       "and why the profiling counters are not used."),
]

PROCESS = [
    _m("mrc_process_cpu_seconds_total", "counter", "process", PROC + ("mode",),
       "CPU time the target process spent, by mode (user excludes guest time, like pidstat)."),
    _m("mrc_process_cpu_user_ratio", "gauge", "process", PROC,
       "User CPU seconds per wall second over the last sampling window (1.0 = one core "
       "fully busy, pidstat's %usr / 100)."),
    _m("mrc_process_cpu_system_ratio", "gauge", "process", PROC,
       "System CPU seconds per wall second over the last sampling window."),
    _m("mrc_process_hottest_thread_cpu_user_ratio", "gauge", "process", PROC,
       "User CPU ratio of the busiest thread over the last sampling window; a GIL-bound "
       "preprocessing thread reads about 1.0 even when the process total is spread."),
    _m("mrc_process_resident_memory_bytes", "gauge", "process", PROC,
       "Resident set size of the target process."),
    _m("mrc_process_threads", "gauge", "process", PROC, "Threads in the target process."),
    _m("mrc_process_context_switches_total", "counter", "process", PROC + ("kind",),
       "Context switches of the target process, voluntary or involuntary."),
    _m("mrc_process_start_time_seconds", "gauge", "process", PROC,
       "Start time of the target process, seconds since the Unix epoch."),
]

GPU_NVML = [
    _m("mrc_gpu_utilization_ratio", "gauge", "gpu", GPU,
       "Fraction of the last NVML sample period during which a kernel ran on the GPU."),
    _m("mrc_gpu_memory_utilization_ratio", "gauge", "gpu", GPU,
       "Fraction of the last NVML sample period during which device memory was read or "
       "written."),
    _m("mrc_gpu_memory_used_bytes", "gauge", "gpu", GPU, "Device memory in use."),
    _m("mrc_gpu_memory_total_bytes", "gauge", "gpu", GPU, "Device memory installed."),
    _m("mrc_gpu_pcie_tx_bytes_per_second", "gauge", "gpu", GPU,
       "PCIe transmit throughput (device to host), as NVML measures it over a short window."),
    _m("mrc_gpu_pcie_rx_bytes_per_second", "gauge", "gpu", GPU,
       "PCIe receive throughput (host to device), as NVML measures it over a short window."),
    _m("mrc_gpu_pcie_replays_total", "counter", "gpu", GPU, "PCIe replay events (link errors)."),
    _m("mrc_gpu_nvlink_tx_bytes_total", "counter", "gpu", GPU,
       "NVLink data bytes transmitted, summed over all links."),
    _m("mrc_gpu_nvlink_rx_bytes_total", "counter", "gpu", GPU,
       "NVLink data bytes received, summed over all links."),
    _m("mrc_gpu_nvlink_link_tx_bytes_total", "counter", "gpu", GPU + ("link",),
       "NVLink data bytes transmitted on one link."),
    _m("mrc_gpu_nvlink_link_rx_bytes_total", "counter", "gpu", GPU + ("link",),
       "NVLink data bytes received on one link."),
    _m("mrc_gpu_power_watts", "gauge", "gpu", GPU, "Board power draw."),
    _m("mrc_gpu_sm_clock_hertz", "gauge", "gpu", GPU, "Current SM clock."),
    _m("mrc_gpu_temperature_celsius", "gauge", "gpu", GPU, "GPU core temperature."),
    _m("mrc_gpu_ecc_errors_total", "counter", "gpu", GPU + ("kind",),
       "Volatile ECC errors since the driver loaded, corrected or uncorrected."),
    _m("mrc_gpu_xid_errors_total", "counter", "gpu", GPU,
       "Critical XID errors seen since the agent started."),
    _m("mrc_gpu_last_xid", "gauge", "gpu", GPU, "Code of the last critical XID error seen."),
    _m("mrc_gpu_process_memory_used_bytes", "gauge", "gpu", GPU + PROC,
       "Device memory held by a target process on this GPU."),
]

GPU_GPM = [
    _m("mrc_gpu_sm_active_ratio", "gauge", "gpm", GPU,
       "GPM SM activity: fraction of time SMs had at least one warp resident (GPM_SM_UTIL)."),
    _m("mrc_gpu_sm_occupancy_ratio", "gauge", "gpm", GPU,
       "GPM SM occupancy: resident warps over the maximum (GPM_SM_OCCUPANCY)."),
    _m("mrc_gpu_tensor_pipe_active_ratio", "gauge", "gpm", GPU,
       "GPM tensor-pipe activity, any precision (GPM_ANY_TENSOR_UTIL)."),
    _m("mrc_gpu_dram_bandwidth_utilization_ratio", "gauge", "gpm", GPU,
       "GPM DRAM bandwidth utilisation: bytes moved over the peak (GPM_DRAM_BW_UTIL)."),
    _m("mrc_gpu_gpm_pcie_tx_bytes_per_second", "gauge", "gpm", GPU,
       "PCIe transmit rate measured by GPM over the sampling window."),
    _m("mrc_gpu_gpm_pcie_rx_bytes_per_second", "gauge", "gpm", GPU,
       "PCIe receive rate measured by GPM over the sampling window."),
    _m("mrc_gpu_gpm_nvlink_tx_bytes_per_second", "gauge", "gpm", GPU,
       "NVLink transmit rate, all links, measured by GPM over the sampling window."),
    _m("mrc_gpu_gpm_nvlink_rx_bytes_per_second", "gauge", "gpm", GPU,
       "NVLink receive rate, all links, measured by GPM over the sampling window."),
    _m("mrc_gpu_gpm_sm_to_dram_activity", "gauge", "gpm", GPU,
       "GPM activity proxy for compute per memory traffic: SM activity ratio divided by DRAM "
       "bandwidth utilisation ratio. Not an instruction count; stands in when the profiling "
       "counters are unavailable."),
]

GPU_PROFILING = [
    _m("mrc_gpu_sm_instructions_executed_total", "counter", "profiling", GPU,
       "SM instructions executed (CUPTI PM sampling of sm__inst_executed)."),
    _m("mrc_gpu_dram_read_bytes_total", "counter", "profiling", GPU,
       "Bytes read from DRAM (CUPTI PM sampling of dram__bytes_read)."),
]

DERIVED = [
    _m("mrc_gpu_idle_window_seconds", "histogram", "derived", GPU,
       "Durations of completed GPU idle windows (utilisation at or below the idle threshold), "
       "from sub-second utilisation samples.", IDLE_WINDOW_BUCKETS),
    _m("mrc_gpu_idle_current_seconds", "gauge", "derived", GPU,
       "How long the GPU has been idle so far (0 while busy)."),
    _m("mrc_gpu_starved", "gauge", "derived", PROC,
       "1 while the target's user CPU (process or hottest thread) is at or above the CPU "
       "threshold and the GPUs it uses are at or below the GPU threshold, else 0."),
    _m("mrc_gpu_starved_seconds_total", "counter", "derived", PROC,
       "Seconds the target spent in the starved state."),
]

CATALOG: list[MetricSpec] = AGENT + PROCESS + GPU_NVML + GPU_GPM + GPU_PROFILING + DERIVED

#: Collector names and a one-line description, in sampling order (derived reads the others).
COLLECTORS = {
    "process": "Target process CPU (pidstat -u semantics), hottest thread, memory, threads.",
    "gpu": "NVML device state: utilisation, memory, PCIe, NVLink, power, clocks, errors.",
    "gpm": "NVML GPM activity ratios and rates (Hopper and newer).",
    "profiling": "CUPTI PM sampling: true SM instructions and DRAM bytes read (opt-in).",
    "derived": "GPU idle windows and the GPU-starvation signal, computed in the agent.",
}
DEFAULT_ON = {"process": True, "gpu": True, "gpm": True, "profiling": False, "derived": True}
