"""The *MRC service* dashboard's engine row: the engines' TTFT beside the meter's, on real data.

The row's queries, taken from the built dashboard JSON (Grafana's macros and variables
substituted as Grafana would), run in promtool against the committed rules, the engines'
expositions (alerts/tests/engines/*.prom, as alerts/tests/engines.yaml reads them) and the
meter's own ``mrc_time_to_first_token_seconds`` for three of those pods. Quantiles are
checked to 1e-9 (``abs(q - want) < bool 1e-9`` is 1), the rest exactly."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mrc_agent.alerts import build
from mrc_agent.alerts.config import DEFAULT
from mrc_agent.alerts.engine_tests import MINUTES, fixtures, series
from mrc_agent.dashboards.build import build_all
from mrc_agent.dashboards.queries import substitute_macros
from tests.conftest import REPO

ROW = "Engine view beside the client's"
COMPARE = "Time to first token: client and engine P50/P99"
GAP = "Time to first token outside the engine (mean)"
QUEUE = "Engine queue time P50/P99"
KV = "Engine KV-cache usage"
MM = "Engine multimodal-cache hit ratio"


def _row() -> list[dict[str, Any]]:
    """The panels under the engine row of the service dashboard, in order."""
    panels = build_all()["mrc-service.json"]["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == ROW)
    end = next((i for i, p in enumerate(panels) if i > start and p["type"] == "row"),
               len(panels))
    return panels[start + 1:end]


def _panel(title: str) -> dict[str, Any]:
    (panel,) = [p for p in _row() if p["title"] == title]
    return panel


def _exprs(title: str, pod: str = ".*") -> list[str]:
    return [substitute_macros(t["expr"], vars={"pod": pod}) for t in _panel(title)["targets"]]


def test_the_row_sits_under_latency_with_its_units_and_the_sla_line() -> None:
    titles = [p["title"] for p in build_all()["mrc-service.json"]["panels"] if p["type"] == "row"]
    assert titles[:2] == ["Latency and time to first token", ROW]
    assert [p["title"] for p in _row()] == [COMPARE, GAP, QUEUE, KV, MM]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in _row()}
    assert units == {COMPARE: "s", GAP: "s", QUEUE: "s", KV: "percentunit", MM: "percentunit"}
    steps = _panel(COMPARE)["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps[1:]] == [DEFAULT.thresholds.ttft_seconds]
    legends = [t["legendFormat"] for t in _panel(COMPARE)["targets"]]
    assert legends == ["{{pod}} client P50", "{{pod}} client P99", "{{pod}} {{engine}} P50",
                       "{{pod}} {{engine}} P99"]
    # The client side is read over the engine rules' window, so both cover the same requests.
    window = DEFAULT.thresholds.request_rate_window
    assert all(f"[{window}]" in e for e in _exprs(COMPARE)[:2])
    assert all(f":rate{window}" in e for e in _exprs(COMPARE)[2:])


# --- on data -------------------------------------------------------------------------------------

def _client(pod: str, le_counts: dict[str, int], total_seconds: float) -> dict[str, str]:
    """The meter's TTFT histogram on ``pod`` after ten minutes (its own target in that pod)."""
    labels = (f'job="meter",namespace="mrc",pod="{pod}",instance="{pod}:9479",'
              f'prompt_length="0-50",resolution="<1MP"')
    per_minute = {f'mrc_time_to_first_token_seconds_bucket{{{labels},le="{le}"}}': n / MINUTES
                  for le, n in le_counts.items()}
    per_minute[f"mrc_time_to_first_token_seconds_count{{{labels}}}"] = \
        le_counts["+Inf"] / MINUTES
    per_minute[f"mrc_time_to_first_token_seconds_sum{{{labels}}}"] = total_seconds / MINUTES
    return {k: f"0+{v:g}x{MINUTES}" for k, v in per_minute.items()}


#: vllm-v1's clients: 600 first tokens, half within 0.5 s, mean 0.5 s; sglang's: mean 1 s;
#: tgi's: mean 0.25 s (TGI has no TTFT of its own to compare with). (Exact in binary, and exact
#: through promtool 2.42's rate(), which is not for every such number: 52.5 a minute is not.)
CLIENTS = {
    **_client("vllm-v1", {"0.25": 0, "0.5": 300, "1.0": 600, "+Inf": 600}, 300),
    **_client("sglang", {"0.25": 0, "0.5": 0, "1.0": 600, "+Inf": 600}, 600),
    **_client("tgi", {"0.25": 600, "0.5": 600, "1.0": 600, "+Inf": 600}, 150),
}


def _close(expr: str, want: float) -> str:
    return f"abs(({expr}) - {want!r}) < bool 1e-9"


def _samples(*rows: tuple[dict[str, str], float]) -> list[dict[str, Any]]:
    return [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
             "value": value} for labels, value in rows]


def _at(pod: str, engine: str | None = None) -> dict[str, str]:
    return {**({"engine": engine} if engine else {}), "namespace": "mrc", "pod": pod}


def test_the_row_on_the_engines_expositions_and_the_meters_histogram(tmp_path: Path) -> None:
    client_p50, client_p99, engine_p50, engine_p99 = _exprs(COMPARE, pod="vllm-v1")
    queue_p50, _ = _exprs(QUEUE, pod="vllm-v1")
    (gap,), (kv,), (mm,) = _exprs(GAP), _exprs(KV), _exprs(MM)
    checks = [
        # The means: 0.5 - (0.328125 / 2) on vllm-v1, 1 - 0.375 on sglang; nothing on tgi.
        (gap, _samples((_at("vllm-v1", "vllm"), 0.3359375), (_at("sglang", "sglang"), 0.625))),
        # Client: rank 0.5 of 1/s lands at the 0.5 s bound. Engine (vllm-v1, both cores): rank 1
        # of 2/s in (0.1, 0.25] holding 1.5/s above 0.25/s: 0.1 + 0.15 * 0.75 / 1.5.
        (_close(client_p50, 0.5), _samples((_at("vllm-v1"), 1))),
        (_close(client_p99, 0.99), _samples((_at("vllm-v1"), 1))),
        (_close(engine_p50, 0.175), _samples((_at("vllm-v1", "vllm"), 1))),
        (_close(engine_p99, 0.48), _samples((_at("vllm-v1", "vllm"), 1))),
        # Queue: rank 1 of 2/s in (0, 0.3] holding 1.5/s: 0.3 * 1 / 1.5.
        (_close(queue_p50, 0.2), _samples((_at("vllm-v1", "vllm"), 1))),
        (kv, _samples((_at("vllm-v1", "vllm"), 0.75), (_at("vllm-0.10", "vllm"), 0.5),
                      (_at("vllm-v0", "vllm"), 0.375), (_at("sglang", "sglang"), 0.875),
                      (_at("sglang-2024", "sglang"), 0.25), (_at("tgi", "tgi"), 0.25))),
        (mm, _samples((_at("vllm-v1", "vllm"), 0.75), (_at("sglang-encoder", "sglang"), 0.1875),
                      (_at("sglang-encoder-cold", "sglang"), 0.0))),
    ]
    inputs = dict(CLIENTS)
    for path in fixtures():
        inputs.update(series(path))
    test = {
        "rule_files": [str(REPO / "alerts" / "generated" / build.RULES_FILE)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": k, "values": v} for k, v in inputs.items()],
            "promql_expr_test": [{"expr": e, "eval_time": f"{MINUTES}m", "exp_samples": s}
                                 for e, s in checks],
        }],
    }
    path = tmp_path / "row.yaml"
    path.write_text(build.dump(test))
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's prometheus package (.ci/run does)")
    res = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
