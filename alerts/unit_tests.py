"""promtool unit tests of the alerting and the recording rules, kept as readable files.

``python -m mrc_agent.alerts.unit_tests`` writes, from the scenarios below,
``alerts/tests/<Alert>.yaml`` (one per alert), ``alerts/tests/fleet.yaml`` (the fleet recording
rules) and ``alerts/tests/engines.yaml`` (the engine recording rules, on the engines' own
expositions: :mod:`mrc_agent.alerts.engine_tests`). They are committed; ``tests/e2e/test_alerts.py``
fails when they drift from a fresh generation and runs ``promtool test rules`` on them. Run them
by hand with ``promtool test rules alerts/tests/*.yaml`` (from the repository root) or ``promtool
test rules *.yaml`` (in ``alerts/tests``): promtool resolves ``rule_files`` relative to each test
file, so every file names ``../generated/mrc-rules.yaml``, the committed build.

Every alert has scenarios in promtool's ``input_series`` notation: one where it fires — with
its ``for`` boundary, not firing one evaluation before ``for`` has passed and firing at it — and
one where it must stay silent. The expected annotations are rendered from the rule's own
templates by a small renderer of the template subset the rules use; promtool compares them with
what Prometheus' template engine made, so a wrong value or a broken template fails.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrc_agent.alerts import build, rules
from mrc_agent.alerts.config import DEFAULT, Config
from mrc_agent.alerts.engine_tests import ENGINES_FILE, engine_tests

#: Where the committed test files live, and the rule file they test, relative to them.
OUT = Path(__file__).resolve().parent / "tests"
RULE_FILE = f"../generated/{build.RULES_FILE}"
FLEET_FILE = "fleet.yaml"
COMMAND = "python -m mrc_agent.alerts.unit_tests"


# --- expected annotations ----------------------------------------------------------------------


def _go_g(value: float) -> str:
    """Go's %.4g, which Python's %-format matches for finite values."""
    return f"{value:.4g}"


def humanize(value: float) -> str:
    """Prometheus' ``humanize`` template function."""
    if value == 0 or math.isnan(value) or math.isinf(value):
        return _go_g(value)
    prefix = ""
    if abs(value) >= 1:
        for p in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(value) < 1000:
                break
            prefix, value = p, value / 1000
    else:
        for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
            if abs(value) >= 1:
                break
            prefix, value = p, value * 1000
    return _go_g(value) + prefix


#: A sentence that runs a query for the alert's process and instance (rules.top_function_template).
_WITH_QUERY = re.compile(r'\{\{ with printf "(?:[^"\\]|\\.)*" \$labels\.process '
                         r'\$labels\.instance \| query \}\}(.*?)\{\{ end \}\}', re.S)


def render(template: str, labels: dict[str, str], value: float, top: str | None = None) -> str:
    """The subset of Prometheus' alert templates the rules use; anything else fails. ``top`` is
    what a query sentence finds (None: nothing, and the sentence is left out)."""
    template = _WITH_QUERY.sub(
        lambda m: "" if top is None else m[1].replace('{{ . | first | label "function" }}', top),
        template)

    def one(m: re.Match[str]) -> str:
        expr = m[1].strip()
        if expr.startswith("$labels."):
            return labels.get(expr[len("$labels."):], "")
        if expr == "$value | humanize":
            return humanize(value)
        if expr == "$value | humanizePercentage":
            return _go_g(value * 100) + "%"
        fmt = re.fullmatch(r'printf "%\.(\d)f" \$value', expr)
        if fmt:
            return f"{value:.{int(fmt[1])}f}"
        raise AssertionError(f"template {expr!r}: teach render() before using it in a rule")

    return re.sub(r"\{\{(.*?)\}\}", one, template)


# --- scenarios ---------------------------------------------------------------------------------


def s(metric: str, labels: dict[str, str], **more: str) -> str:
    """A series in promtool's notation."""
    all_labels = {**labels, **more}
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in all_labels.items()) + "}"


@dataclass
class Fire:
    labels: dict[str, str]
    value: float
    top: str | None = None  # what the annotation's query finds, if it has one


@dataclass
class At:
    time: str
    firing: list[Fire]
    alert: str | None = None  # another alert checked in the same scenario


@dataclass
class Scenario:
    name: str
    interval: str
    series: dict[str, str]
    checks: list[At]


@dataclass
class AlertTest:
    eval_interval: str
    scenarios: list[Scenario] = field(default_factory=list)


