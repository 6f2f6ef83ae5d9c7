"""The *MRC golden triangle* dashboard: CPU, transfers and compute-per-memory, per pod and GPU.

One row per corner of the triangle, then utilisation with the idle windows and the starvation
signal that ties CPU and GPU together. Each threshold line is the value its alert fires on
(``alerts.config``), each alerting panel links the alert's runbook.
"""

from __future__ import annotations

from typing import Any

from mrc_agent.alerts.config import Config
from mrc_agent.dashboards.panels import (
    Alerts,
    Section,
    above,
    below,
    dashboard,
    heatmap,
    histogram_bars,
    override_by_regexp,
    runbook,
    stat,
    timeseries,
    variables,
)
from mrc_agent.dashboards.queries import GPU_VAR, PanelQueries

UID = "mrc-golden-triangle"
TITLE = "MRC golden triangle"


def build(cfg: Config) -> dict[str, Any]:
    q = PanelQueries(cfg)
    t = cfg.thresholds
    cpu = Section("CPU: the target process", [
        timeseries(
            "Process CPU user and hottest thread", [q.cpu_user, q.hottest_thread],
            "percentunit", min_value=0, w=24,
            description=(
                "User CPU of the target process (solid) and of its busiest thread (dashed), as "
                "a share of one core (pidstat %usr / 100). A GIL-bound preprocessing thread "
                "pins the hottest thread near 100 %. The alert compares the process total with "
                f"the dashed line at {t.cpu_user_ratio:.0%} of a core (held {t.cpu_user_for})."),
            thresholds=above(t.cpu_user_ratio), links=runbook(cfg, Alerts.CPU_SATURATED),
            overrides=[override_by_regexp(".*hottest thread",
                                          custom__lineStyle={"fill": "dash", "dash": [10, 10]})]),
    ])
    transfers = Section("Transfers: PCIe and NVLink", [
        timeseries(
            "PCIe TX/RX bandwidth", [q.pcie_tx, q.pcie_rx], "Bps", min_value=0, w=8,
            description=(
                "PCIe throughput per GPU as NVML measures it (gauges). Host-to-device (RX) "
                "carries the decoded images and inputs; no alert fires on the bandwidth, so no "
                "line. It reads low, and has gaps, while the panel beside it shows dropped "
                "intervals.")),
        timeseries(
            "PCIe intervals dropped", [q.pcie_dropped], "short", min_value=0, w=4,
            description=(
                "Byte-count intervals the agent could not count, per GPU and reason, over the "
                f"last {t.pcie_dropped_window}: each is left out of the PCIe totals and blanks "
                "the bandwidth beside it for one sampling interval. Reason gap: a 32-bit "
                "counter read too late to rule out a wrap (the sidecar starved of CPU); "
                "impossible: more than the link carries. Above the dashed line at "
                f"{t.pcie_dropped_intervals:g} for {t.pcie_dropped_for} the alert fires."),
            thresholds=above(t.pcie_dropped_intervals),
            links=runbook(cfg, Alerts.PCIE_UNDER_COUNTED)),
        timeseries(
            "NVLink TX/RX bandwidth", [q.nvlink_tx, q.nvlink_rx, q.nvlink_total], "Bps",
            min_value=0,
            description=(
                "NVLink data bytes per second per GPU, all links (rate of the agent's counters). "
                "The alert compares TX + RX with the dashed line at "
                f"{t.nvlink_bytes_per_second / 1e9:g} GB/s: below it for {t.nvlink_for} while "
                f"the GPU is over {t.gpu_busy_ratio:.0%} busy, a tensor-parallel model is "
                "starving on transfers. Empty on GPUs without NVLink."),
            thresholds=below(t.nvlink_bytes_per_second),
            links=runbook(cfg, Alerts.NVLINK_LOW)),
    ])
    compute = Section("Compute per memory: SM instructions per DRAM byte", [
        timeseries(
            "SM instructions per DRAM byte (profiling counters)",
            [q.instructions_per_dram_byte], "short", min_value=0, w=10,
            description=(
                "rate(SM instructions executed) / rate(DRAM bytes read), from CUPTI PM sampling "
                "(the opt-in profiling collector; mrc_gpu_profiling_metrics_info names the "
                "metrics). Below the dashed line at "
                f"{t.instructions_per_dram_byte:g} the kernels are memory-bound. Empty when the "
                "profiling counters are not the live source (see the source stat), and where "
                "the chip's PM-sampling set has no DRAM byte counter, only a throughput "
                "percentage (mrc_gpu_dram_read_throughput_ratio, not bytes)."),
            thresholds=below(t.instructions_per_dram_byte),
            links=runbook(cfg, Alerts.MEMORY_BOUND)),
        timeseries(
            "GPM activity ratio (SM activity / DRAM bandwidth utilisation)",
            [q.gpm_activity_ratio], "short", min_value=0, w=10,
            description=(
                "The GPM proxy used when the profiling counters are unavailable: SM activity "
                "divided by DRAM bandwidth utilisation. Not an instruction count; its own "
                f"threshold is {t.gpm_sm_to_dram_activity:g} (the DRAM about as busy as the SMs)."),
            thresholds=below(t.gpm_sm_to_dram_activity),
            links=runbook(cfg, Alerts.MEMORY_BOUND_GPM)),
        stat(
            "Compute-to-memory source", [q.compute_memory_source], "none", w=4, h=8,
            text_mode="name", color_mode="none",
            description=(
                "Which source feeds the compute-to-memory signal in each agent: "
                "cupti_pm_sampling (true instructions and DRAM bytes: read the left panel), "
                "gpm_activity_proxy (read the middle panel) or none.")),
    ])
    utilisation = Section("GPU utilisation and idle windows", [
        timeseries(
            "GPU utilisation", [q.gpu_utilization, q.gpu_duty_cycle], "percentunit",
            min_value=0, max_value=1, w=8,
            description="Share of the last NVML sample period during which a kernel ran, and "
            "the duty cycle: the share of the whole rate window, from every utilisation sample "
            "(mrc_gpu_busy_seconds_total), which holds between scrapes."),
        histogram_bars(
            "GPU idle-window durations (selected range)", q.idle_windows_over_range, "short",
            w=8,
            description=(
                "Completed GPU idle windows over the selected time range, by duration bucket "
                "(upper bound in seconds). Many windows of 0.1-1 s while the target's CPU is hot "
                "is the signature of CPU-side preprocessing starving the GPU.")),
        heatmap(
            "GPU idle windows over time", q.idle_windows_over_time, "short", "s", w=8,
            description="The same idle-window buckets per query step: when the idle windows "
                        "happened and how long they were."),
    ])
    starvation = Section("Starvation: CPU hot while the GPU idles", [
        timeseries(
            "GPU starvation signal", [q.starved, q.starved_share], "percentunit",
            min_value=0, max_value=1, w=16,
            description=(
                "100 % while the target's user CPU is hot and its GPUs idle (the agent's "
                "--starvation-* thresholds), and the share of the last "
                f"{t.starved_window} in that state, which the alert compares with the dashed "
                f"line at {t.starved_fraction:.0%} (held {t.starved_for})."),
            thresholds=above(t.starved_fraction), links=runbook(cfg, Alerts.STARVED)),
        timeseries(
            "Current GPU idle stretch", [q.gpu_idle_current], "s", min_value=0, w=8,
            description="How long each GPU has been idle so far (0 while busy)."),
        timeseries(
            "What the serving process ran while its GPU idled", [q.functions_while_gpu_idle],
            "percentunit", min_value=0, w=24,
            description=(
                "Share of wall-clock time the target's hottest thread ran each Python function "
                "(module:qualname) while its GPUs idled or it was starved, from continuous "
                "stack samples (the agent's stacks collector, on by default; running time only). "
                "A preprocessing function here, during starvation, is the culprit the GPU "
                "waits on."),
            links=runbook(cfg, Alerts.STARVED)),
    ])
    return dashboard(
        TITLE, UID,
        "Per pod and GPU: target CPU, PCIe/NVLink bandwidth and SM instructions per DRAM "
        "byte, with GPU idle windows and the starvation signal (mrc-agent).",
        variables({"cluster": q.variable_query("cluster"),
                   "namespace": q.variable_query("namespace"), "pod": q.variable_query("pod"),
                   GPU_VAR: q.variable_query(GPU_VAR)}),
        [cpu, transfers, compute, utilisation, starvation])
