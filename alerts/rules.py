"""The MRC recording and alerting rules as plain dicts (Prometheus rule-file groups).

Expressions come from :mod:`mrc_agent.alerts.queries`, thresholds and windows from
:mod:`mrc_agent.alerts.config`. Each domain is one group: its recording rules first, then the alerts
that read them. Prometheus evaluates a group's rules in order at one timestamp, so an alert sees the
value recorded in the same evaluation, not the one before it — the `for` of an alert counts from the
sample that crossed the line.

Alert names are a contract: dashboards link to them and runbooks are named after them.
Every alert has ``for``, ``severity`` (``critical``: someone gets up; ``warning``: next working
day — the severities kube-prometheus-stack's rules and Alertmanager routing use),
``summary``, a ``description`` that carries the value, and ``runbook_url``.
"""

from __future__ import annotations

from typing import Any

from mrc_agent.alerts.config import Config
from mrc_agent.alerts.engines import EngineQueries
from mrc_agent.alerts.queries import RuleQueries, check_duration, num

Rule = dict[str, Any]
Group = dict[str, Any]

#: The severities of kube-prometheus-stack: its Alertmanager routing and inhibition, and most
#: teams' pager integrations, key on these (``info`` is for rules that only inform; none here).
PAGE = "critical"
TICKET = "warning"


def _pct(ratio: float) -> str:
    return f"{ratio * 100:g}%"