AGENT = {"job": "mrc-agent", "instance": "pod-a.mrc:9478", "namespace": "mrc", "pod": "mrc-0"}
PROC = {**AGENT, "process": "python3"}
SVC = {"job": "mrc", "namespace": "mrc"}
PODS = [{**SVC, "instance": "pod-b.mrc:8000", "pod": "mrc-0"},
        {**SVC, "instance": "pod-c.mrc:8000", "pod": "mrc-1"}]


def gpu(n: int) -> dict[str, str]:
    return {**AGENT, "gpu": str(n), "uuid": f"GPU-{n}", "gpu_model": "NVIDIA H200"}


def nvlink(labels: dict[str, str], per_step: str, util: str) -> dict[str, str]:
    out = {s("mrc_gpu_utilization_ratio", labels): util}
    if per_step:
        out[s("mrc_gpu_nvlink_tx_bytes_total", labels)] = per_step
        out[s("mrc_gpu_nvlink_rx_bytes_total", labels)] = per_step
    return out


def profiling(labels: dict[str, str], instr: str, dram: str) -> dict[str, str]:
    return {s("mrc_gpu_sm_instructions_executed_total", labels): instr,
            s("mrc_gpu_dram_read_bytes_total", labels): dram}


def ttft(good: str, count: str, pods: list[dict[str, str]] = PODS) -> dict[str, str]:
    """TTFT histogram of one bucket on every pod: good = observations <= 0.5 s."""
    out = {}
    for pod in pods:
        b = {**pod, "prompt_length": "0-50", "resolution": "<1MP"}
        out[s("mrc_time_to_first_token_seconds_bucket", b, le="0.5")] = good
        out[s("mrc_time_to_first_token_seconds_count", b)] = count
    return out


def latency(bucket: dict[str, str], le5: str, le10: str, le15: str) -> dict[str, str]:
    out = {}
    for pod in PODS:
        b = {**pod, **bucket}
        for le, values in (("5.0", le5), ("10.0", le10), ("15.0", le15), ("+Inf", le15)):
            out[s("mrc_request_duration_seconds_bucket", b, le=le)] = values
    return out


def requests(**per_outcome: str) -> dict[str, str]:
    return {s("mrc_requests_total", pod, outcome=o): v
            for pod in PODS for o, v in per_outcome.items()}


SLOW = {"prompt_length": "100+", "resolution": ">4MP"}
FAST = {"prompt_length": "0-50", "resolution": "<1MP"}
BUILD_INFO = {"version": "0.1.0", "python": "3.11.7"}

