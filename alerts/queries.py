"""PromQL for the MRC rules, built from one :class:`~mrc_agent.alerts.config.Config`.

Every raw metric selector goes through ``Config.sel()`` so a deployment can pin the rules to its
own jobs or namespaces; by default there is no matcher at all and the rules work whatever the
scrape job is called. Nothing here matches on ``job``: joins use the labels the series share
(all of them, for series of one agent) or the GPU's identity labels.

Recording-rule names follow ``level:metric:operations``:

* ``mrc:`` — one target as Prometheus scraped it (``job``, ``instance``, ``namespace``, ``pod``,
  …), per GPU for GPU series and per process name for process series (``pid`` aggregated away,
  so a restarted worker keeps its alert state).
* ``mrc_service:`` — one service: the replica labels (``Config.replica_labels``) summed away.
* ``mrc_pod:`` — one pod (``Config.pod_labels``), every target, GPU and link of it aggregated:
  the fleet view and what leaves the cluster (docs/fleet.md).
* ``mrc_model:`` — one model (``Config.model_labels``, taken from the pod's ``mrc_model_info``),
  every pod serving it summed.

The window is part of the name (``rate1m``), so a build with other windows makes other names
instead of silently changing what a name means.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from mrc_agent.agent.core.units import check_prometheus_duration, parse_duration
from mrc_agent.alerts.config import Config, Thresholds


def check_duration(value: str) -> str:
    """Return ``value`` if it is a Prometheus duration (``90s``, ``1h30m``), else raise."""
    return check_prometheus_duration(value)


def num(value: float) -> str:
    """A threshold as PromQL reads it: shortest form, engineering notation for large whole
    numbers (``0.95``, ``8``, ``50e9``)."""
    if value == int(value) and abs(value) >= 1e6:
        mantissa, exponent = int(value), 0
        while mantissa % 1000 == 0:
            mantissa, exponent = mantissa // 1000, exponent + 3
        if exponent:
            return f"{mantissa}e{exponent}"
    return format(value, "g")


def le(value: float) -> str:
    """A histogram bound as client libraries write it in ``le`` (``0.5``, ``10.0``, ``+Inf``).

    Prometheus 2.x compares ``le`` as a string, so the bound must be one of the histogram's
    boundaries and be spelled the way the exposition spells it.
    """
    return floatToGoString(value)


def _labels(labels: tuple[str, ...]) -> str:
    return ", ".join(labels)


@dataclass(frozen=True)
class RuleQueries:
    """Expressions and recording-rule names for one config."""

    cfg: Config

    def m(self, metric: str, extra: str = "") -> str:
        """``metric{selector,extra}``."""
        return metric + self.cfg.sel(extra)

    @property
    def _t(self) -> Thresholds:
        return self.cfg.thresholds

    # --- golden triangle ---------------------------------------------------------------------

    @property
    def cpu_user_max(self) -> str:
        return "mrc:process_cpu_user_ratio:max"

    def cpu_user_max_expr(self) -> str:
        # max over the PIDs of one process name: a restarted or added worker keeps one series,
        # so `for` is not reset by a PID change; the hottest worker decides.
        return f"max without (pid) ({self.m('mrc_process_cpu_user_ratio')})"

    @property
    def gpu_util_avg(self) -> str:
        return f"mrc:gpu_utilization_ratio:avg_over_time{self._t.rate_window}"

    def gpu_util_avg_expr(self) -> str:
        # Averaged over the same window as the rates it qualifies: "busy" means busy over the
        # window the bandwidth was measured in, and one idle sample does not reset `for`.
        return f"avg_over_time({self.m('mrc_gpu_utilization_ratio')}[{self._t.rate_window}])"

    @property
    def nvlink_rate(self) -> str:
        return f"mrc:gpu_nvlink_bytes:rate{self._t.rate_window}"

    def nvlink_rate_expr(self) -> str:
        # rate() divides by the whole window even when the series is younger than it, so a
        # fresh series (agent start, GPU appears) reads low for one window: a false "< 50 GB/s"
        # whenever the window is longer than `for`. Only series that existed a full window ago
        # are recorded.
        w = self._t.rate_window
        tx = self.m("mrc_gpu_nvlink_tx_bytes_total")
        return (f"(\n"
                f"  rate({tx}[{w}])\n"
                f"  + rate({self.m('mrc_gpu_nvlink_rx_bytes_total')}[{w}])\n"
                f")\n"
                f"and\n"
                f"{tx} offset {w}")

    @property
    def instructions_per_byte(self) -> str:
        return f"mrc:gpu_sm_instructions_per_dram_byte:ratio_rate{self._t.rate_window}"

    def instructions_per_byte_expr(self) -> str:
        w = self._t.rate_window
        return (f"rate({self.m('mrc_gpu_sm_instructions_executed_total')}[{w}])\n"
                f"/ rate({self.m('mrc_gpu_dram_read_bytes_total')}[{w}])")

    @property
    def gpm_activity_avg(self) -> str:
        return f"mrc:gpu_gpm_sm_to_dram_activity:avg_over_time{self._t.rate_window}"

    def gpm_activity_avg_expr(self) -> str:
        return (f"avg_over_time({self.m('mrc_gpu_gpm_sm_to_dram_activity')}"
                f"[{self._t.rate_window}])")

    def true_counters_present(self) -> str:
        """The profiling DRAM byte counter, for ``unless on(gpu, uuid)``: never mix the two
        sources. The DRAM series alone decides: with only the SM counter (a chip whose set
        lacks a DRAM read counter) the true ratio does not exist, and the proxy must page."""
        return self.m('mrc_gpu_dram_read_bytes_total')

    @property
    def starved_avg(self) -> str:
        return f"mrc:gpu_starved:max_avg_over_time{self._t.starved_window}"

    def starved_top_function(self) -> str:
        """PromQL, as a Go ``printf`` format taking the alert's process and instance: the
        function the target's hottest thread ran most while starved (the stacks collector)."""
        sel = self.m("mrc_process_function_seconds_total",
                     'gpu_state="starved",process=%q,instance=%q')
        return (f"topk(1, sum by (function) (increase({sel}[{self._t.starved_window}])))")

    def starved_avg_expr(self) -> str:
        return (f"max without (pid) (avg_over_time({self.m('mrc_gpu_starved')}"
                f"[{self._t.starved_window}]))")

    # --- service -----------------------------------------------------------------------------

    def _without(self, *labels: str) -> str:
        return f"without ({_labels((*labels, *self.cfg.replica_labels))})"

    def ttft_errors(self, window: str) -> str:
        return f"mrc_service:time_to_first_token_slo_errors:ratio_rate{window}"

    def ttft_errors_expr(self, window: str) -> str:
        """Share of requests whose first token came after the SLO bound, over ``window``."""
        bound = le(self._t.ttft_seconds)
        good = self.m("mrc_time_to_first_token_seconds_bucket", f'le="{bound}"')
        total = self.m("mrc_time_to_first_token_seconds_count")
        return (f"1 - (\n"
                f"  sum {self._without('le', 'prompt_length', 'resolution')} "
                f"(rate({good}[{window}]))\n"
                f"  /\n"
                f"  sum {self._without('prompt_length', 'resolution')} "
                f"(rate({total}[{window}]))\n"
                f")")

    def slo_windows(self) -> list[str]:
        """Every window a burn-rate alert reads, shortest first."""
        pairs = (*self._t.slo_page_burn_rates, *self._t.slo_ticket_burn_rates)
        windows = {w for _, long, short in pairs for w in (long, short)}
        return sorted(windows, key=duration_seconds)

    def burn_expr(self, burn_rates: tuple[tuple[float, str, str], ...]) -> str:
        """Multi-window, multi-burn-rate condition: for any (factor, long, short), both the
        long and the short window burn the budget ``factor`` times faster than sustainable."""
        budget = num(1 - self._t.ttft_objective)
        parts = [
            f"(\n  {self.ttft_errors(long)} > ({num(f)} * {budget})\n"
            f"and\n  {self.ttft_errors(short)} > ({num(f)} * {budget})\n)"
            for f, long, short in burn_rates
        ]
        return "\nor\n".join(parts)

    @property
    def latency_p99(self) -> str:
        return f"mrc_service:request_duration_seconds:p99_rate{self._t.request_rate_window}"

    def latency_p99_expr(self) -> str:
        w = self._t.request_rate_window
        buckets = self.m("mrc_request_duration_seconds_bucket")
        return (f"histogram_quantile(0.99,\n"
                f"  sum {self._without()} (rate({buckets}[{w}]))\n"
                f")")

    @property
    def error_ratio(self) -> str:
        return f"mrc_service:requests_errors:ratio_rate{self._t.request_rate_window}"

    def error_ratio_expr(self) -> str:
        w = self._t.request_rate_window
        errors = self.m("mrc_requests_total", 'outcome=~"error|timeout"')
        total = self.m("mrc_requests_total")
        return (f"sum {self._without('outcome')} (rate({errors}[{w}]))\n"
                f"/\n"
                f"sum {self._without('outcome')} (rate({total}[{w}]))")

    @property
    def chain_break_ratio(self) -> str:
        return f"mrc_service:chain_breaks_per_request:ratio_rate{self._t.request_rate_window}"

    def chain_break_ratio_expr(self) -> str:
        w = self._t.request_rate_window
        breaks = self.m("mrc_chain_breaks_total")
        total = self.m("mrc_requests_total")
        return (f"sum {self._without()} (rate({breaks}[{w}]))\n"
                f"/ ignoring (step) group_left\n"
                f"sum {self._without('outcome')} (rate({total}[{w}]))")

    # --- fleet -------------------------------------------------------------------------------
    # Pre-aggregations for fleet-wide dashboards and for federation / remote_write: one series
    # per pod (``mrc_pod:``) or per model (``mrc_model:``) whatever the number of target PIDs,
    # GPUs, NVLink links, histogram buckets or replicas behind it. See docs/fleet.md.

    @property
    def _cluster(self) -> tuple[str, ...]:
        return (self.cfg.cluster_label,) if self.cfg.cluster_label else ()

    def _pod_by(self) -> str:
        return f"by ({_labels(self.cfg.pod_keys)})"

    def _per_pod(self, op: str, metric: str) -> str:
        return f"{op} {self._pod_by()} ({self.m(metric)})"

    @property
    def pod_cpu_user_max(self) -> str:
        return "mrc_pod:process_cpu_user_ratio:max"

    def pod_cpu_user_max_expr(self) -> str:
        # The hottest target process of the pod: the one that starves its GPU.
        return self._per_pod("max", "mrc_process_cpu_user_ratio")

    @property
    def pod_hottest_thread_max(self) -> str:
        return "mrc_pod:process_hottest_thread_cpu_user_ratio:max"

    def pod_hottest_thread_max_expr(self) -> str:
        # A GIL-bound preprocessing thread reads ~1.0 here while the process total is spread.
        return self._per_pod("max", "mrc_process_hottest_thread_cpu_user_ratio")

    @property
    def pod_gpu_util_avg(self) -> str:
        return "mrc_pod:gpu_utilization_ratio:avg"

    def pod_gpu_util_avg_expr(self) -> str:
        return self._per_pod("avg", "mrc_gpu_utilization_ratio")

    @property
    def pod_gpu_memory_used_max(self) -> str:
        return "mrc_pod:gpu_memory_used_ratio:max"

    def pod_gpu_memory_used_max_expr(self) -> str:
        # The fullest GPU of the pod: headroom is decided by the fullest, not the average.
        return (f"max {self._pod_by()} (\n"
                f"  {self.m('mrc_gpu_memory_used_bytes')}\n"
                f"  / {self.m('mrc_gpu_memory_total_bytes')}\n"
                f")")

    @property
    def pod_nvlink_rate(self) -> str:
        return f"mrc_pod:gpu_nvlink_bytes:sum_rate{self._t.rate_window}"

    def pod_nvlink_rate_expr(self) -> str:
        # TX + RX over all GPUs of the pod, from the all-links counters (the per-link series
        # never need to leave the cluster's Prometheus).
        w = self._t.rate_window
        return (f"sum {self._pod_by()} (rate({self.m('mrc_gpu_nvlink_tx_bytes_total')}[{w}]))\n"
                f"+\n"
                f"sum {self._pod_by()} (rate({self.m('mrc_gpu_nvlink_rx_bytes_total')}[{w}]))")

    @property
    def pod_pcie_sum(self) -> str:
        return "mrc_pod:gpu_pcie_bytes_per_second:sum"

    def pod_pcie_sum_expr(self) -> str:
        return (f"{self._per_pod('sum', 'mrc_gpu_pcie_tx_bytes_per_second')}\n"
                f"+\n"
                f"{self._per_pod('sum', 'mrc_gpu_pcie_rx_bytes_per_second')}")

    @property
    def pod_starved_rate(self) -> str:
        return f"mrc_pod:gpu_starved_seconds:max_rate{self._t.request_rate_window}"

    def pod_starved_rate_expr(self) -> str:
        # Share of the window the pod's most starved target spent starved, from the counter:
        # exact whatever the scrape interval, unlike averaging the 0/1 gauge.
        w = self._t.request_rate_window
        return (f"max {self._pod_by()} "
                f"(rate({self.m('mrc_gpu_starved_seconds_total')}[{w}]))")

    def _check_model_labels(self) -> None:
        overlap = set(self.cfg.model_labels) & set(self.cfg.pod_keys)
        if not self.cfg.model_labels or overlap:
            raise ValueError(f"model_labels {self.cfg.model_labels} must be labels of "
                             f"mrc_model_info other than the pod labels {self.cfg.pod_keys}")

    def model_join(self) -> str:
        """``* on (cluster, namespace, pod) group_left (model_id) <the pod's model>``: puts the
        model labels of the pod's service on any series of that pod (the agent's too).

        ``topk by (pod) (1, …)`` keeps one live description per pod, so a pod that ever shows
        two at 1 cannot make the join many-to-many — that would fail the whole rule, for every
        model of the fleet, at every evaluation."""
        self._check_model_labels()
        pod = _labels(self.cfg.pod_keys)
        return (f"* on ({pod}) group_left ({_labels(self.cfg.model_labels)})\n"
                f"  topk by ({pod}) (1, {self.m('mrc_model_info')} == 1)")

    def _per_model(self, op: str, inner: str, *keep: str) -> str:
        # Per cluster and model: a global view sums the clusters' series (or keeps them apart).
        by = _labels((*self._cluster, *self.cfg.model_labels, *keep))
        return f"{op} by ({by}) (\n  {inner}\n  {self.model_join()}\n)"

    @property
    def model_pods(self) -> str:
        return "mrc_model:model_info:count"

    def model_pods_expr(self) -> str:
        """Pods serving each model."""
        self._check_model_labels()
        pod = _labels(self.cfg.pod_keys)
        return (f"count by ({_labels((*self._cluster, *self.cfg.model_labels))}) (\n"
                f"  topk by ({pod}) (1, {self.m('mrc_model_info')} == 1)\n"
                f")")

    @property
    def model_requests_rate(self) -> str:
        return f"mrc_model:requests:rate{self._t.request_rate_window}"

    def model_requests_rate_expr(self) -> str:
        w = self._t.request_rate_window
        return self._per_model("sum", f"rate({self.m('mrc_requests_total')}[{w}])", "outcome")

    @property
    def model_latency_buckets(self) -> str:
        return f"mrc_model:request_duration_seconds_bucket:rate{self._t.request_rate_window}"

    def model_latency_buckets_expr(self) -> str:
        # Per-bucket rates per model and prompt-length x resolution cell: any quantile or
        # heatmap of a model is then a query over (buckets x 9 cells) series, not x pods.
        w = self._t.request_rate_window
        return self._per_model("sum", f"rate({self.m('mrc_request_duration_seconds_bucket')}"
                               f"[{w}])", "prompt_length", "resolution", "le")

    @property
    def model_latency_p99(self) -> str:
        return f"mrc_model:request_duration_seconds:p99_rate{self._t.request_rate_window}"

    def model_latency_p99_expr(self) -> str:
        # From the bucket rates recorded just before it in the same group and evaluation.
        return f"histogram_quantile(0.99, {self.model_latency_buckets})"

    @property
    def model_ttft_errors(self) -> str:
        return (f"mrc_model:time_to_first_token_slo_errors:"
                f"ratio_rate{self._t.request_rate_window}")

    def model_ttft_errors_expr(self) -> str:
        """Share of a model's first tokens later than the SLO bound, fleet-wide."""
        w = self._t.request_rate_window
        good = self.m("mrc_time_to_first_token_seconds_bucket", f'le="{le(self._t.ttft_seconds)}"')
        total = self.m("mrc_time_to_first_token_seconds_count")
        ratio = (f"{self._per_model('sum', f'rate({good}[{w}])')}\n"
                 f"/\n"
                 f"{self._per_model('sum', f'rate({total}[{w}])')}")
        return "1 - (\n" + "\n".join(f"  {line}" for line in ratio.splitlines()) + "\n)"

    @property
    def model_ttft_count(self) -> str:
        return f"mrc_model:time_to_first_token_seconds_count:rate{self._t.request_rate_window}"

    def model_ttft_count_expr(self) -> str:
        # The ratio's denominator on its own: a global view (several clusters, several
        # Prometheus servers) weights each cluster's ratio by it — ratios do not add up.
        w = self._t.request_rate_window
        total = self.m("mrc_time_to_first_token_seconds_count")
        return self._per_model("sum", f"rate({total}[{w}])")

    @property
    def model_gpu_util_avg(self) -> str:
        return "mrc_model:gpu_utilization_ratio:avg"

    def model_gpu_util_avg_expr(self) -> str:
        # The agent's GPU series take the model of the service in the same pod.
        return self._per_model("avg", self.m("mrc_gpu_utilization_ratio"))

    # --- agent health ------------------------------------------------------------------------

    def agent_down_expr(self, alertname: str) -> str:
        # `up` alone cannot tell an agent from any other target, so ask whether the target
        # exposed mrc_agent_build_info recently. A failed scrape stale-marks that series, and
        # max_over_time forgets it after the window: the alert's own firing ALERTS series keeps
        # it alive until the target is back up (or leaves service discovery).
        return (f"{self.m('up')} == 0\n"
                f"and on (job, instance) (\n"
                f"  max_over_time({self.m('mrc_agent_build_info')}"
                f"[{self._t.agent_seen_window}])\n"
                f"  or ALERTS{{alertname=\"{alertname}\", alertstate=\"firing\"}}\n"
                f")")

    def collector_down_expr(self) -> str:
        return (f"{self.m('mrc_agent_collector_success')} == 0\n"
                f"and {self.m('mrc_agent_collector_available')} == 1")

    def pcie_dropped_expr(self) -> str:
        """PCIe byte-count intervals dropped per GPU and reason over the window, above the line.
        TX and RX are read in one call, so one late read drops both: ``max`` counts events."""
        w = self._t.pcie_dropped_window
        dropped = self.m("mrc_gpu_pcie_dropped_intervals_total")
        return (f"max without (direction) (increase({dropped}[{w}]))\n"
                f"> {num(self._t.pcie_dropped_intervals)}")

    def targets_absent_expr(self) -> str:
        return f"{self.m('mrc_agent_targets')} == 0"

    def sampling_stale_expr(self) -> str:
        """Seconds since the served snapshot was taken, above a few of the agent's own
        intervals (and a floor for scrape and evaluation lag)."""
        return (f"time() - {self.m('mrc_agent_last_sample_timestamp_seconds')}\n"
                f"> clamp_min({num(self._t.stale_intervals)} * "
                f"{self.m('mrc_agent_interval_seconds')}, {num(self._t.stale_min_seconds)})")


def duration_seconds(value: str) -> float:
    """Seconds in a Prometheus duration (``1h30m`` → 5400)."""
    return parse_duration(check_duration(value))