def _si(value: float) -> str:
    """50e9 → ``50G``: the thresholds as the description's ``humanize`` prints values."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:g}{prefix}"
    return f"{value:g}"


def record(name: str, expr: str) -> Rule:
    return {"record": name, "expr": expr}


def alert(cfg: Config, name: str, expr: str, for_: str, severity: str, summary: str,
          description: str) -> Rule:
    """An alerting rule with the annotations every MRC alert carries."""
    if severity not in (PAGE, TICKET):
        raise ValueError(f"{name}: severity must be {PAGE} or {TICKET}, not {severity!r}")
    return {
        "alert": name,
        "expr": expr,
        "for": check_duration(for_),
        "labels": {"severity": severity},
        "annotations": {
            "description": description,
            "runbook_url": runbook_url(cfg, name),
            "summary": summary,
        },
    }


def runbook_url(cfg: Config, name: str) -> str:
    return f"{cfg.runbook_base.rstrip('/')}/{name}.md"


def top_function_template(query: str) -> str:
    """An annotation sentence naming what ``query`` (a Go printf format of the alert's process
    and instance) finds, only where it finds something: the stacks collector may be off."""
    go = query.replace("\\", "\\\\").replace('"', '\\"')
    return (f'{{{{ with printf "{go}" $labels.process $labels.instance | query }}}} Its hottest '
            'thread ran {{ . | first | label "function" }} most of that time.{{ end }}')


_GPU = ("GPU {{ $labels.gpu }} ({{ $labels.gpu_model }}, {{ $labels.uuid }}) "
        "on {{ $labels.instance }}")
_PROC = "{{ $labels.process }} on {{ $labels.instance }}"


def golden_triangle(cfg: Config) -> Group:
    """Target CPU, interconnect, compute per memory byte, starvation: the design's triangle."""
    q, t = RuleQueries(cfg), cfg.thresholds
    w = check_duration(t.rate_window)
    busy = f"{q.gpu_util_avg} > {num(t.gpu_busy_ratio)}"
    rules: list[Rule] = [
        record(q.cpu_user_max, q.cpu_user_max_expr()),
        record(q.gpu_util_avg, q.gpu_util_avg_expr()),
        record(q.nvlink_rate, q.nvlink_rate_expr()),
        record(q.instructions_per_byte, q.instructions_per_byte_expr()),
        record(q.gpm_activity_avg, q.gpm_activity_avg_expr()),
        record(q.starved_avg, q.starved_avg_expr()),
        alert(
            cfg, "MRCProcessCPUUserSaturated",
            f"{q.cpu_user_max} > {num(t.cpu_user_ratio)}",
            t.cpu_user_for, PAGE,
            "An MRC target process is holding a full CPU core in user space.",
            f"{_PROC} has used {{{{ $value | humanizePercentage }}}} of a core in user space "
            f"for {t.cpu_user_for} (threshold {_pct(t.cpu_user_ratio)}). A GIL-bound "
            "preprocessing thread at one core cannot feed the GPU any faster.",
        ),
        alert(
            cfg, "MRCNVLinkBandwidthLow",
            f"{q.nvlink_rate} < {num(t.nvlink_bytes_per_second)}\nand\n{busy}",
            t.nvlink_for, PAGE,
            "NVLink traffic is low while the GPU is busy.",
            f"{_GPU} moves {{{{ $value | humanize }}}}B/s over NVLink (TX + RX, rate over "
            f"{w}) while more than {_pct(t.gpu_busy_ratio)} busy; the line is "
            f"{_si(t.nvlink_bytes_per_second)}B/s. A tensor-parallel model this slow on its "
            "interconnect waits on transfers.",
        ),
        alert(
            cfg, "MRCGPUMemoryBound",
            f"{q.instructions_per_byte} < {num(t.instructions_per_dram_byte)}\nand\n{busy}",
            t.memory_bound_for, TICKET,
            "GPU kernels are memory-bound (SM instructions per DRAM byte, profiling counters).",
            f"{_GPU} executes {{{{ printf \"%.2f\" $value }}}} SM instructions per DRAM byte "
            "read "
            f"(profiling counters, rates over {w}) while busy, below "
            f"{num(t.instructions_per_dram_byte)} for {t.memory_bound_for}: its kernels wait "
            "on memory, not on arithmetic.",
        ),
        alert(
            cfg, "MRCGPUMemoryBoundGPMProxy",
            f"(\n  {q.gpm_activity_avg} < {num(t.gpm_sm_to_dram_activity)}\n  and\n  {busy}\n)\n"
            f"unless on ({', '.join(cfg.gpu_labels)}) (\n  {q.true_counters_present()}\n)",
            t.memory_bound_for, TICKET,
            "GPU kernels look memory-bound (GPM activity proxy; no profiling counters here).",
            f"{_GPU} keeps its SMs active only {{{{ $value | humanizePercentage }}}} as much "
            f"as its DRAM bandwidth is used (GPM activity proxy averaged over {w}, line "
            f"{_pct(t.gpm_sm_to_dram_activity)}; not an instruction count) while busy, for "
            f"{t.memory_bound_for}: the activity signature of memory-bound kernels. The "
            "profiling collector gives the true instructions per byte.",
        ),
        alert(
            cfg, "MRCGPUStarved",
            f"{q.starved_avg} >= {num(t.starved_fraction)}",
            t.starved_for, PAGE,
            "An MRC target keeps its GPU waiting: CPU hot while the GPU idles.",
            f"{_PROC} was starved (user CPU at the agent's hot line while its GPU idled) "
            f"{{{{ $value | humanizePercentage }}}} of the last {t.starved_window}, for "
            f"{t.starved_for}. The GPU is waiting on CPU-side work."
            + top_function_template(q.starved_top_function()),
        ),
    ]
    return {"name": "mrc-golden-triangle", "rules": rules}


def _burn_text(burn_rates: tuple[tuple[float, str, str], ...]) -> str:
    return " or ".join(f"{num(f)}x over {long} and {short}" for f, long, short in burn_rates)


def service_slo(cfg: Config) -> Group:
    """Time to first token: error ratios per window and multi-window, multi-burn-rate alerts."""
    q, t = RuleQueries(cfg), cfg.thresholds
    rules: list[Rule] = [record(q.ttft_errors(w), q.ttft_errors_expr(w))
                         for w in map(check_duration, q.slo_windows())]
    slo = (f"SLO: {_pct(t.ttft_objective)} of first tokens within {num(t.ttft_seconds)}s, so "
           f"{_pct(1 - t.ttft_objective)} may be slower")
    for name, burn_rates, for_, severity, speed in (
        ("MRCTimeToFirstTokenSLOFastBurn", t.slo_page_burn_rates, t.slo_page_for, PAGE, "fast"),
        ("MRCTimeToFirstTokenSLOSlowBurn", t.slo_ticket_burn_rates, t.slo_ticket_for, TICKET,
         "steadily"),
    ):
        rules.append(alert(
            cfg, name, q.burn_expr(burn_rates), for_, severity,
            f"The time-to-first-token error budget of an MRC service is burning {speed}.",
            f"{{{{ $value | humanizePercentage }}}} of requests to {{{{ $labels.job }}}} got "
            f"their first token after {num(t.ttft_seconds)}s over the long window ({slo}). "
            f"Both windows of a pair burn the budget faster than sustainable: "
            f"{_burn_text(burn_rates)}.",
        ))
    return {"name": "mrc-service-slo", "rules": rules}


