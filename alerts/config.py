"""One config object for the alert rules *and* the dashboards: thresholds, windows, selectors.

The dashboards draw their threshold lines from the same values the alerts fire on, so the line
an on-call engineer sees is the line that pages. Each value says why it is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Thresholds:
    #: A Python preprocessing thread is GIL-bound at one core; 95 % of a core held for 30 s is
    #: a thread that can no longer keep up (the contract of MRCProcessCPUUserSaturated).
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
    #: An agent that still answers but whose snapshot stopped moving (a wedged collector, a
    #: failing pass) is as blind as one that is down, and looks healthy: the golden-triangle
    #: alerts cannot fire for its pod (MRCAgentSamplingStale). Five sampling intervals, and
    #: never under a minute, because a 15 s scrape plus rule evaluation can make a fresh
    #: sample look 30 s old.
    stale_intervals: float = 5.0
    stale_min_seconds: float = 60.0
    stale_for: str = "1m"
    #: PCIe byte-count intervals the agent could not count (mrc_gpu_pcie_dropped_intervals_total,
    #: per GPU and reason; TX and RX are read together, so the larger direction is one count per
    #: event). A drop leaves its interval out of mrc_gpu_pcie_*_bytes_total and blanks the
    #: bandwidth gauge for that sampling interval: the PCIe panels read low. One drop now and
    #: then (a stop-the-world pause, a node under load for a second) costs a few milliseconds
    #: of bytes; more than 5 in every 10 minutes, held 10 minutes more, is a cause that stays
    #: (a throttled sidecar, a link bound NVML under-reports) and the readings are not to be
    #: trusted until it is fixed (MRCAgentPCIeBytesUnderCounted).
    pcie_dropped_intervals: float = 5.0
    pcie_dropped_window: str = "10m"
    pcie_dropped_for: str = "10m"

    # --- Windows (added with the alert rules; see alerts/README.md "Windows") -----------------
    #: rate() window of the GPU counters (NVLink bytes, SM instructions, DRAM bytes) and the
    #: averaging window of the gauges sampled next to them (utilisation, GPM activity). rate()
    #: needs two samples in its window and should see >= 4 so one missed scrape does not blank
    #: it: 1m suits 15 s scrapes; use 2m for 30 s scrapes. The e2e test (1 s scrapes) builds
    #: with a shorter window so the alert reacts within its `for`. A longer window only delays:
    #: a drop shows fully after one window, then `for` starts counting.
    rate_window: str = "1m"
    #: Window over which `mrc_gpu_starved` must read >= starved_fraction (80 % of 2 minutes =
    #: 96 s starved); with starved_for on top, a page needs ~3.5 minutes of near-constant
    #: starvation, so one slow batch or a short warm-up never pages.
    starved_window: str = "2m"
    #: rate() window of the request-side ratios and the latency P99: 5m holds enough requests
    #: at a few requests per second for a P99 and a ratio to mean something.
    request_rate_window: str = "5m"
    #: Multi-window, multi-burn-rate TTFT alerts (Google SRE workbook, ch. 5, table 5-8):
    #: (burn-rate factor, long window, short window). 14.4x for 1h spends 2 % of a 30-day budget,
    #: 6x for 6h 5 %: page. 3x for 1d and 1x for 3d spend 10 %: ticket. The short window (1/12
    #: of the long one) makes the alert stop soon after the burn stops.
    slo_page_burn_rates: tuple[tuple[float, str, str], ...] = ((14.4, "1h", "5m"),
                                                               (6.0, "6h", "30m"))
    slo_ticket_burn_rates: tuple[tuple[float, str, str], ...] = ((3.0, "1d", "2h"),
                                                                 (1.0, "3d", "6h"))
    #: `for` of the burn-rate alerts: the windows already smooth; `for` only rides out one
    #: evaluation glitch on the page and a day's noise on the ticket (as kubernetes-mixin).
    slo_page_for: str = "2m"
    slo_ticket_for: str = "1h"
    #: How far back a scrape target counts as "was an agent" for MRCAgentDown when it first goes
    #: down (its `mrc_agent_build_info` is looked up over this window). Once the alert fires it
    #: holds itself through its own ALERTS series, so it does not resolve after this window.
    agent_seen_window: str = "1h"


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
    #: The label that tells clusters apart where several of them write into one store (the
    #: monitoring mixins' ``clusterLabel``; set as an external label of each cluster's
    #: Prometheus). Every per-pod and per-model aggregation, the pod join and Alertmanager's
    #: grouping keep it, so two clusters' pods of one name stay two; on one cluster's
    #: Prometheus, where the label is absent, ``by (cluster, …)`` changes nothing. "" drops it.
    cluster_label: str = "cluster"
    gpu_labels: tuple[str, ...] = ("gpu", "uuid")
    #: Labels that tell replicas of one service apart. Request-side ratios and the SLO sum them
    #: away (``sum without (...)``): an SLO is the service's, not one pod's, and a P99 per
    #: prompt-length x resolution bucket needs every replica's requests to be worth anything.
    replica_labels: tuple[str, ...] = ("instance", "pod")
    #: Labels of ``mrc_model_info`` that the fleet group's per-model aggregates (``mrc_model:``)
    #: copy onto the request and GPU series of a pod and keep. ``model_id`` alone: at 1000 pods
    #: a model is the unit people compare and federate; add ``quantization`` or ``dtype`` to
    #: tell an nf4 deployment of a model from its fp16 one (each adds series per model, not
    #: per pod). Pods whose service exports no ``mrc_model_info`` are left out of them.
    model_labels: tuple[str, ...] = ("model_id",)
    #: Example Alertmanager receivers (alertmanager.yaml). Placeholders on a reserved domain:
    #: point them at the pager's and the ticket system's webhooks (PagerDuty/Opsgenie have
    #: their own *_configs; swap the receiver block). The e2e test points them at its receiver.
    page_webhook_url: str = "https://oncall.example.com/hooks/mrc-page"
    ticket_webhook_url: str = "https://tickets.example.com/hooks/mrc-ticket"
    #: How long Alertmanager gathers a new page group before sending it: short, because every
    #: second of it is added to the page's `for`; tickets wait 30 s to batch. The e2e test
    #: (1 s scrapes) builds with 1s.
    page_group_wait: str = "10s"

    def sel(self, extra: str = "") -> str:
        """A label-matcher block: ``{selector,extra}`` or ``""`` when both are empty."""
        parts = [p for p in (self.selector, extra) if p]
        return "{" + ",".join(parts) + "}" if parts else ""

    @property
    def pod_keys(self) -> tuple[str, ...]:
        """The labels one pod is told apart by across the fleet: the cluster label, then
        :attr:`pod_labels`."""
        return (self.cluster_label, *self.pod_labels) if self.cluster_label else self.pod_labels


DEFAULT = Config()
