"""The numbers the design and the README promise, written here as literals.

Other tests derive their expectations from ``alerts/config.py``, the bucket module or the error
table, so a changed threshold passes them after a rebuild. These do not: each number below is a
requirement (user CPU above 95 % for 30 s, NVLink under 50 GB/s for 60 s, fewer than 8 SM
instructions per DRAM byte, a first token within 500 ms, the nine prompt-length x resolution
cells, the service's statuses, the agent's defaults), and changing one is a deliberate act that
must change this file too. Boundaries are pinned with their operator (``>`` vs ``>=``), on both
sides where a function decides them.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests.conftest import REPO

RULES = REPO / "alerts" / "generated" / "mrc-rules.yaml"


def _shipped() -> dict[str, dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: {**r, "expr": " ".join(r["expr"].split())}
            for g in doc["groups"] for r in g["rules"] if "alert" in r}


#: alert -> (for, severity, the comparison that decides it, as written in the shipped rules).
ALERTS: dict[str, tuple[str, str, str]] = {
    "MRCProcessCPUUserSaturated": ("30s", "critical", "mrc:process_cpu_user_ratio:max > 0.95"),
    "MRCNVLinkBandwidthLow": ("60s", "critical", "mrc:gpu_nvlink_bytes:rate1m < 50e9"),
    "MRCGPUMemoryBound": ("15m", "warning",
                          "mrc:gpu_sm_instructions_per_dram_byte:ratio_rate1m < 8"),
    "MRCGPUMemoryBoundGPMProxy": ("15m", "warning",
                                  "mrc:gpu_gpm_sm_to_dram_activity:avg_over_time1m < 1.2"),
    "MRCGPUStarved": ("2m", "critical", "mrc:gpu_starved:max_avg_over_time2m >= 0.8"),
    "MRCTimeToFirstTokenSLOFastBurn": ("2m", "critical", "mrc_service:time_to_first_token_slo_"
                                       "errors:ratio_rate1h > (14.4 * 0.01)"),
    "MRCTimeToFirstTokenSLOSlowBurn": ("1h", "warning", "mrc_service:time_to_first_token_slo_"
                                       "errors:ratio_rate3d > (1 * 0.01)"),
    "MRCRequestLatencyP99High": ("10m", "warning",
                                 "mrc_service:request_duration_seconds:p99_rate5m > 10"),
    "MRCRequestErrorRateHigh": ("5m", "critical",
                                "mrc_service:requests_errors:ratio_rate5m > 0.05"),
    "MRCChainBreakRateHigh": ("15m", "warning",
                              "mrc_service:chain_breaks_per_request:ratio_rate5m > 0.2"),
    "MRCAgentDown": ("5m", "warning", "up == 0"),
    "MRCAgentCollectorDown": ("5m", "warning", "mrc_agent_collector_success == 0"),
    "MRCAgentSamplingStale": ("1m", "critical", "time() - mrc_agent_last_sample_timestamp_seconds "
                              "> clamp_min(5 * mrc_agent_interval_seconds, 60)"),
    "MRCAgentTargetAbsent": ("5m", "warning", "mrc_agent_targets == 0"),
    "MRCAgentPCIeBytesUnderCounted": ("10m", "warning", "max without (direction) (increase("
                                      "mrc_gpu_pcie_dropped_intervals_total[10m])) > 5"),
}


def test_the_shipped_alerts_are_the_promised_ones() -> None:
    shipped = _shipped()
    assert sorted(shipped) == sorted(ALERTS)
    for name, (for_, severity, clause) in ALERTS.items():
        rule = shipped[name]
        assert rule["for"] == for_, name
        assert rule["labels"] == {"severity": severity}, name
        assert clause in str(rule["expr"]), (name, rule["expr"])


def test_the_nvlink_and_memory_alerts_only_judge_a_busy_gpu() -> None:
    shipped = _shipped()
    for name in ("MRCNVLinkBandwidthLow", "MRCGPUMemoryBound", "MRCGPUMemoryBoundGPMProxy"):
        assert "mrc:gpu_utilization_ratio:avg_over_time1m > 0.5" in str(shipped[name]["expr"])


def test_the_ttft_slo_reads_the_500_ms_bucket_with_a_99_percent_objective() -> None:
    from mrc_agent.exporters.instrumentation.buckets import (
        TIME_TO_FIRST_TOKEN_BUCKETS,
        TTFT_SLA_SECONDS,
    )

    assert TTFT_SLA_SECONDS == 0.5 and 0.5 in TIME_TO_FIRST_TOKEN_BUCKETS
    text = RULES.read_text()
    assert text.count('mrc_time_to_first_token_seconds_bucket{le="0.5"}') >= 7
    burn = {float(f) for f in re.findall(r"\(([\d.]+) \* 0\.01\)", text)}
    assert burn == {14.4, 6.0, 3.0, 1.0}  # 1 - 0.99 = 0.01 of budget, the SRE workbook's rates


# -- the nine cells -----------------------------------------------------------------------------

def test_the_nine_prompt_length_by_resolution_cells() -> None:
    from mrc_agent.exporters.instrumentation.buckets import prompt_length_values, resolution_values

    assert prompt_length_values() == ("0-50", "50-100", "100+")
    assert resolution_values() == ("<1MP", "1-4MP", ">4MP")


@pytest.mark.parametrize(("chars", "bucket"), [
    (0, "0-50"), (49, "0-50"), (50, "50-100"), (99, "50-100"), (100, "100+"), (5000, "100+")])
def test_prompt_length_edges_belong_to_the_bucket_above(chars: int, bucket: str) -> None:
    from mrc_agent.exporters.instrumentation.buckets import prompt_length_bucket

    assert prompt_length_bucket(chars) == bucket


@pytest.mark.parametrize(("w", "h", "bucket"), [
    (999, 1000, "<1MP"), (1000, 1000, "1-4MP"), (1999, 2000, "1-4MP"), (2000, 2000, ">4MP"),
    (4000, 3000, ">4MP"), (1, 1, "<1MP")])
def test_resolution_edges_belong_to_the_bucket_above(w: int, h: int, bucket: str) -> None:
    from mrc_agent.exporters.instrumentation.buckets import resolution_bucket

    assert resolution_bucket(w, h) == bucket


# -- the service's statuses (README: "Every bad input gets a JSON error with the right status") --

STATUSES = {
    "bad_request": 400, "bad_base64": 400, "invalid_utf8": 400, "image_empty": 400,
    "url_not_allowed": 400, "image_too_large": 413, "decompression_bomb": 413,
    "fetch_too_large": 413, "prompt_too_long": 413, "not_an_image": 415,
    "image_truncated": 422, "image_corrupt": 422, "invalid_request": 422, "overloaded": 429,
    "invalid_value": 400, "unsupported": 400, "model_not_found": 404, "client_closed": 499,
    "fetch_failed": 502, "decode_unavailable": 503, "model_not_ready": 503,
    "decode_timeout": 504, "fetch_timeout": 504,
}


def test_every_error_code_has_its_promised_status() -> None:
    from mrc_agent.reference_service.errors import STATUS_BY_CODE

    assert STATUS_BY_CODE == STATUSES


def test_the_readme_error_list_says_the_same_statuses() -> None:
    readme = (REPO / "README.md").read_text()
    for phrase in ("non-images 415", "truncated or corrupt images 422",
                   "decompression bombs and oversized images\n  413",
                   "malformed base64 or invalid UTF-8 400", "schema errors 422",
                   "a hung decode 504", "a stalled request body 408",
                   "overload 429 with `Retry-After`", "model not ready 503"):
        assert phrase in readme, phrase


def test_the_service_limits_are_the_documented_ones() -> None:
    from mrc_agent.reference_service.settings import Settings

    s = Settings()
    assert (s.max_image_bytes, s.max_image_pixels) == (20 * 1024 * 1024, 50_000_000)
    assert (s.max_prompt_chars, s.max_new_tokens_limit) == (2000, 256)
    assert (s.decode_timeout_s, s.header_timeout_s) == (10.0, 1.0)
    assert (s.http_header_timeout_s, s.http_body_timeout_s, s.keep_alive_timeout_s,
            s.max_connections) == (10.0, 30.0, 5.0, 1024)


# -- the agent's defaults (README's `mrc-agent run` table) --------------------------------------

def test_the_agent_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from mrc_agent.agent.cli import build_parser
    from mrc_agent.agent.core.config import ENV_PREFIX, config_from_args
    from mrc_agent.agent.core.runner import STALE_INTERVALS

    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    cfg = config_from_args(build_parser().parse_args(["run", "--pid", "1"]))
    assert cfg.host_port == ("0.0.0.0", 9478)
    assert cfg.interval == 1.0
    assert (cfg.idle_util_threshold, cfg.starvation_cpu_threshold,
            cfg.starvation_gpu_threshold) == (0.05, 0.9, 0.2)
    assert {k for k, on in cfg.collectors.items() if on} == {"process", "gpu", "gpm", "derived",
                                                             "stacks"}
    assert STALE_INTERVALS == 2.0  # /readyz: 503 when no pass completed within two intervals


@pytest.mark.parametrize(("value", "ok"), [("0.05", True), ("0.049", False), ("60", True),
                                            ("60.1", False)])
def test_the_interval_range_is_0_05_to_60_seconds(value: str, ok: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from mrc_agent.agent.cli import build_parser
    from mrc_agent.agent.core.config import ENV_PREFIX, ConfigError, config_from_args

    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["run", "--pid", "1", "--interval", value])
    if ok:
        assert config_from_args(args).interval == float(value)
    else:
        with pytest.raises(ConfigError, match="interval"):
            config_from_args(args)