def service(cfg: Config) -> Group:
    """Request latency per bucket, errors and chain breaks of the instrumented service."""
    q, t = RuleQueries(cfg), cfg.thresholds
    w = check_duration(t.request_rate_window)
    rules: list[Rule] = [
        record(q.latency_p99, q.latency_p99_expr()),
        record(q.error_ratio, q.error_ratio_expr()),
        record(q.chain_break_ratio, q.chain_break_ratio_expr()),
        alert(
            cfg, "MRCRequestLatencyP99High",
            f"{q.latency_p99} > {num(t.latency_p99_seconds)}",
            t.latency_for, TICKET,
            "MRC request latency P99 is over the line for one prompt-length x resolution bucket.",
            "P99 request latency of {{ $labels.job }} for prompt_length={{ "
            "$labels.prompt_length }}, resolution={{ $labels.resolution }} is {{ $value | "
            f"humanize }}}}s over {w} (line {num(t.latency_p99_seconds)}s), for "
            f"{t.latency_for}.",
        ),
        alert(
            cfg, "MRCRequestErrorRateHigh",
            f"{q.error_ratio} > {num(t.error_ratio)}",
            t.error_for, PAGE,
            "An MRC service is failing requests (outcome error or timeout).",
            "{{ $value | humanizePercentage }} of requests to {{ $labels.job }} ended in error "
            f"or timeout over {w} (line {_pct(t.error_ratio)}), for {t.error_for}.",
        ),
        alert(
            cfg, "MRCChainBreakRateHigh",
            f"{q.chain_break_ratio} > {num(t.chain_break_ratio)}",
            t.chain_break_for, TICKET,
            "An intermediate step of the reasoning chain keeps giving nothing usable.",
            "{{ $value | humanizePercentage }} of requests to {{ $labels.job }} broke at the "
            f"{{{{ $labels.step }}}} step over {w} (line {_pct(t.chain_break_ratio)}), for "
            f"{t.chain_break_for}.",
        ),
    ]
    return {"name": "mrc-service", "rules": rules}


def agent_health(cfg: Config) -> Group:
    """The sidecar itself: scraped, collecting, watching something."""
    q, t = RuleQueries(cfg), cfg.thresholds
    rules: list[Rule] = [
        alert(
            cfg, "MRCAgentDown", q.agent_down_expr("MRCAgentDown"), t.absent_for, TICKET,
            "An mrc-agent that was scraped before cannot be scraped.",
            "The mrc-agent at {{ $labels.instance }} (job {{ $labels.job }}) has been down "
            f"(up = {{{{ $value | humanize }}}}) for {t.absent_for}. Its pod's GPU and process "
            "signals are blind: the golden-triangle alerts cannot fire for it.",
        ),
        alert(
            cfg, "MRCAgentCollectorDown", q.collector_down_expr(), t.absent_for, TICKET,
            "An mrc-agent collector keeps failing although its source exists on the host.",
            "Collector {{ $labels.collector }} of the mrc-agent at {{ $labels.instance }} has "
            f"reported success = {{{{ $value | humanize }}}} for {t.absent_for} while its "
            "source is available on the host.",
        ),
        alert(
            cfg, "MRCAgentSamplingStale", q.sampling_stale_expr(), t.stale_for, PAGE,
            "An mrc-agent serves a snapshot that stopped updating.",
            "The mrc-agent at {{ $labels.instance }} serves a snapshot taken "
            "{{ printf \"%.0f\" $value }} s ago, more than "
            f"{num(t.stale_intervals)} sampling intervals: its /metrics answers but the "
            "golden-triangle series are frozen, so no golden-triangle alert can fire for its "
            "pod. Its /readyz says which collector is stuck or why the pass fails.",
        ),
        alert(
            cfg, "MRCAgentPCIeBytesUnderCounted", q.pcie_dropped_expr(), t.pcie_dropped_for,
            TICKET,
            "An mrc-agent keeps dropping PCIe byte-count intervals: PCIe bandwidth reads low.",
            f"{_GPU} dropped {{{{ $value | humanize }}}} PCIe byte-count intervals with reason "
            f"{{{{ $labels.reason }}}} over the last {t.pcie_dropped_window} (line "
            f"{num(t.pcie_dropped_intervals)}), for {t.pcie_dropped_for}: "
            "mrc_gpu_pcie_tx/rx_bytes_total and the PCIe bandwidth panels under-read. Reason "
            "gap: the agent read a 32-bit counter too late to rule out a wrap; check the "
            "sidecar's CPU limit and throttling (container_cpu_cfs_throttled_periods_total). "
            "Reason impossible: an increase beyond the link's bound; check the PCIe generation "
            "and width NVML reports (nvidia-smi -q -d PCIE).",
        ),
        alert(
            cfg, "MRCAgentTargetAbsent", q.targets_absent_expr(), t.absent_for, TICKET,
            "An mrc-agent watches no target process.",
            "The mrc-agent at {{ $labels.instance }} has watched {{ $value | humanize }} target "
            f"processes for {t.absent_for}: the service process is gone, or --pid, --pidfile "
            "or --process-name matches nothing.",
        ),
    ]
    return {"name": "mrc-agent-health", "rules": rules}


