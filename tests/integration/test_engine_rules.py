"""The engine recording rules (alerts/engines.py): the names they read are the engines' own
(docs/engines.md's table, the fixtures' TYPE lines), and the promtool test on the engines'
expositions (alerts/tests/engines.yaml, run with the other promtool files by
tests/e2e/test_alerts.py) fails when a rule loses what makes it work across versions: the deprecated
fallback, the aggregation of one server's parts, the zero of a cold cache. promtool is required:
a missing binary fails, it never skips."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mrc_agent.alerts import build, rules
from mrc_agent.alerts.config import DEFAULT
from mrc_agent.alerts.engine_tests import EXPECTED, FIXTURES, engine_tests, fixtures, series
from mrc_agent.alerts.engines import (
    CURRENT,
    DEPRECATED,
    NONE,
    PARTS,
    SIGNALS,
    SOURCES,
    EngineQueries,
    markdown_table,
)
from tests.conftest import REPO

#: A raw engine metric in a rule: vLLM's and SGLang's ``engine:name``, TGI's ``tgi_name``.
_RAW = re.compile(r"\b((?:vllm|sglang):[a-z_]+|tgi_[a-z_]+)\b")
_HISTOGRAM_PARTS = re.compile(r"_(bucket|sum|count)$")


def _read_by_rules(cfg: Any = DEFAULT) -> set[str]:
    """Every engine family the engine rules read (histograms by their base name)."""
    exprs = [r["expr"] for r in rules.engines(cfg)["rules"]]
    return {_HISTOGRAM_PARTS.sub("", m) for e in exprs for m in _RAW.findall(e)}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's prometheus package (.ci/run does)")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                          check=False)


# --- the names ------------------------------------------------------------------------------


def test_the_rules_read_every_listed_name_but_the_unread_duplicate() -> None:
    listed = {s.name for s in SOURCES if s.name}
    assert _read_by_rules() == listed - {"vllm:time_in_queue_requests"}
    # The one deprecated name read is a fallback, not a second source of the same series.
    read_deprecated = {s.name for s in SOURCES if s.status == DEPRECATED} & _read_by_rules()
    assert read_deprecated == {"vllm:gpu_cache_usage_perc"}


def test_an_engine_without_a_metric_says_so_and_gets_no_rule() -> None:
    none = [(s.engine, s.signal) for s in SOURCES if s.status == NONE]
    assert none == [("tgi", "time to first token"), ("tgi", "multimodal-cache hits")]
    q = EngineQueries(DEFAULT)
    ttft = "\n".join(q.histogram_expr("time to first token", part)
                     for part in ("bucket", "sum", "count"))
    assert "tgi" not in ttft and '"vllm"' in ttft and '"sglang"' in ttft
    assert "tgi" not in q.mm_hits_expr() + q.mm_queries_expr()


def test_the_docs_table_is_the_source_table() -> None:
    doc = (REPO / "docs" / "engines.md").read_text()
    assert markdown_table() in doc, "docs/engines.md's table differs from alerts/engines.py"
    for s in SOURCES:
        assert s.status in (CURRENT, DEPRECATED, NONE) and s.signal in SIGNALS
        assert s.repository in ("vllm-project/vllm", "sgl-project/sglang",
                                "huggingface/text-generation-inference")
        assert s.paths and all("/" in p for p in s.paths)


def _families() -> dict[str, dict[str, str]]:
    """Fixture stem -> family -> TYPE, as prometheus-client's parser reads the file."""
    out = {}
    for path in fixtures():
        out[path.stem] = {f.name: f.type for f in text_string_to_metric_families(
            path.read_text())}
    return out


def test_the_fixtures_declare_every_name_with_the_sources_type() -> None:
    """Every name a rule reads is in some exposition, typed as the engine's source types it,
    and the deprecated fallback appears both alone (vLLM V0) and beside the current name."""
    families = _families()
    assert set(families) == {"vllm-v1", "vllm-0.10", "vllm-v0", "sglang", "sglang-2024",
                             "sglang-encoder", "sglang-encoder-cold", "vllm-text", "tgi"}
    for s in SOURCES:
        if s.name is None:
            continue
        family = s.name.removesuffix("_total")
        have = {stem: fams[family] for stem, fams in families.items() if family in fams}
        assert have, f"{s.name} is in no fixture"
        assert set(have.values()) == {s.kind}, (s.name, have)
    with_old = {stem for stem, f in families.items() if "vllm:gpu_cache_usage_perc" in f}
    with_new = {stem for stem, f in families.items() if "vllm:kv_cache_usage_perc" in f}
    assert with_old - with_new == {"vllm-v0"} and with_old & with_new == {"vllm-0.10"}
    # The cold encoder has looked up files but has no hit series (the family is declared, as
    # prometheus-client writes a labelled family without children): SGLang creates the series
    # at the first hit.
    cold = text_string_to_metric_families((FIXTURES / "sglang-encoder-cold.prom").read_text())
    samples = {f.name: len(f.samples) for f in cold}
    assert samples == {"sglang:encoder_cache_hit_files": 0, "sglang:encoder_cache_total_files": 1}
    assert "tgi_request_queue_duration" in families["tgi"]
    assert not any("first_token" in f for f in families["tgi"])


def test_expositions_become_ten_minutes_of_steady_traffic() -> None:
    got = series(FIXTURES / "vllm-v1.prom")
    labels = ('{job="engines",namespace="mrc",pod="vllm-v1",instance="vllm-v1:8000",'
              'engine="1",model_name="llava-hf/llava-1.5-7b-hf"}')
    assert got["vllm:kv_cache_usage_perc" + labels] == "0.75x10"         # a gauge holds
    assert got["vllm:time_to_first_token_seconds_count" + labels] == "0+60x10"  # 600 climbs
    assert got["vllm:mm_cache_queries_total" + labels] == "0+30x10"
    assert got["vllm:mm_cache_queries_created" + labels] == "1700000000x10"