CASES: dict[str, AlertTest] = {
    "MRCProcessCPUUserSaturated": AlertTest("5s", [
        Scenario("a worker holds a core; the hottest PID of the process name decides", "5s", {
            s("mrc_process_cpu_user_ratio", PROC, pid="4242"): "0.5 0.5 0.99x30",
            s("mrc_process_cpu_user_ratio", PROC, pid="4243"): "0.3x32",
        }, [At("35s", []), At("40s", [Fire(PROC, 0.99)]), At("2m", [Fire(PROC, 0.99)])]),
        Scenario("just under the line; hot in bursts shorter than for", "5s", {
            s("mrc_process_cpu_user_ratio", PROC, pid="1"): "0.94x40",
            s("mrc_process_cpu_user_ratio", {**AGENT, "process": "ocr"}, pid="2"):
                "0.99x5 0.5 0.99x5 0.5 0.99x5 0.5x20",
        }, [At("25s", []), At("60s", []), At("95s", []), At("3m", [])]),
    ]),
    "MRCNVLinkBandwidthLow": AlertTest("10s", [
        Scenario("busy GPU at 20 GB/s, counted once the rate window is full", "10s",
                 nvlink(gpu(0), "0+1e11x30", "0.9x30"),
                 [At("1m50s", []), At("2m", [Fire(gpu(0), 2e10)]),
                  At("4m", [Fire(gpu(0), 2e10)])]),
        Scenario("60 GB/s busy; 20 GB/s idle; no NVLink at all", "10s", {
            **nvlink(gpu(1), "0+3e11x30", "0.9x30"),
            **nvlink(gpu(2), "0+1e11x30", "0.1x30"),
            **nvlink(gpu(3), "", "0.9x30"),
        }, [At("2m", []), At("4m", [])]),
    ]),
    "MRCGPUMemoryBound": AlertTest("15s", [
        Scenario("4 instructions per byte, busy; the GPM proxy stays out of it", "15s", {
            **profiling(gpu(0), "0+6e12x100", "0+1.5e12x100"),
            s("mrc_gpu_utilization_ratio", gpu(0)): "0.9x100",
            s("mrc_gpu_gpm_sm_to_dram_activity", gpu(0)): "0.8x100",
        }, [At("15m", []), At("15m15s", [Fire(gpu(0), 4.0)]),
            At("20m", [Fire(gpu(0), 4.0)]),
            At("20m", [], alert="MRCGPUMemoryBoundGPMProxy")]),
        Scenario("compute-bound; memory-bound but idle; memory-bound for 10m only", "15s", {
            **profiling(gpu(1), "0+3e13x100", "0+1.5e12x100"),
            s("mrc_gpu_utilization_ratio", gpu(1)): "0.9x100",
            **profiling(gpu(2), "0+6e12x100", "0+1.5e12x100"),
            s("mrc_gpu_utilization_ratio", gpu(2)): "0.1x100",
            **profiling(gpu(3), "0+6e12x40 2.4e14+3e13x60", "0+1.5e12x100"),
            s("mrc_gpu_utilization_ratio", gpu(3)): "0.9x100",
        }, [At("16m", []), At("20m", []), At("24m", [])]),
    ]),
    "MRCGPUMemoryBoundGPMProxy": AlertTest("15s", [
        Scenario("GPM only: SM activity 80 % of DRAM utilisation, busy", "15s", {
            s("mrc_gpu_gpm_sm_to_dram_activity", gpu(0)): "0.8x100",
            s("mrc_gpu_utilization_ratio", gpu(0)): "0.9x100",
        }, [At("14m45s", []), At("15m", [Fire(gpu(0), 0.8)]),
            At("20m", [Fire(gpu(0), 0.8)])]),
        Scenario("true counters present (never mix); proxy high; idle", "15s", {
            s("mrc_gpu_gpm_sm_to_dram_activity", gpu(1)): "0.8x100",
            s("mrc_gpu_utilization_ratio", gpu(1)): "0.9x100",
            **profiling(gpu(1), "0+3e13x100", "0+1.5e12x100"),
            s("mrc_gpu_gpm_sm_to_dram_activity", gpu(2)): "2x100",
            s("mrc_gpu_utilization_ratio", gpu(2)): "0.9x100",
            s("mrc_gpu_gpm_sm_to_dram_activity", gpu(3)): "0.8x100",
            s("mrc_gpu_utilization_ratio", gpu(3)): "0.1x100",
        }, [At("16m", []), At("24m", []), At("24m", [], alert="MRCGPUMemoryBound")]),
        Scenario("SM counter without a DRAM read counter (a set lacking one): proxy pages",
                 "15s", {
            s("mrc_gpu_gpm_sm_to_dram_activity", gpu(4)): "0.8x100",
            s("mrc_gpu_utilization_ratio", gpu(4)): "0.9x100",
            s("mrc_gpu_sm_instructions_executed_total", gpu(4)): "0+6e12x100",
        }, [At("15m", [Fire(gpu(4), 0.8)]), At("20m", [], alert="MRCGPUMemoryBound")]),
    ]),
    "MRCGPUStarved": AlertTest("10s", [
        Scenario("starved from 60 s on; 80 % of the window reached at 160 s", "10s", {
            s("mrc_gpu_starved", PROC, pid="4242"): "0x5 1x40",
            s("mrc_gpu_starved", PROC, pid="4243"): "0x45",
        }, [At("4m30s", []), At("4m40s", [Fire(PROC, 1.0)]), At("6m", [Fire(PROC, 1.0)])]),
        Scenario("starved 60 % of the time", "10s", {
            s("mrc_gpu_starved", PROC, pid="4242"): " ".join(["1 1 1 0 0"] * 12),
        }, [At("3m", []), At("5m", []), At("9m", [])]),
        Scenario("the annotation names what ran most while starved", "10s", {
            s("mrc_gpu_starved", PROC, pid="4242"): "0x5 1x40",
            s("mrc_process_function_seconds_total", PROC, pid="4242",
              function="preprocess:resize_image", gpu_state="starved"): "0x5 0+8x40",
            s("mrc_process_function_seconds_total", PROC, pid="4242",
              function="model:forward", gpu_state="busy"): "0+10x45",
            s("mrc_process_function_seconds_total", PROC, pid="4242",
              function="<idle>", gpu_state="starved"): "0x5 0+2x40",
        }, [At("4m40s", [Fire(PROC, 1.0, top="preprocess:resize_image")])]),
    ]),
    "MRCTimeToFirstTokenSLOFastBurn": AlertTest("1m", [
        Scenario("20 % slow first tokens on both pods: 14.4x over 1h and 5m", "1m",
                 ttft("0+80x20", "0+100x20"),
                 [At("2m", []), At("3m", [Fire(SVC, 0.2)]), At("10m", [Fire(SVC, 0.2)])]),
        Scenario("10 %: under 14.4x, over 6x for 6h and 30m", "1m",
                 ttft("0+90x20", "0+100x20"),
                 [At("2m", []), At("3m", [Fire(SVC, 0.1)])]),
        Scenario("5 minutes of 100 % after two good hours: a burst, not a page", "1m",
                 ttft("0+99.5x120 11940+0x4 12039.5+99.5x35", "0+100x161"),
                 [At("125m", []), At("127m", []), At("130m", []), At("140m", [])]),
        Scenario("5 % for 6 hours: slow burn, no page", "1m",
                 ttft("0+95x400", "0+100x400"), [At("30m", []), At("6h", [])]),
    ]),
    "MRCTimeToFirstTokenSLOSlowBurn": AlertTest("5m", [
        Scenario("5 %: 3x over 1d and 2h", "5m", ttft("0+475x300", "0+500x300", PODS[:1]),
                 [At("1h", []), At("1h5m", [Fire(SVC, 0.05)]), At("1d", [Fire(SVC, 0.05)]),
                  At("1d", [], alert="MRCTimeToFirstTokenSLOFastBurn")]),
        Scenario("2 %: under 3x, over 1x for 3d and 6h", "5m",
                 ttft("0+490x300", "0+500x300", PODS[:1]),
                 [At("1h", []), At("1h5m", [Fire(SVC, 0.02)])]),
        Scenario("0.8 % for 3 days; a 12 h incident at 2 % that ended 5 h ago", "5m", {
            **ttft("0+496x900", "0+500x900", PODS[:1]),
            **ttft("0+490x144 71057.5+497.5x755", "0+500x900", [{**PODS[0], "job": "b"}]),
        }, [At("17h", []), At("1d", []), At("3d", [])]),
    ]),
    "MRCRequestLatencyP99High": AlertTest("1m", [
        Scenario("P99 13.75 s for >4MP x 100+ on both pods; small requests fast", "1m", {
            **latency(SLOW, "0+90x30", "0+96x30", "0+100x30"),
            **latency(FAST, "0+100x30", "0+100x30", "0+100x30"),
        }, [At("10m", []), At("11m", [Fire({**SVC, **SLOW}, 13.75)]),
            At("20m", [Fire({**SVC, **SLOW}, 13.75)])]),
        Scenario("P99 9.5 s; slow for 4 minutes only; a bucket without traffic", "1m", {
            **latency(SLOW, "0+90x30", "0+100x30", "0+100x30"),
            **latency(FAST, "0+90x4 460+100x25", "0+96x4 484+100x25", "0+100x30"),
            **latency({"prompt_length": "50-100", "resolution": "1-4MP"}, "0x30", "0x30",
                      "0x30"),
        }, [At("11m", []), At("20m", [])]),
    ]),
    "MRCRequestErrorRateHigh": AlertTest("1m", [
        Scenario("6 % errors and 4 % timeouts", "1m",
                 requests(ok="0+90x20", error="0+6x20", timeout="0+4x20",
                          client_error="0x20", overloaded="0x20"),
                 [At("5m", []), At("6m", [Fire(SVC, 0.1)]), At("15m", [Fire(SVC, 0.1)])]),
        Scenario("2 % errors; client errors and 429s are not the service failing", "1m",
                 requests(ok="0+50x20", error="0+1x20", timeout="0+1x20",
                          client_error="0+40x20", overloaded="0+8x20"),
                 [At("6m", []), At("15m", [])]),
    ]),
    "MRCChainBreakRateHigh": AlertTest("1m", [
        Scenario("OCR breaks on 30 % of requests, fetch on 5 %", "1m", {
            **requests(ok="0+100x30", error="0x30"),
            **{s("mrc_chain_breaks_total", pod, step="ocr"): "0+30x30" for pod in PODS},
            **{s("mrc_chain_breaks_total", pod, step="fetch"): "0+5x30" for pod in PODS},
        }, [At("15m", []), At("16m", [Fire({**SVC, "step": "ocr"}, 0.3)])]),
        Scenario("OCR breaks on 10 %", "1m", {
            **requests(ok="0+100x30"),
            **{s("mrc_chain_breaks_total", pod, step="ocr"): "0+10x30" for pod in PODS},
        }, [At("16m", []), At("25m", [])]),
    ]),
    "MRCAgentDown": AlertTest("1m", [
        Scenario("an agent stops answering; stays firing past the look-back window", "1m", {
            s("up", AGENT): "1x10 0x200",
            s("mrc_agent_build_info", AGENT, **BUILD_INFO): "1x10 stale",
            s("up", {**AGENT, "job": "node", "instance": "pod-a.mrc:9100"}): "0x200",
        }, [At("15m", []), At("16m", [Fire(AGENT, 0)]), At("3h", [Fire(AGENT, 0)])]),
        Scenario("down for 20 minutes, then back", "1m", {
            s("up", AGENT): "1x10 0x19 1x20",
            s("mrc_agent_build_info", AGENT, **BUILD_INFO): "1x10 stale _x18 1x20",
        }, [At("15m", []), At("16m", [Fire(AGENT, 0)]), At("31m", [])]),
        Scenario("an agent down for 4 minutes; a non-agent target down", "1m", {
            s("up", AGENT): "1x10 0x3 1x20",
            s("mrc_agent_build_info", AGENT, **BUILD_INFO): "1x10 stale _x2 1x20",
            s("up", {**AGENT, "job": "node", "instance": "pod-a.mrc:9100"}): "0x40",
        }, [At("14m", []), At("30m", [])]),
    ]),
    "MRCAgentCollectorDown": AlertTest("1m", [
        Scenario("the gpu collector starts failing at 6 minutes", "1m", {
            s("mrc_agent_collector_success", AGENT, collector="gpu"): "1x5 0x30",
            s("mrc_agent_collector_available", AGENT, collector="gpu"): "1x36",
        }, [At("10m", []), At("11m", [Fire({**AGENT, "collector": "gpu"}, 0)])]),
        Scenario("profiling unavailable (not failing); process healthy", "1m", {
            s("mrc_agent_collector_success", AGENT, collector="profiling"): "0x30",
            s("mrc_agent_collector_available", AGENT, collector="profiling"): "0x30",
            s("mrc_agent_collector_success", AGENT, collector="process"): "1x30",
            s("mrc_agent_collector_available", AGENT, collector="process"): "1x30",
        }, [At("11m", []), At("25m", [])]),
    ]),
    "MRCAgentSamplingStale": AlertTest("1m", [
        # The snapshot's timestamp is Unix time (promtool's clock starts at 0): moving with
        # the clock is fresh; frozen at 300 from 5 minutes on is a wedged agent.
        Scenario("the snapshot stops moving at 5 minutes (1 s sampling)", "1m", {
            s("mrc_agent_last_sample_timestamp_seconds", AGENT): "0+60x5 300x30",
            s("mrc_agent_interval_seconds", AGENT): "1x36",
        }, [At("7m", []), At("8m", [Fire(AGENT, 180)])]),
        Scenario("fresh, 45 s behind (scrape and evaluation lag) at 1 s sampling", "1m", {
            s("mrc_agent_last_sample_timestamp_seconds", AGENT): "-45+60x30",
            s("mrc_agent_interval_seconds", AGENT): "1x30",
        }, [At("10m", []), At("25m", [])]),
        Scenario("100 s old at 30 s sampling: under five intervals", "1m", {
            s("mrc_agent_last_sample_timestamp_seconds", AGENT): "-100+60x30",
            s("mrc_agent_interval_seconds", AGENT): "30x30",
        }, [At("10m", []), At("25m", [])]),
    ]),
    "MRCAgentPCIeBytesUnderCounted": AlertTest("1m", [
        Scenario("a throttled reader drops an interval a minute from 5 minutes on", "1m", {
            **{s("mrc_gpu_pcie_dropped_intervals_total", gpu(0), direction=d, reason="gap"):
               "0x5 1+1x30" for d in ("tx", "rx")},
            **{s("mrc_gpu_pcie_dropped_intervals_total", gpu(0), direction=d,
                 reason="impossible"): "0x36" for d in ("tx", "rx")},
        }, [At("20m", []), At("21m", [Fire({**gpu(0), "reason": "gap"}, 10)]),
            At("30m", [Fire({**gpu(0), "reason": "gap"}, 10)])]),
        Scenario("a drop every 5 minutes; a one-off burst of 20 that stops", "1m", {
            s("mrc_gpu_pcie_dropped_intervals_total", gpu(1), direction="tx", reason="gap"):
                "0x4 1x5 2x5 3x5 4x5 5x5 6x5",
            s("mrc_gpu_pcie_dropped_intervals_total", gpu(2), direction="rx",
              reason="impossible"): "0x4 20x30",
        }, [At("14m", []), At("15m", []), At("25m", [])]),
    ]),
    "MRCAgentTargetAbsent": AlertTest("1m", [
        Scenario("the target process goes away at 6 minutes", "1m", {
            s("mrc_agent_targets", AGENT): "1x5 0x30",
        }, [At("10m", []), At("11m", [Fire(AGENT, 0)])]),
        Scenario("two targets; none for 4 minutes during a restart", "1m", {
            s("mrc_agent_targets", AGENT): "2x10 0x3 2x20",
            s("mrc_agent_targets", {**AGENT, "pod": "mrc-1"}): "0x3 1x30",
        }, [At("11m", []), At("14m", []), At("30m", [])]),
    ]),
}




