"""Every PromQL expression the dashboards run, in one module (the mixin habit).

Selectors come from :class:`mrc_agent.alerts.config.Config` (``Config.sel()``, the same extra
matchers the alert rules use) plus the dashboards' template variables: ``$namespace`` and ``$pod``
on every series (the labels Prometheus' Kubernetes discovery adds, ``Config.pod_labels``) and
``$gpu`` on per-GPU series (``Config.gpu_labels[0]``). Each variable offers "All" as ``.*``, which
also matches a series without that label, so the same queries work on a plain static scrape.

Grafana macros used: ``$__rate_interval`` (range queries over time), ``$__range`` (instant queries
over the selected time range). :func:`substitute_macros` replaces both, and the variables, so each
expression can be sent to a real Prometheus as it is in a test.

The order of the prompt-length and resolution buckets is the instrumentation library's
(``exporters.instrumentation.buckets``), smallest first; the heatmap keeps it fixed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from mrc_agent.alerts.config import Config
from mrc_agent.alerts.engines import QUEUE, TTFT, EngineQueries
from mrc_agent.exporters.instrumentation.buckets import prompt_length_values, resolution_values

#: Template variables every dashboard has (besides ``datasource``), and their label.
POD_VARS: tuple[str, ...] = ("namespace", "pod")
GPU_VAR = "gpu"
#: The cluster variable of kube-prometheus-stack's dashboards: every query filters on it. Its
#: "All" is ``.*``, which also matches series without a ``cluster`` label, so the filter is
#: harmless on a Prometheus that does not set one.
CLUSTER_VAR = "cluster"
_IN_CLUSTER = 'cluster=~"$cluster"'

#: Column and row order of the latency heatmap: the service's default label buckets, smallest
#: first (``<1MP, 1-4MP, >4MP`` x ``0-50, 50-100, 100+``).
RESOLUTION_ORDER: tuple[str, ...] = resolution_values()
PROMPT_LENGTH_ORDER: tuple[str, ...] = prompt_length_values()

#: Label the heatmap query adds so that Grafana can sort rows into RESOLUTION_ORDER ("1", "2", ...)
#: before ``groupingToMatrix`` (which keeps the order rows first appear in).
RESOLUTION_RANK_LABEL = "resolution_rank"

_IN_NAMESPACE = 'cluster=~"$cluster",namespace=~"$namespace"'

RATE = "$__rate_interval"
RANGE = "$__range"


@dataclass(frozen=True)
class Query:
    """One panel query: the expression and its legend template."""

    expr: str
    legend: str = ""


def _promql_regex_literal(value: str) -> str:
    """An RE2 pattern matching exactly ``value``, escaped for a double-quoted PromQL string."""
    pattern = "".join("\\" + c if c in r".+*?()|[]{}^$\\" else c for c in value)
    # Then the string literal's own escapes: every backslash (the pattern's and a literal one)
    # doubled, and a double quote escaped so it cannot end the string.
    return pattern.replace("\\", "\\\\").replace('"', '\\"')


class PanelQueries:
    """The dashboards' expressions, built from one alerts :class:`Config`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        labels = cfg.pod_labels
        if tuple(labels) != POD_VARS:
            # The template variables are named after the labels; other labels would need other
            # variables, so say so instead of emitting queries that filter on nothing.
            raise ValueError(f"dashboards expect pod labels {POD_VARS}, config has {labels}")
        self.gpu_label = cfg.gpu_labels[0]

    # -- selectors -------------------------------------------------------------------------

    def pod(self, extra: str = "") -> str:
        """Matchers for one pod's series: the config selector, ``$cluster``, ``$namespace``,
        ``$pod``."""
        parts = [_IN_CLUSTER, *(f'{label}=~"${label}"' for label in POD_VARS)]
        if extra:
            parts.append(extra)
        return self.cfg.sel(",".join(parts))

    def gpu(self, extra: str = "") -> str:
        """Matchers for one GPU's series: :meth:`pod` plus ``$gpu``."""
        return self.pod(",".join(p for p in (f'{self.gpu_label}=~"${GPU_VAR}"', extra) if p))

    def variable_query(self, var: str) -> str:
        """The ``label_values`` query of a template variable (each filtered by the ones before)."""
        if var == CLUSTER_VAR:
            return f"label_values(mrc_agent_samples_total{self.cfg.sel()}, cluster)"
        if var == "namespace":
            return f"label_values(mrc_agent_samples_total{self.cfg.sel(_IN_CLUSTER)}, namespace)"
        if var == "pod":
            return f"label_values(mrc_agent_samples_total{self.cfg.sel(_IN_NAMESPACE)}, pod)"
        if var == GPU_VAR:
            return f"label_values(mrc_gpu_utilization_ratio{self.pod()}, {self.gpu_label})"
        raise KeyError(var)

    def service_variable_query(self, var: str) -> str:
        """``label_values`` for the service dashboards, anchored on the service's own metric."""
        if var == CLUSTER_VAR:
            return f"label_values(mrc_requests_total{self.cfg.sel()}, cluster)"
        if var == "namespace":
            return f"label_values(mrc_requests_total{self.cfg.sel(_IN_CLUSTER)}, namespace)"
        if var == "pod":
            return f"label_values(mrc_requests_total{self.cfg.sel(_IN_NAMESPACE)}, pod)"
        raise KeyError(var)

    # -- golden triangle: CPU -------------------------------------------------------------

    @property
    def cpu_user(self) -> Query:
        return Query(f"mrc_process_cpu_user_ratio{self.pod()}",
                     "{{pod}} {{process}} ({{pid}}) process")

    @property
    def hottest_thread(self) -> Query:
        return Query(f"mrc_process_hottest_thread_cpu_user_ratio{self.pod()}",
                     "{{pod}} {{process}} ({{pid}}) hottest thread")

    # -- golden triangle: transfers ---------------------------------------------------------

    @property
    def pcie_tx(self) -> Query:
        return Query(f"mrc_gpu_pcie_tx_bytes_per_second{self.gpu()}",
                     "{{pod}} GPU {{gpu}} PCIe TX (device to host)")

    @property
    def pcie_rx(self) -> Query:
        return Query(f"mrc_gpu_pcie_rx_bytes_per_second{self.gpu()}",
                     "{{pod}} GPU {{gpu}} PCIe RX (host to device)")

    @property
    def pcie_dropped(self) -> Query:
        """PCIe byte-count intervals the agent dropped over the alert's window, per GPU and
        reason: what MRCAgentPCIeBytesUnderCounted compares with its line. TX and RX are read in
        one call, so ``max`` counts a late read once."""
        w = self.cfg.thresholds.pcie_dropped_window
        return Query(f"max without (direction) (increase(mrc_gpu_pcie_dropped_intervals_total"
                     f"{self.gpu()}[{w}]))",
                     "{{pod}} GPU {{gpu}} {{reason}}")

    @property
    def nvlink_tx(self) -> Query:
        return Query(f"rate(mrc_gpu_nvlink_tx_bytes_total{self.gpu()}[{RATE}])",
                     "{{pod}} GPU {{gpu}} NVLink TX")

    @property
    def nvlink_rx(self) -> Query:
        return Query(f"rate(mrc_gpu_nvlink_rx_bytes_total{self.gpu()}[{RATE}])",
                     "{{pod}} GPU {{gpu}} NVLink RX")

    @property
    def nvlink_total(self) -> Query:
        """TX + RX: the value MRCNVLinkBandwidthLow compares with its line."""
        return Query(f"{self.nvlink_tx.expr} + {self.nvlink_rx.expr}",
                     "{{pod}} GPU {{gpu}} NVLink TX + RX")

    # -- golden triangle: compute per memory ------------------------------------------------

    @property
    def instructions_per_dram_byte(self) -> Query:
        # Nsight's sm__inst_executed / DRAM bytes read, from the profiling counters.
        return Query(
            f"rate(mrc_gpu_sm_instructions_executed_total{self.gpu()}[{RATE}])"
            f" / rate(mrc_gpu_dram_read_bytes_total{self.gpu()}[{RATE}])",
            "{{pod}} GPU {{gpu}}")

    @property
    def gpm_activity_ratio(self) -> Query:
        return Query(f"mrc_gpu_gpm_sm_to_dram_activity{self.gpu()}", "{{pod}} GPU {{gpu}}")

    @property
    def compute_memory_source(self) -> Query:
        return Query(f"mrc_agent_compute_memory_source_info{self.pod()}", "{{source}}")

    # -- golden triangle: utilisation, idle windows, starvation ----------------------------

    @property
    def gpu_utilization(self) -> Query:
        return Query(f"mrc_gpu_utilization_ratio{self.gpu()}", "{{pod}} GPU {{gpu}}")

    @property
    def gpu_duty_cycle(self) -> Query:
        # From the busy-seconds counter integrated over every utilisation sample, so the share
        # holds over the whole rate window, not only at the instant of each scrape.
        return Query(f"rate(mrc_gpu_busy_seconds_total{self.gpu()}[{RATE}])",
                     "{{pod}} GPU {{gpu}} duty cycle")

    @property
    def gpu_idle_current(self) -> Query:
        return Query(f"mrc_gpu_idle_current_seconds{self.gpu()}", "{{pod}} GPU {{gpu}}")

    @property
    def idle_windows_over_range(self) -> Query:
        """Completed idle windows per duration bucket over the selected range (instant)."""
        return Query(
            f"sum by (le) (increase(mrc_gpu_idle_window_seconds_bucket{self.gpu()}[{RANGE}]))",
            "{{le}}")

    @property
    def idle_windows_over_time(self) -> Query:
        """The same buckets per query step, for a heatmap over time."""
        return Query(
            f"sum by (le) (increase(mrc_gpu_idle_window_seconds_bucket{self.gpu()}[{RATE}]))",
            "{{le}}")

    @property
    def starved(self) -> Query:
        return Query(f"mrc_gpu_starved{self.pod()}", "{{pod}} {{process}} ({{pid}}) starved now")

    @property
    def starved_share(self) -> Query:
        """Share of the alert's window spent starved: the value MRCGPUStarved compares."""
        window = self.cfg.thresholds.starved_window
        return Query(f"avg_over_time(mrc_gpu_starved{self.pod()}[{window}])",
                     f"{{{{pod}}}} {{{{process}}}} ({{{{pid}}}}) share of last {window} starved")

    @property
    def functions_while_gpu_idle(self) -> Query:
        """Share of wall-clock time the hottest thread spent in each function while its GPUs
        idled or it was starved (the stacks collector)."""
        sel = self.pod('gpu_state=~"idle|starved"')
        return Query(f"sum by (pod, process, function) "
                     f"(rate(mrc_process_function_seconds_total{sel}[{RATE}]))",
                     "{{pod}} {{process}}: {{function}}")

    # -- service ------------------------------------------------------------------------------

    def _quantile(self, q: float, metric: str, by: str = "", window: str = RATE) -> str:
        groups = ", ".join(p for p in ("le", by) if p)
        # Over the whole selected range an instant query reads the increase; over time, the rate.
        fn = "increase" if window == RANGE else "rate"
        return (f"histogram_quantile({q:g}, sum by ({groups}) "
                f"({fn}({metric}_bucket{self.pod()}[{window}])))")

    def request_latency(self, q: float) -> Query:
        return Query(self._quantile(q, "mrc_request_duration_seconds"), f"P{q * 100:g}")

    def ttft(self, q: float) -> Query:
        return Query(self._quantile(q, "mrc_time_to_first_token_seconds"), f"P{q * 100:g}")

    @property
    def ttft_sla_le(self) -> str:
        """The ``le`` label of the SLA bucket exactly as prometheus-client writes it ("0.5")."""
        return floatToGoString(self.cfg.thresholds.ttft_seconds)

    def _ttft_within_sla(self, fn: str, window: str) -> str:
        sla = self.pod(f'le="{self.ttft_sla_le}"')
        return (f"sum({fn}(mrc_time_to_first_token_seconds_bucket{sla}[{window}]))"
                f" / sum({fn}(mrc_time_to_first_token_seconds_count{self.pod()}[{window}]))")

    @property
    def ttft_within_sla(self) -> Query:
        return Query(self._ttft_within_sla("rate", RATE), "within SLA")

    @property
    def ttft_within_sla_over_range(self) -> Query:
        return Query(self._ttft_within_sla("increase", RANGE), "within SLA")

    @property
    def throughput(self) -> Query:
        return Query(f"sum(rate(mrc_requests_total{self.pod()}[{RATE}]))", "requests answered")

    @property
    def errors_by_outcome(self) -> Query:
        not_ok = self.pod('outcome!="ok"')
        return Query(f"sum by (outcome) (rate(mrc_requests_total{not_ok}[{RATE}]))",
                     "{{outcome}}")

    @property
    def error_ratio(self) -> Query:
        # Server-side failures only, as the error alert counts them: a flood of 4xx or 429s is
        # the client's or the admission control's business, not an error of the service.
        bad = self.pod('outcome=~"error|timeout"')
        return Query(f"sum(rate(mrc_requests_total{bad}[{RATE}]))"
                     f" / sum(rate(mrc_requests_total{self.pod()}[{RATE}]))",
                     "error or timeout")

    @property
    def stage_breakdown(self) -> Query:
        """Mean seconds per request spent in each stage; stacked, about the mean request."""
        return Query(
            f"sum by (stage) (rate(mrc_stage_duration_seconds_sum{self.pod()}[{RATE}]))"
            f" / on() group_left()"
            f" sum(rate(mrc_request_duration_seconds_count{self.pod()}[{RATE}]))",
            "{{stage}}")

    def peak_gpu_memory(self, q: float) -> Query:
        return Query(self._quantile(q, "mrc_request_peak_gpu_memory_bytes"), f"P{q * 100:g}")

    @property
    def cache_hit_ratio(self) -> Query:
        return Query(f"sum(rate(mrc_cache_hits_total{self.pod()}[{RATE}]))"
                     f" / sum(rate(mrc_cache_lookups_total{self.pod()}[{RATE}]))", "hit ratio")

    @property
    def chain_break_ratio(self) -> Query:
        """Chain breaks per answered request, by the step that broke."""
        return Query(
            f"sum by (step) (rate(mrc_chain_breaks_total{self.pod()}[{RATE}]))"
            f" / on() group_left() sum(rate(mrc_requests_total{self.pod()}[{RATE}]))",
            "{{step}}")

    @property
    def in_flight(self) -> Query:
        return Query(f"sum(mrc_requests_in_flight{self.pod()})", "in flight")

    @property
    def queued(self) -> Query:
        return Query(f"sum(mrc_requests_queued{self.pod()})", "queued")

    @property
    def model_info(self) -> Query:
        return Query(f"mrc_model_info{self.pod()} == 1", "")

    # -- the engines' view beside the client's (alerts/engines.py, docs/engines.md) -----------
    # The engine series are recorded over the request window (5m), so the client's side is read
    # over the same window here: both lines then cover the same requests.

    _POD_KEYS = "cluster, namespace, pod"

    @property
    def _engine(self) -> EngineQueries:
        return EngineQueries(self.cfg)

    def _client_ttft(self, part: str) -> str:
        w = self.cfg.thresholds.request_rate_window
        return f"rate(mrc_time_to_first_token_seconds_{part}{self.pod()}[{w}])"

    def client_ttft(self, q: float) -> Query:
        """The meter's (client-observed) TTFT quantile per pod, over the engine rules' window."""
        return Query(f"histogram_quantile({q:g}, sum by ({self._POD_KEYS}, le) "
                     f"({self._client_ttft('bucket')}))", f"{{{{pod}}}} client P{q * 100:g}")

    def _engine_quantile(self, signal: str, q: float, what: str) -> Query:
        buckets = self._engine.histogram(signal, "bucket") + self.pod()
        return Query(f"histogram_quantile({q:g}, sum by ({self._POD_KEYS}, engine, le) "
                     f"({buckets}))", f"{{{{pod}}}} {{{{engine}}}} {what}P{q * 100:g}")

    def engine_ttft(self, q: float) -> Query:
        return self._engine_quantile(TTFT, q, "")

    def engine_queue(self, q: float) -> Query:
        return self._engine_quantile(QUEUE, q, "queue ")

    @property
    def ttft_outside_engine(self) -> Query:
        """Mean client-observed TTFT minus the engine's mean TTFT, per pod and engine: the time
        the engine's clock does not see. Means subtract exactly; quantiles would not."""
        by = f"sum by ({self._POD_KEYS})"
        by_engine = f"sum by ({self._POD_KEYS}, engine)"
        e = self._engine
        client = (f"{by} ({self._client_ttft('sum')})\n  / {by} ({self._client_ttft('count')})")
        engine = (f"{by_engine} ({e.histogram(TTFT, 'sum')}{self.pod()})\n"
                  f"  / {by_engine} ({e.histogram(TTFT, 'count')}{self.pod()})")
        return Query(f"(\n  {client}\n)\n- on ({self._POD_KEYS}) group_right ()\n(\n  {engine}\n)",
                     "{{pod}} outside {{engine}}")

    @property
    def engine_kv_usage(self) -> Query:
        return Query(f"max by ({self._POD_KEYS}, engine) "
                     f"({self._engine.kv_usage}{self.pod()})", "{{pod}} {{engine}}")

    @property
    def engine_mm_hit_ratio(self) -> Query:
        by = f"sum by ({self._POD_KEYS}, engine)"
        e = self._engine
        # No lookups is no ratio, not 0 / 0: a NaN would be drawn as a value.
        return Query(f"{by} ({e.mm_hits}{self.pod()})\n/ ({by} ({e.mm_queries}{self.pod()}) "
                     "> 0)", "{{pod}} {{engine}}")

    # -- latency heatmap ----------------------------------------------------------------------

    def _ranked_by_resolution(self, expr: str) -> str:
        """``expr`` with a ``resolution_rank`` label ("1", "2", ...) in RESOLUTION_ORDER."""
        for rank, value in enumerate(RESOLUTION_ORDER, start=1):
            expr = (f'label_replace({expr}, "{RESOLUTION_RANK_LABEL}", "{rank}", '
                    f'"resolution", "{_promql_regex_literal(value)}")')
        return expr

    def latency_quantile_matrix(self, q: float) -> Query:
        """P``q`` request latency per resolution x prompt length over the selected range."""
        return Query(self._ranked_by_resolution(self._quantile(
            q, "mrc_request_duration_seconds", "prompt_length, resolution", RANGE)), "")

    def latency_quantile_by_bucket(self, q: float) -> Query:
        return Query(self._quantile(q, "mrc_request_duration_seconds", "prompt_length, resolution"),
                     "{{resolution}} x {{prompt_length}}")

    @property
    def ttft_within_sla_matrix(self) -> Query:
        """Share of first tokens within the SLA per resolution x prompt length, selected range."""
        sla = self.pod(f'le="{self.ttft_sla_le}"')
        by = "sum by (prompt_length, resolution)"
        return Query(self._ranked_by_resolution(
            f"{by} (increase(mrc_time_to_first_token_seconds_bucket{sla}[{RANGE}]))"
            f" / {by} (increase(mrc_time_to_first_token_seconds_count{self.pod()}[{RANGE}]))"), "")


