"""PromQL for the MRC rules, built from one :class:`~alerts.config.Config`.

Every raw metric selector goes through ``Config.sel()`` so a deployment can pin the rules to its
own jobs or namespaces; by default there is no matcher at all and the rules work whatever the
scrape job is called. Nothing here matches on ``job``: joins use the labels the series share
(all of them, for series of one agent) or the GPU's identity labels.

Recording-rule names follow ``level:metric:operations``:

* ``mrc:`` — one target as Prometheus scraped it (``job``, ``instance``, ``namespace``, ``pod``,
  …), per GPU for GPU series and per process name for process series (``pid`` aggregated away,
  so a restarted worker keeps its alert state).
* ``mrc_service:`` — one service: the replica labels (``Config.replica_labels``) summed away.

The window is part of the name (``rate1m``), so a build with other windows makes other names
instead of silently changing what a name means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from alerts.config import Config, Thresholds

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def check_duration(value: str) -> str:
    """Return ``value`` if it is a Prometheus duration (``90s``, ``1h30m``), else raise."""
    if not _DURATION.match(value):
        raise ValueError(f"{value!r} is not a Prometheus duration (e.g. 30s, 5m, 1h)")
    return value


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
class Queries:
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
        """Either profiling counter, for ``unless on(gpu, uuid)``: never mix the two sources."""
        return (f"{self.m('mrc_gpu_sm_instructions_executed_total')}\n"
                f"  or {self.m('mrc_gpu_dram_read_bytes_total')}")

    @property
    def starved_avg(self) -> str:
        return f"mrc:gpu_starved:max_avg_over_time{self._t.starved_window}"

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

    def targets_absent_expr(self) -> str:
        return f"{self.m('mrc_agent_targets')} == 0"


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(value: str) -> float:
    """Seconds in a Prometheus duration (``1h30m`` → 5400)."""
    check_duration(value)
    return sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", value))