# --- promtool files ---------------------------------------------------------------------------


def alert_rule(name: str, cfg: Config = DEFAULT) -> dict[str, Any]:
    return next(a for a in rules.alerts(cfg) if a["alert"] == name)


def _expected(rule: dict[str, Any], fire: Fire) -> dict[str, Any]:
    return {
        "exp_labels": {**fire.labels, **rule["labels"]},
        "exp_annotations": {k: render(v, fire.labels, fire.value, fire.top)
                            for k, v in rule["annotations"].items()},
    }


def promtool_tests(alert: str, test: AlertTest, rule_file: Path | str = RULE_FILE,
                   cfg: Config = DEFAULT) -> dict[str, Any]:
    """One promtool unit-test file: every scenario of one alert, against ``rule_file``
    (relative to the test file's directory, or absolute)."""
    groups = []
    for sc in test.scenarios:
        checks = []
        for at in sc.checks:
            name = at.alert or alert
            rule = alert_rule(name, cfg)
            checks.append({"eval_time": at.time, "alertname": name,
                           "exp_alerts": [_expected(rule, f) for f in at.firing]})
        groups.append({
            "name": f"{alert}: {sc.name}",
            "interval": sc.interval,
            "input_series": [{"series": k, "values": v} for k, v in sc.series.items()],
            "alert_rule_test": checks,
        })
    return {"rule_files": [str(rule_file)], "evaluation_interval": test.eval_interval,
            "tests": groups}



