"""What the report shows: the golden-triangle charts (:class:`ChartSpec`, titled, queried and
lined as the dashboard's panels and the alerts) and the latency heatmap's query.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mrc_agent.alerts.config import Config
from mrc_agent.dashboards.queries import PanelQueries, Query


@dataclass(frozen=True)
class Threshold:
    value: float
    label: str


@dataclass(frozen=True)
class ChartSpec:
    """One golden-triangle chart: the dashboard panel's title, queries and threshold line."""

    key: str
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str  # "percentunit" | "Bps" | "short"
    axis_label: str
    threshold: Threshold | None = None
    y_max: float | None = None
    #: Legend suffix of the series drawn dashed (the hottest thread, as on the dashboard).
    dashed_suffix: str = ""


#: Compute-to-memory sources, as the agent names them in mrc_agent_compute_memory_source_info.
SOURCE_PROFILING = "cupti_pm_sampling"
SOURCE_GPM = "gpm_activity_proxy"
HEATMAP_TITLE = "P90 latency by resolution x prompt length"
HEATMAP_QUANTILE = 0.9


def chart_specs(cfg: Config, sources: Iterable[str]) -> list[ChartSpec]:
    """The golden-triangle charts, titled as the dashboard's panels; the compute-to-memory chart
    is the one of the live source (both where agents differ, the true counters where none)."""
    q = PanelQueries(cfg)
    t = cfg.thresholds
    live = set(sources)
    cpu = ChartSpec(
        "cpu", "Process CPU user and hottest thread",
        "User CPU of the target process (solid) and of its busiest thread (dashed), as a share "
        f"of one core. The alert fires when the process holds the {t.cpu_user_ratio:.0%} line "
        f"for {t.cpu_user_for}.",
        (q.cpu_user, q.hottest_thread), "percentunit", "share of one core",
        Threshold(t.cpu_user_ratio, f"{t.cpu_user_ratio:.0%} MRCProcessCPUUserSaturated"),
        dashed_suffix="hottest thread")
    pcie = ChartSpec(
        "pcie", "PCIe TX/RX bandwidth",
        "PCIe throughput per GPU as NVML measures it. Host-to-device (RX) carries the decoded "
        "images; no alert fires on PCIe, so no line.",
        (q.pcie_tx, q.pcie_rx), "Bps", "bytes per second")
    nvlink = ChartSpec(
        "nvlink", "NVLink TX/RX bandwidth",
        f"NVLink data bytes per second per GPU. Below the line at "
        f"{t.nvlink_bytes_per_second / 1e9:g} GB/s (TX + RX) for {t.nvlink_for} while the GPU is "
        "busy, a tensor-parallel model starves on transfers.",
        (q.nvlink_tx, q.nvlink_rx, q.nvlink_total), "Bps", "bytes per second",
        Threshold(t.nvlink_bytes_per_second,
                  f"{t.nvlink_bytes_per_second / 1e9:g} GB/s MRCNVLinkBandwidthLow"))
    instructions = ChartSpec(
        "compute-instructions", "SM instructions per DRAM byte (profiling counters)",
        "rate(sm__inst_executed) / rate(dram__bytes_read) from the profiling counters. Below "
        f"the line at {t.instructions_per_dram_byte:g} the kernels are memory-bound.",
        (q.instructions_per_dram_byte,), "short", "instructions per byte",
        Threshold(t.instructions_per_dram_byte,
                  f"{t.instructions_per_dram_byte:g} MRCGPUMemoryBound"))
    gpm = ChartSpec(
        "compute-gpm", "GPM activity ratio (SM activity / DRAM bandwidth utilisation)",
        "The GPM proxy used where the profiling counters are unavailable: SM activity divided by "
        "DRAM bandwidth utilisation. Not an instruction count; its own line is at "
        f"{t.gpm_sm_to_dram_activity:g}.",
        (q.gpm_activity_ratio,), "short", "activity ratio",
        Threshold(t.gpm_sm_to_dram_activity,
                  f"{t.gpm_sm_to_dram_activity:g} MRCGPUMemoryBoundGPMProxy"))
    compute = [s for s, src in ((instructions, SOURCE_PROFILING), (gpm, SOURCE_GPM)) if src in live]
    utilisation = ChartSpec(
        "gpu-utilisation", "GPU utilisation",
        "Share of each NVML sample period during which a kernel ran.",
        (q.gpu_utilization,), "percentunit", "share of time busy", y_max=1.0)
    starvation = ChartSpec(
        "starvation", "GPU starvation signal",
        "100 % while the target's CPU is hot and its GPUs idle, and the share of the last "
        f"{t.starved_window} in that state, which pages above the line at "
        f"{t.starved_fraction:.0%} held for {t.starved_for}.",
        (q.starved, q.starved_share), "percentunit", "share of time starved",
        Threshold(t.starved_fraction, f"{t.starved_fraction:.0%} MRCGPUStarved"), y_max=1.0)
    return [cpu, pcie, nvlink, *(compute or [instructions]), utilisation, starvation]


def heatmap_query(cfg: Config) -> Query:
    return PanelQueries(cfg).latency_quantile_matrix(HEATMAP_QUANTILE)