def fleet(cfg: Config) -> Group:
    """Recording rules only: one series per pod or per model, so fleet dashboards and a
    global view (federation, remote_write to Thanos or Mimir) read a few series per pod
    instead of every PID, GPU, link and histogram bucket (docs/fleet.md). No alert reads
    them: alerts stay on the per-target rules above, next to the raw data."""
    q = RuleQueries(cfg)
    rules: list[Rule] = [
        record(q.pod_cpu_user_max, q.pod_cpu_user_max_expr()),
        record(q.pod_hottest_thread_max, q.pod_hottest_thread_max_expr()),
        record(q.pod_gpu_util_avg, q.pod_gpu_util_avg_expr()),
        record(q.pod_gpu_memory_used_max, q.pod_gpu_memory_used_max_expr()),
        record(q.pod_nvlink_rate, q.pod_nvlink_rate_expr()),
        record(q.pod_pcie_sum, q.pod_pcie_sum_expr()),
        record(q.pod_starved_rate, q.pod_starved_rate_expr()),
        record(q.model_pods, q.model_pods_expr()),
        record(q.model_requests_rate, q.model_requests_rate_expr()),
        # The bucket rates first: the P99 below reads them in the same evaluation.
        record(q.model_latency_buckets, q.model_latency_buckets_expr()),
        record(q.model_latency_p99, q.model_latency_p99_expr()),
        record(q.model_ttft_errors, q.model_ttft_errors_expr()),
        record(q.model_ttft_count, q.model_ttft_count_expr()),
        record(q.model_gpu_util_avg, q.model_gpu_util_avg_expr()),
    ]
    return {"name": "mrc-fleet", "rules": rules}


def engines(cfg: Config) -> Group:
    """Recording rules only: the inference engines' own view (vLLM, SGLang, TGI) under
    ``mrc:engine_*`` names, whichever of their names a version exports (alerts/engines.py,
    docs/engines.md). The service dashboard draws it beside the client-observed TTFT."""
    return {"name": "mrc-engines",
            "rules": [record(name, expr) for name, expr in EngineQueries(cfg).recording_rules()]}


def groups(cfg: Config) -> list[Group]:
    """All rule groups, in a fixed order."""
    return [golden_triangle(cfg), service_slo(cfg), service(cfg), agent_health(cfg), fleet(cfg),
            engines(cfg)]


def alerts(cfg: Config) -> list[Rule]:
    """Every alerting rule, in file order."""
    return [r for g in groups(cfg) for r in g["rules"] if "alert" in r]


def recording_rules(cfg: Config) -> list[Rule]:
    """Every recording rule, in file order."""
    return [r for g in groups(cfg) for r in g["rules"] if "record" in r]