# --- fleet recording rules ---------------------------------------------------------------------
# Three pods: mrc-0 and mrc-1 serve model "a", mrc-2 model "b". mrc-0 has two target PIDs, two
# GPUs and a replaced model description (at 0); every rule must give one series per pod or per
# model whatever is behind it. Rates are whole numbers per second (60 per 1m step = 1/s).

def _svc(pod: str) -> dict[str, str]:
    return {"job": "mrc", "namespace": "mrc", "pod": pod, "instance": f"{pod}:8000",
            "container": "service"}


def _agent(pod: str) -> dict[str, str]:
    return {"job": "mrc-agent", "namespace": "mrc", "pod": pod, "instance": f"{pod}:9478",
            "container": "mrc-agent"}


def _gpu_of(pod: str, n: int) -> dict[str, str]:
    return {**_agent(pod), "gpu": str(n), "uuid": f"GPU-{pod}-{n}", "gpu_model": "NVIDIA H200"}


def _info(pod: str, model: str) -> dict[str, str]:
    return {**_svc(pod), "model_id": model, "revision": "main", "dtype": "bfloat16",
            "quantization": "none", "device": "cuda:0", "attention_backend": "flash"}


def _per_s(rate: float, steps: int = 20) -> str:
    return f"0+{rate * 60:g}x{steps}"