# -- macros --------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")


def _duration(seconds: float) -> str:
    if seconds <= 0:
        raise ValueError(f"a duration must be > 0, got {seconds}")
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def substitute_macros(expr: str, range_s: float = 3600.0, rate_interval_s: float = 60.0,
                      interval_s: float = 15.0, vars: Mapping[str, str] | None = None,
                      default_var: str = ".*") -> str:
    """``expr`` with Grafana's macros and the dashboards' variables replaced, ready for Prometheus.

    ``$__rate_interval``, ``$__interval`` and ``$__range`` become Prometheus durations
    (``$__range_s``/``_ms`` and ``$__interval_ms`` plain numbers); ``$namespace``, ``$pod``,
    ``$gpu`` become ``vars[name]`` or ``default_var`` (``.*``, Grafana's "All" for these
    variables); ``$datasource`` becomes ``vars.get("datasource", "prometheus")``. Capture-group
    references such as ``$1`` are left alone, as Grafana leaves them. Any other ``$name`` raises
    ``KeyError``, so a query cannot reach Prometheus with a variable nobody substituted.
    """
    given = dict(vars or {})
    macros = {
        "__rate_interval": _duration(rate_interval_s),
        "__interval": _duration(interval_s),
        "__interval_ms": str(round(interval_s * 1000)),
        "__range": _duration(range_s),
        "__range_s": str(round(range_s)),
        "__range_ms": str(round(range_s * 1000)),
    }

    def replace(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g is not None)
        if name.isdigit():
            return m.group(0)
        if name in macros:
            return macros[name]
        if name in given:
            return given[name]
        if name in (*POD_VARS, GPU_VAR, CLUSTER_VAR):
            return default_var
        if name == "datasource":
            return "prometheus"
        raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")

    return _VAR.sub(replace, expr)