def test_every_engine_rule_has_an_expectation() -> None:
    recorded = [r["record"] for r in rules.engines(DEFAULT)["rules"]]
    assert sorted(EXPECTED) == sorted(recorded)
    for record in recorded:
        level, metric, ops = record.split(":")
        assert level == "mrc" and metric.startswith("engine_") and ops


def test_the_selector_reaches_every_engine_selector() -> None:
    cfg = build.config_for(selector='namespace="mrc"')
    exprs = [r["expr"] for r in rules.engines(cfg)["rules"]]
    seen = 0
    for expr in exprs:
        for m in _RAW.finditer(expr):
            assert expr[m.end():].startswith('{namespace="mrc"}'), (expr, m[0])
            seen += 1
    assert seen >= 25


def test_one_servers_parts_are_aggregated_and_nothing_else() -> None:
    q = EngineQueries(DEFAULT)
    exprs = "\n".join(e for _, e in q.recording_rules())
    for labels in PARTS.values():
        if labels:
            assert f"without ({', '.join(labels)}" in exprs
    assert " by (" not in exprs, "a `by` would drop the target labels"


# --- the promtool test fails without what makes the rules work -----------------------------


def _mutated(tmp_path: Path, record: str, old: str, new: str) -> Path:
    groups = rules.groups(DEFAULT)
    rule = next(r for g in groups for r in g["rules"] if r.get("record") == record)
    assert old in rule["expr"], (old, rule["expr"])
    rule["expr"] = rule["expr"].replace(old, new)
    path = tmp_path / "rules.yaml"
    path.write_text(build.dump({"groups": groups}))
    return path


def _run_engine_test(tmp_path: Path, rule_file: Path) -> str:
    test = tmp_path / "engines.yaml"
    test.write_text(build.dump(engine_tests(rule_file)))
    res = _promtool("test", "rules", str(test))
    assert res.returncode != 0, "the engine test passed on a broken rule"
    return res.stdout + res.stderr


def test_the_committed_rules_pass(tmp_path: Path) -> None:
    test = tmp_path / "engines.yaml"
    test.write_text(build.dump(engine_tests(REPO / "alerts" / "generated" / build.RULES_FILE)))
    res = _promtool("test", "rules", str(test))
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_without_the_deprecated_name_the_v0_engine_has_no_kv_series(tmp_path: Path) -> None:
    rule = _mutated(tmp_path, "mrc:engine_kv_cache_usage_ratio:max",
                    "\n  or\n  max without (engine) (vllm:gpu_cache_usage_perc)", "")
    out = _run_engine_test(tmp_path, rule)
    kv = out.split('expr: "mrc:engine_kv_cache_usage_ratio:max"')[1].split("expr:")[0]
    exp, got = kv.split("got:")
    assert 'pod="vllm-v0"' in exp and 'pod="vllm-v0"' not in got
    assert 'pod="vllm-0.10"' in got  # the version with both names still has its series


def test_without_the_current_name_first_0_10_would_still_give_one_series(
        tmp_path: Path) -> None:
    """Reading both names with `or` in either order gives one series per server; reading them
    summed (or without `or`) would not: the rule breaks on vLLM 0.10's pair."""
    rule = _mutated(tmp_path, "mrc:engine_kv_cache_usage_ratio:max",
                    "\n  or\n  max without (engine) (vllm:gpu_cache_usage_perc)",
                    "\n  +\n  max without (engine) (vllm:gpu_cache_usage_perc)")
    out = _run_engine_test(tmp_path, rule)
    assert 'pod="vllm-0.10"} 1E+00' in out  # 0.5 + 0.5: the pair counted twice


def test_without_summing_the_engine_cores_a_series_per_core(tmp_path: Path) -> None:
    rule = _mutated(tmp_path, "mrc:engine_time_to_first_token_seconds_count:rate5m",
                    "sum without (engine) (rate(vllm:time_to_first_token_seconds_count",
                    "sum without (model_name) (rate(vllm:time_to_first_token_seconds_count")
    out = _run_engine_test(tmp_path, rule)
    assert "mrc:engine_time_to_first_token_seconds_count:rate5m" in out


def test_an_engine_that_looked_nothing_up_has_no_hit_ratio_not_nan(tmp_path: Path) -> None:
    """No traffic at all: 0 hits over 0 lookups is no ratio (absent), never NaN, which would
    sit on a dashboard as a value and fail every comparison an alert makes on it."""
    rule = _mutated(tmp_path, "mrc:engine_mm_cache_hits:ratio_rate5m", " > 0)", ")")
    out = _run_engine_test(tmp_path, rule)
    ratio = out.split('expr: "mrc:engine_mm_cache_hits:ratio_rate5m"')[1].split("expr:")[0]
    exp, got = ratio.split("got:")
    assert 'pod="vllm-text"' not in exp and 'pod="vllm-text"' in got and "NaN" in got


def test_a_cold_encoder_cache_reads_zero_not_nothing(tmp_path: Path) -> None:
    rule = _mutated(tmp_path, "mrc:engine_mm_cache_hits:rate5m",
                    "\n  or\n  0 * sum without (tp_rank, pp_rank, dp_rank, moe_ep_rank, modality) "
                    "(rate(sglang:encoder_cache_total_files_total[5m]))", "")
    out = _run_engine_test(tmp_path, rule)
    hits = out.split('expr: "mrc:engine_mm_cache_hits:rate5m"')[1].split("expr:")[0]
    exp, got = hits.split("got:")
    assert 'pod="sglang-encoder-cold"' in exp and 'pod="sglang-encoder-cold"' not in got