FLEET_SERIES: dict[str, str] = {
    # agent, mrc-0: two PIDs, two GPUs
    s("mrc_process_cpu_user_ratio", _agent("mrc-0"), process="python3", pid="7"): "0.4x20",
    s("mrc_process_cpu_user_ratio", _agent("mrc-0"), process="python3", pid="9"): "0.99x20",
    s("mrc_process_hottest_thread_cpu_user_ratio", _agent("mrc-0"), process="python3",
      pid="7"): "0.4x20",
    s("mrc_process_hottest_thread_cpu_user_ratio", _agent("mrc-0"), process="python3",
      pid="9"): "0.98x20",
    s("mrc_gpu_starved_seconds_total", _agent("mrc-0"), process="python3", pid="7"): "0x20",
    s("mrc_gpu_starved_seconds_total", _agent("mrc-0"), process="python3", pid="9"):
        _per_s(0.5),
    **{s(m, _gpu_of("mrc-0", n)): v for n, util, used in ((0, "0.25", 40), (1, "0.75", 60))
       for m, v in (("mrc_gpu_utilization_ratio", f"{util}x20"),
                    ("mrc_gpu_memory_used_bytes", f"{used}e9x20"),
                    ("mrc_gpu_memory_total_bytes", "80e9x20"),
                    ("mrc_gpu_nvlink_tx_bytes_total", _per_s(1e8)),
                    ("mrc_gpu_nvlink_rx_bytes_total", _per_s(5e7)),
                    ("mrc_gpu_pcie_tx_bytes_per_second", "1e9x20"),
                    ("mrc_gpu_pcie_rx_bytes_per_second", "2e9x20"))},
    # agents of mrc-1 and mrc-2: one GPU each
    s("mrc_gpu_utilization_ratio", _gpu_of("mrc-1", 0)): "0.5x20",
    s("mrc_gpu_utilization_ratio", _gpu_of("mrc-2", 0)): "0.1x20",
    # services
    s("mrc_model_info", _info("mrc-0", "a")): "1x20",
    s("mrc_model_info", _info("mrc-0", "old")): "0x20",
    s("mrc_model_info", _info("mrc-1", "a")): "1x20",
    s("mrc_model_info", _info("mrc-2", "b")): "1x20",
    s("mrc_requests_total", _svc("mrc-0"), outcome="ok"): _per_s(4),
    s("mrc_requests_total", _svc("mrc-0"), outcome="error"): _per_s(1),
    s("mrc_requests_total", _svc("mrc-1"), outcome="ok"): _per_s(5),
    s("mrc_requests_total", _svc("mrc-2"), outcome="ok"): _per_s(2),
    **{s("mrc_request_duration_seconds_bucket", _svc(pod), **FAST, le=le): _per_s(r)
       for pod, per_le in (("mrc-0", (("1.0", 0), ("10.0", 1), ("+Inf", 1))),
                           ("mrc-1", (("1.0", 0), ("10.0", 3), ("+Inf", 3))))
       for le, r in per_le},
    **{s(f"mrc_time_to_first_token_seconds_{m}", _svc(pod), **FAST, **le): _per_s(r)
       for pod, good, count in (("mrc-0", 1, 2), ("mrc-1", 2, 2))
       for m, le, r in (("bucket", {"le": "0.5"}, good), ("count", {}, count))},
}

