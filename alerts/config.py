"""One config object for the alert rules *and* the dashboards: thresholds, windows, selectors.

The dashboards draw their threshold lines from the same values the alerts fire on, so the line
an on-call engineer sees is the line that pages. Each value says why it is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Thresholds:
    #: A Python preprocessing thread is GIL-bound at one core; 95 % of a core held for 30 s is
    #: a thread that can no longer keep up (issue contract: MRCProcessCPUUserSaturated).
    cpu_user_ratio: float = 0.95
    cpu_user_for: str = "30s"
    #: NVLink on H100/H200 moves 450 GB/s per direction; below 50 GB/s while the GPU is busy
    #: a tensor-parallel model is starving on transfers (MRCNVLinkBandwidthLow).
    nvlink_bytes_per_second: float = 50e9
    nvlink_for: str = "60s"
    #: "Busy" for the NVLink alert: an idle GPU moving nothing is not a transfer problem.
    gpu_busy_ratio: float = 0.5
    #: Below ~8 SM instructions per DRAM byte read a kernel is memory-bound on Hopper
    #: (ridge point of the roofline for typical instruction mixes) (MRCGPUMemoryBound).
    instructions_per_dram_byte: float = 8.0
    #: GPM proxy: SM activity over DRAM-bandwidth utilisation. Below 1.2 the DRAM is about as
    #: busy as the SMs are — the activity signature of a memory-bound kernel. Not an instruction
    #: count; used only where the profiling counters are unavailable.
    gpm_sm_to_dram_activity: float = 1.2
    memory_bound_for: str = "15m"
    #: Starvation is decided by the agent (its --starvation-* flags); the alert asks that the
    #: signal held for most of the window, so one slow batch does not page.
    starved_fraction: float = 0.8
    starved_for: str = "2m"
    #: Time-to-first-token SLO: 99 % of requests answer their first token within 500 ms.
    ttft_seconds: float = 0.5
    ttft_objective: float = 0.99
    #: Request latency P99 per prompt-length x resolution bucket; 10 s is where a user of an
    #: interactive photo-question app gives up.
    latency_p99_seconds: float = 10.0
    latency_for: str = "10m"
    #: Share of requests ending in error or timeout (server-side failures only).
    error_ratio: float = 0.05
    error_for: str = "5m"
    #: Share of requests whose intermediate step (OCR, fetch, preprocess) gave nothing usable.
    chain_break_ratio: float = 0.2
    chain_break_for: str = "15m"
    #: How long an agent, collector or target may be missing before anyone is told.
    absent_for: str = "5m"


@dataclass(frozen=True)
class Config:
    thresholds: Thresholds = field(default_factory=Thresholds)
    #: Extra label matchers put into every selector, e.g. 'namespace="mrc"'. Empty by default
    #: so the rules work whatever the scrape job is called.
    selector: str = ""
    #: Where runbooks live; each alert links to ``{runbook_base}/<Alert>.md``. Relative to the
    #: repository by default; set it to the repository's web URL (``--runbook-base``) so links
    #: open from Alertmanager and Grafana.
    runbook_base: str = "docs/runbooks"
    #: Labels that identify one pod / one GPU in aggregations.
    pod_labels: tuple[str, ...] = ("namespace", "pod")
    gpu_labels: tuple[str, ...] = ("gpu", "uuid")

    def sel(self, extra: str = "") -> str:
        """A label-matcher block: ``{selector,extra}`` or ``""`` when both are empty."""
        parts = [p for p in (self.selector, extra) if p]
        return "{" + ",".join(parts) + "}" if parts else ""


DEFAULT = Config()