POD0 = {"namespace": "mrc", "pod": "mrc-0"}
FLEET_EXPECTED: dict[str, list[tuple[dict[str, str], float]]] = {
    "mrc_pod:process_cpu_user_ratio:max": [(POD0, 0.99)],
    "mrc_pod:process_hottest_thread_cpu_user_ratio:max": [(POD0, 0.98)],
    "mrc_pod:gpu_utilization_ratio:avg": [(POD0, 0.5), ({**POD0, "pod": "mrc-1"}, 0.5),
                                          ({**POD0, "pod": "mrc-2"}, 0.1)],
    "mrc_pod:gpu_memory_used_ratio:max": [(POD0, 0.75)],
    "mrc_pod:gpu_nvlink_bytes:sum_rate1m": [(POD0, 3e8)],
    "mrc_pod:gpu_pcie_bytes_per_second:sum": [(POD0, 6e9)],
    "mrc_pod:gpu_starved_seconds:max_rate5m": [(POD0, 0.5)],
    "mrc_model:model_info:count": [({"model_id": "a"}, 2), ({"model_id": "b"}, 1)],
    "mrc_model:requests:rate5m": [({"model_id": "a", "outcome": "ok"}, 9),
                                  ({"model_id": "a", "outcome": "error"}, 1),
                                  ({"model_id": "b", "outcome": "ok"}, 2)],
    "mrc_model:request_duration_seconds_bucket:rate5m": [
        ({"model_id": "a", **FAST, "le": le}, r) for le, r in (("1.0", 0), ("10.0", 4),
                                                               ("+Inf", 4))],
    # all 4/s between 1 and 10 s: 1 + 9 * 0.99
    "mrc_model:request_duration_seconds:p99_rate5m": [({"model_id": "a", **FAST}, 9.91)],
    # first tokens within 0.5 s: (1 + 2) of (2 + 2) per second
    "mrc_model:time_to_first_token_slo_errors:ratio_rate5m": [({"model_id": "a"}, 0.25)],
    "mrc_model:time_to_first_token_seconds_count:rate5m": [({"model_id": "a"}, 4)],
    "mrc_model:gpu_utilization_ratio:avg": [({"model_id": "a"}, 0.5), ({"model_id": "b"}, 0.1)],
}


def _sample(name: str, labels: dict[str, str], value: float) -> dict[str, Any]:
    return {"labels": s(name, labels), "value": value}


#: A pod that shows two descriptions at 1 must not make the join many-to-many (which would fail
#: the rule for the whole fleet): its requests count once, under one model.
TWO_MODELS_SERIES: dict[str, str] = {
    s("mrc_model_info", _info("mrc-0", "a")): "1x20",
    s("mrc_model_info", _info("mrc-0", "a2")): "1x20",
    s("mrc_model_info", _info("mrc-1", "b")): "1x20",
    s("mrc_requests_total", _svc("mrc-0"), outcome="ok"): _per_s(4),
    s("mrc_requests_total", _svc("mrc-1"), outcome="ok"): _per_s(2),
}
TWO_MODELS_EXPECTED: list[tuple[str, list[dict[str, Any]]]] = [
    ("sum(mrc_model:requests:rate5m)", [{"labels": "{}", "value": 6}]),
    ('mrc_model:requests:rate5m{model_id="b"}',
     [_sample("mrc_model:requests:rate5m", {"model_id": "b", "outcome": "ok"}, 2)]),
    ("sum(mrc_model:model_info:count)", [{"labels": "{}", "value": 2}]),
]


def fleet_tests(rule_file: Path | str = RULE_FILE) -> dict[str, Any]:
    """The fleet recording rules' test file: every rule on one data set (the values, and
    exactly one series per pod or model), and the two-descriptions case."""
    def group(name: str, series: dict[str, str],
              checks: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
        return {
            "name": name,
            "interval": "1m",
            "input_series": [{"series": k, "values": v} for k, v in series.items()],
            "promql_expr_test": [{"expr": expr, "eval_time": "10m", "exp_samples": samples}
                                 for expr, samples in checks],
        }

    every_rule = [(name, [_sample(name, labels, value) for labels, value in want])
                  for name, want in FLEET_EXPECTED.items()]
    return {"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": [
        group("fleet: per pod and per model", FLEET_SERIES, every_rule),
        group("fleet: two live descriptions on one pod", TWO_MODELS_SERIES,
              TWO_MODELS_EXPECTED),
    ]}


# --- the files ---------------------------------------------------------------------------------


def file_names() -> list[str]:
    """The files a generation writes, sorted."""
    return sorted([*(f"{alert}.yaml" for alert in CASES), FLEET_FILE, ENGINES_FILE])


def _header(what: str) -> str:
    return (f"# promtool unit tests: {what}.\n"
            f"# Generated by `{COMMAND}` from alerts/unit_tests.py; do not edit, regenerate.\n"
            "# Run: promtool test rules alerts/tests/*.yaml (rule_files is relative to this "
            "file).\n")


def render_files(cfg: Config = DEFAULT) -> dict[str, str]:
    """File name → contents, for every file a generation writes."""
    files = {f"{alert}.yaml": _header(alert)
             + build.dump(promtool_tests(alert, CASES[alert], RULE_FILE, cfg))
             for alert in CASES}
    files[FLEET_FILE] = _header("fleet recording rules") + build.dump(fleet_tests(RULE_FILE))
    files[ENGINES_FILE] = (_header("engine recording rules, on alerts/tests/engines/*.prom")
                           + build.dump(engine_tests(RULE_FILE)))
    assert sorted(files) == file_names()
    return dict(sorted(files.items()))


def write(out: Path = OUT) -> list[Path]:
    """Write every file into ``out``; remove YAML files there that a generation no longer
    writes (an alert that was dropped). Returns the paths written."""
    files = render_files()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.yaml"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def drift(out: Path = OUT) -> list[str]:
    """The files in ``out`` that differ from a fresh generation, are missing or are extra."""
    files = render_files()
    have = {p.name for p in out.glob("*.yaml")}
    wrong = [name for name, text in files.items()
             if name not in have or (out / name).read_text(encoding="utf-8") != text]
    return sorted(wrong + sorted(have - set(files)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Write the promtool unit-test files of the alert rules.")
    parser.add_argument("--out", type=Path, default=OUT, help=f"directory (default {OUT})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the files in --out drifted")
    args = parser.parse_args(argv)
    if args.check:
        wrong = drift(args.out)
        for name in wrong:
            print(f"{args.out / name}: differs from a fresh generation", file=sys.stderr)
        return 1 if wrong else 0
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
