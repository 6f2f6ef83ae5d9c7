"""Dashboards as code: Grafana's JSON schema, units, thresholds from the alert config, runbook
links, the heatmap's fixed order and the committed files equal to a fresh build. Every query
parsed by a real Prometheus: tests/e2e/test_dashboards_in_prometheus.py."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mrc_agent.agent.cli import main as cli_main
from mrc_agent.alerts.config import DEFAULT, Config
from mrc_agent.alerts.rules import alerts as alert_rules
from mrc_agent.dashboards.build import (
    CONFIGMAP_FILE,
    PROVISIONING_FILE,
    all_queries,
    build_all,
    render_all,
    template_queries,
)
from mrc_agent.dashboards.heatmap import CORNER_FIELD, CORNER_TITLE
from mrc_agent.dashboards.heatmap import build as build_heatmap
from mrc_agent.dashboards.panels import Alerts
from mrc_agent.dashboards.queries import (
    PROMPT_LENGTH_ORDER,
    RESOLUTION_ORDER,
    RESOLUTION_RANK_LABEL,
    PanelQueries,
    substitute_macros,
)
from mrc_agent.dashboards.validate import SCHEMA_DIR, validate
from tests.conftest import REPO

GENERATED = REPO / "dashboards" / "generated"
SHARED_SCHEMA = REPO.parent / "shared" / "grafana-schema"

#: Known false positives of the vendored Grafana schema: (path regex, message regex). Each is
#: explained in docs/dashboards.md ("Schema false positives"); no other error is tolerated.
ALLOWED_SCHEMA_ERRORS: tuple[tuple[str, str], ...] = (
    # The base threshold step is -Infinity, which JSON writes as null; the schema types the
    # value as a number (its own description: "Nulls currently appear here when serializing
    # -Infinity to JSON").
    (r"/panels/\d+/fieldConfig/defaults/thresholds/steps/0/value",
     r"None is not of type 'number'"),
    # MatcherConfig.options is typed "object", but Grafana's byName/byRegexp/byType field
    # matchers take a string option (the TypeScript type is `any`).
    (r"/panels/\d+/fieldConfig/overrides/\d+/matcher/options",
     r"'[^']*' is not of type 'object'"),
)

DASHBOARDS = build_all()
T = DEFAULT.thresholds


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def visible_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in panels(dashboard) if p["type"] != "row"]


def panel(title: str) -> dict[str, Any]:
    found = [p for d in DASHBOARDS.values() for p in panels(d) if p.get("title") == title]
    assert len(found) == 1, f"{len(found)} panels titled {title!r}"
    return found[0]


def threshold_values(p: dict[str, Any]) -> list[float]:
    steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["value"] is None, "the base step must be -Infinity (null)"
    return [s["value"] for s in steps[1:]]


# -- schema ----------------------------------------------------------------------------------

def _allowed(path: str, message: str) -> bool:
    return any(re.fullmatch(p, path) and re.fullmatch(m, message)
               for p, m in ALLOWED_SCHEMA_ERRORS)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_validates_against_grafana_schema(name: str) -> None:
    errors = validate(DASHBOARDS[name])
    unexpected = [e for e in errors if not _allowed(e.path, e.message)]
    assert not unexpected, "\n".join(f"{e.path}: {e.message}" for e in unexpected)


def test_every_allowed_schema_error_still_occurs() -> None:
    """An allow-list entry that no longer matches anything is stale: remove it."""
    errors = [e for d in DASHBOARDS.values() for e in validate(d)]
    for path_re, message_re in ALLOWED_SCHEMA_ERRORS:
        assert any(re.fullmatch(path_re, e.path) and re.fullmatch(message_re, e.message)
                   for e in errors), f"allow-list entry {path_re!r} matches nothing"


def test_validation_catches_real_mistakes() -> None:
    """The validator is not vacuous: a misspelt option, a bad unit type and a bad query fail."""
    broken = json.loads(json.dumps(DASHBOARDS["mrc-service.json"]))
    p = next(p for p in broken["panels"] if p["type"] == "timeseries")
    p["options"]["legend"]["placement"] = "middle"
    p["fieldConfig"]["defaults"]["unit"] = 7
    p["targets"][0]["fromat"] = "table"
    broken["refersh"] = "1m"
    paths = {e.path for e in validate(broken)}
    i = broken["panels"].index(p)
    assert {f"/panels/{i}/options/legend/placement", f"/panels/{i}/fieldConfig/defaults/unit",
            f"/panels/{i}/targets/0", ""} <= paths


def test_vendored_schema_is_a_verbatim_copy_with_its_license() -> None:
    assert (SCHEMA_DIR / "LICENSE").is_file()
    if not SHARED_SCHEMA.is_dir():
        pytest.skip(f"{SHARED_SCHEMA} is not here to compare with")
    for src in SHARED_SCHEMA.iterdir():
        assert (SCHEMA_DIR / src.name).read_bytes() == src.read_bytes(), src.name


# -- panels ----------------------------------------------------------------------------------

def test_every_panel_has_a_unit_a_description_a_datasource_and_queries() -> None:
    for dashboard in DASHBOARDS.values():
        for p in visible_panels(dashboard):
            where = f"{dashboard['title']} / {p['title']}"
            assert p["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
            assert p.get("description"), f"{where}: no description"
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert p["targets"], f"{where}: no query"
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"], where


def test_template_variables() -> None:
    for dashboard in DASHBOARDS.values():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for name in ("namespace", "pod"):
            assert variables[name]["query"].startswith("label_values(")
            assert variables[name]["allValue"] == ".*"
    golden = DASHBOARDS["mrc-golden-triangle.json"]
    gpu = next(v for v in golden["templating"]["list"] if v["name"] == "gpu")
    assert gpu["query"] == ('label_values(mrc_gpu_utilization_ratio'
                            '{cluster=~"$cluster",namespace=~"$namespace",pod=~"$pod"}, gpu)')


def test_every_query_and_variable_after_cluster_filters_on_it() -> None:
    """kube-prometheus-stack's `cluster` variable: first in every dashboard, in every query."""
    for dashboard in DASHBOARDS.values():
        names = [v["name"] for v in dashboard["templating"]["list"]]
        assert names[:3] == ["datasource", "cluster", "namespace"], dashboard["title"]
    for title, panel, expr in all_queries():
        assert 'cluster=~"$cluster"' in expr, (title, panel)
    for title, var, query in template_queries():
        if var != "cluster":
            assert 'cluster=~"$cluster"' in query, (title, var)


def test_import_files_carry_the_sharing_envelope_around_the_same_dashboard() -> None:
    for name, dashboard in DASHBOARDS.items():
        shared = json.loads((GENERATED / "import" / name).read_text())
        assert shared["__inputs"] == [{"name": "DS_PROMETHEUS", "label": "Prometheus",
                                       "description": "", "type": "datasource",
                                       "pluginId": "prometheus", "pluginName": "Prometheus"}]
        requires = {(r["type"], r["id"]) for r in shared["__requires"]}
        used = {p["type"] for p in panels(dashboard)} - {"row"}
        assert requires == {("grafana", "grafana"), ("datasource", "prometheus"),
                            *(("panel", k) for k in used)}, name
        # The input is referenced where Grafana's import substitutes it, and only there.
        assert json.dumps(shared).count("${DS_PROMETHEUS}") == 2
        body = {k: v for k, v in shared.items() if not k.startswith("__")}
        ds = next(v for v in body["templating"]["list"] if v["type"] == "datasource")
        assert ds.pop("current") == {"selected": True, "text": "${DS_PROMETHEUS}",
                                     "value": "${DS_PROMETHEUS}"}
        assert body == dashboard, f"{name}: the import file is another dashboard"


def test_layout_fits_the_grid_without_overlaps() -> None:
    for dashboard in DASHBOARDS.values():
        taken: set[tuple[int, int]] = set()
        ids = [p["id"] for p in panels(dashboard)]
        assert len(ids) == len(set(ids))
        for p in panels(dashboard):
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24
            cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                     for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & taken, f"{p['title']} overlaps another panel"
            taken |= cells


def test_uids_are_stable() -> None:
    assert {d["uid"] for d in DASHBOARDS.values()} == {
        "mrc-golden-triangle", "mrc-service", "mrc-latency-heatmap"}
    assert {name for name in DASHBOARDS} == {f"{d['uid']}.json" for d in DASHBOARDS.values()}


def test_golden_triangle_panels() -> None:
    titles = [p["title"] for p in visible_panels(DASHBOARDS["mrc-golden-triangle.json"])]
    for expected in ("Process CPU user and hottest thread", "PCIe TX/RX bandwidth",
                     "NVLink TX/RX bandwidth",
                     "SM instructions per DRAM byte (profiling counters)",
                     "GPM activity ratio (SM activity / DRAM bandwidth utilisation)",
                     "Compute-to-memory source", "GPU utilisation",
                     "GPU idle-window durations (selected range)", "GPU starvation signal"):
        assert expected in titles
    ratio = panel("SM instructions per DRAM byte (profiling counters)")["targets"][0]["expr"]
    assert re.fullmatch(
        r"rate\(mrc_gpu_sm_instructions_executed_total\{[^}]*\}\[\$__rate_interval\]\)"
        r" / rate\(mrc_gpu_dram_read_bytes_total\{[^}]*\}\[\$__rate_interval\]\)", ratio)
    source = panel("Compute-to-memory source")
    assert source["type"] == "stat" and source["options"]["textMode"] == "name"
    assert source["targets"][0]["expr"].startswith("mrc_agent_compute_memory_source_info{")
    assert panel("GPU idle-window durations (selected range)")["targets"][0]["format"] == "heatmap"


def test_service_panels() -> None:
    model = panel("Model and attention backend")
    assert model["type"] == "table"
    assert model["targets"][0]["expr"].endswith("} == 1")
    sla = panel("Requests with first token within 500 ms")["targets"][0]["expr"]
    assert 'mrc_time_to_first_token_seconds_bucket{' in sla and 'le="0.5"' in sla
    assert "mrc_time_to_first_token_seconds_count{" in sla
    stages = panel("Stage breakdown (mean seconds per request)")
    assert stages["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "mrc_stage_duration_seconds_sum" in stages["targets"][0]["expr"]
    legends = [t["legendFormat"] for t in panel("Request latency P50/P90/P99")["targets"]]
    assert legends == ["P50", "P90", "P99"]


# -- thresholds: one source of truth -------------------------------------------------------

#: Panel title -> the alerts/config.py value its threshold line must show.
EXPECTED_LINES = {
    "Process CPU user and hottest thread": T.cpu_user_ratio,
    "NVLink TX/RX bandwidth": T.nvlink_bytes_per_second,
    "SM instructions per DRAM byte (profiling counters)": T.instructions_per_dram_byte,
    "GPM activity ratio (SM activity / DRAM bandwidth utilisation)": T.gpm_sm_to_dram_activity,
    "GPU starvation signal": T.starved_fraction,
    "PCIe intervals dropped": T.pcie_dropped_intervals,
    "Request latency P50/P90/P99": T.latency_p99_seconds,
    "Time to first token P50/P90/P99": T.ttft_seconds,
    "Requests with first token within 500 ms": T.ttft_objective,
    "Within 500 ms (selected range)": T.ttft_objective,
    "Error ratio (error or timeout)": T.error_ratio,
    "Chain-break rate": T.chain_break_ratio,
    "P90 latency by resolution x prompt length": T.latency_p99_seconds,
    "First token within 500 ms by resolution x prompt length": T.ttft_objective,
    "P99 latency by bucket": T.latency_p99_seconds,
}


def test_threshold_lines_equal_the_alert_config() -> None:
    assert T.nvlink_bytes_per_second == 50e9 and T.cpu_user_ratio == 0.95
    for title, value in EXPECTED_LINES.items():
        assert threshold_values(panel(title)) == [value], title
        p = panel(title)
        if p["type"] == "timeseries":
            assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"


def test_no_threshold_outside_the_alert_config() -> None:
    config_values = {v for v in dataclasses.asdict(T).values() if isinstance(v, float)}
    for dashboard in DASHBOARDS.values():
        for p in visible_panels(dashboard):
            for v in threshold_values(p):
                assert v in config_values, f"{p['title']}: threshold {v} is not in alerts/config"
            for bound in ("min", "max"):
                v = p["fieldConfig"]["defaults"].get(bound)
                assert v is None or v in config_values | {0, 1}, f"{p['title']}: {bound} {v}"


def test_a_changed_config_moves_the_lines() -> None:
    cfg = dataclasses.replace(DEFAULT, thresholds=dataclasses.replace(
        T, cpu_user_ratio=0.5, ttft_seconds=0.25, latency_p99_seconds=3.0),
        selector='job="mrc"', runbook_base="https://example.org/runbooks")
    built = build_all(cfg)
    by_title = {p["title"]: p for d in built.values() for p in panels(d)}
    assert threshold_values(by_title["Process CPU user and hottest thread"]) == [0.5]
    assert threshold_values(by_title["Time to first token P50/P90/P99"]) == [0.25]
    assert "Requests with first token within 250 ms" in by_title
    assert 'le="0.25"' in by_title["Requests with first token within 250 ms"]["targets"][0]["expr"]
    heat = by_title["P90 latency by resolution x prompt length"]["fieldConfig"]["defaults"]
    assert heat["max"] == 3.0
    for dashboard in built.values():
        for p in visible_panels(dashboard):
            for t in p["targets"]:
                assert 'job="mrc"' in t["expr"], t["expr"]
            for link in p.get("links", []):
                assert link["url"].startswith("https://example.org/runbooks/")


# -- runbooks ----------------------------------------------------------------------------------

def test_runbook_links_name_real_alerts() -> None:
    names = {r["alert"] for r in alert_rules(DEFAULT)}
    linked: set[str] = set()
    for dashboard in DASHBOARDS.values():
        for p in visible_panels(dashboard):
            for link in p.get("links", []):
                m = re.fullmatch(re.escape(DEFAULT.runbook_base) + r"/(\w+)\.md", link["url"])
                assert m, link["url"]
                assert m.group(1) in names, f"{p['title']} links unknown alert {m.group(1)}"
                assert link["type"] == "link" and link["targetBlank"]
                linked.add(m.group(1))
    every = {v for k, v in vars(Alerts).items() if k.isupper()}
    assert linked == every
    assert {"MRCProcessCPUUserSaturated", "MRCNVLinkBandwidthLow", "MRCGPUMemoryBound",
            "MRCGPUStarved"} <= linked


# -- heatmap order -------------------------------------------------------------------------------

def grafana_transform(rows: list[dict[str, Any]], transformations: list[dict[str, Any]]
                      ) -> tuple[list[str], list[list[Any]]]:
    """A small model of Grafana's sortBy -> groupingToMatrix -> organize, as its source does
    them (groupingToMatrix keeps the order in which row and column values first appear)."""
    sort_by, matrix, organize = transformations
    assert [t["id"] for t in transformations] == ["sortBy", "groupingToMatrix", "organize"]
    for key in reversed(sort_by["options"]["sort"]):
        name = key["field"]
        rows = sorted(rows, key=lambda r: str(r[name]), reverse=key["desc"])
    o = matrix["options"]
    row_values = list(dict.fromkeys(r[o["rowField"]] for r in rows))
    col_values = list(dict.fromkeys(r[o["columnField"]] for r in rows))
    cells = {(r[o["rowField"]], r[o["columnField"]]): r[o["valueField"]] for r in rows}
    corner = f"{o['rowField']}\\{o['columnField']}"
    columns = [corner, *col_values]
    index = organize["options"]["indexByName"]
    columns.sort(key=lambda c: index.get(c, len(index)))
    table = [[rv if c == corner else cells.get((rv, c)) for c in columns] for rv in row_values]
    rename = organize["options"]["renameByName"]
    return [rename.get(c, c) for c in columns], table


def test_heatmap_matrix_order_is_fixed() -> None:
    assert RESOLUTION_ORDER == ("<1MP", "1-4MP", ">4MP")
    assert PROMPT_LENGTH_ORDER == ("0-50", "50-100", "100+")
    dash = build_heatmap(DEFAULT)
    for p in visible_panels(dash):
        if p["type"] != "table":
            continue
        sort_by, matrix, organize = p["transformations"]
        assert sort_by["options"]["sort"] == [{"field": RESOLUTION_RANK_LABEL, "desc": False}]
        assert matrix["options"]["rowField"] == "resolution"
        assert matrix["options"]["columnField"] == "prompt_length"
        assert matrix["options"]["valueField"] == "Value"
        index = organize["options"]["indexByName"]
        assert sorted(index, key=index.__getitem__) == [CORNER_FIELD, *PROMPT_LENGTH_ORDER]
        assert p["targets"][0]["instant"] and p["targets"][0]["format"] == "table"
        assert "[$__range]" in p["targets"][0]["expr"]
    p90 = panel("P90 latency by resolution x prompt length")
    assert p90["targets"][0]["expr"].count("histogram_quantile(0.9, sum by (le, prompt_length,"
                                           " resolution) (increase(") == 1
    assert p90["fieldConfig"]["defaults"]["custom"]["cellOptions"]["type"] == "color-background"


def test_heatmap_order_survives_any_series_order() -> None:
    """Whatever order the series come in, rows and columns end up in the fixed order."""
    transformations = panel("P90 latency by resolution x prompt length")["transformations"]
    series = [{"resolution": r, "prompt_length": c, "Value": 10 * i + j,
               RESOLUTION_RANK_LABEL: str(i + 1)}
              for i, r in enumerate(RESOLUTION_ORDER) for j, c in enumerate(PROMPT_LENGTH_ORDER)]
    for shift in range(len(series)):
        shuffled = series[shift:][::-1] + series[:shift]
        header, table = grafana_transform(shuffled, transformations)
        assert header == [CORNER_TITLE, *PROMPT_LENGTH_ORDER]
        assert [row[0] for row in table] == list(RESOLUTION_ORDER)
        assert table[1][1:] == [10, 11, 12]


def test_substitute_macros() -> None:
    expr = ('rate(x{pod=~"$pod",gpu=~"${gpu}"}[$__rate_interval]) + increase(y[$__range])'
            ' + z[$__interval] + label_replace(w, "a", "$1", "b", "(.*)")')
    assert substitute_macros(expr, range_s=7200, rate_interval_s=1.5, interval_s=15,
                             vars={"pod": "mrc-0"}) == (
        'rate(x{pod=~"mrc-0",gpu=~".*"}[1500ms]) + increase(y[7200s]) + z[15s]'
        ' + label_replace(w, "a", "$1", "b", "(.*)")')
    with pytest.raises(KeyError, match="unknown"):
        substitute_macros("x{a=~\"$nonesuch\"}")
    for _, _, expr in all_queries():
        assert "$" not in substitute_macros(expr).replace("$1", "")


# -- generated files ---------------------------------------------------------------------------

def test_generated_files_match_a_fresh_build() -> None:
    fresh = render_all()
    committed = {p.relative_to(GENERATED).as_posix(): p.read_text(encoding="utf-8")
                 for p in GENERATED.rglob("*") if p.is_file()}
    assert sorted(committed) == sorted(fresh), "stale or missing files: run " \
        "`mrc-agent dashboards build`"
    drifted = [name for name in fresh if committed[name] != fresh[name]]
    assert not drifted, f"{drifted} drifted from the code: run `mrc-agent dashboards build`"


def test_build_is_deterministic() -> None:
    assert render_all() == render_all()


def test_cli_builds_into_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["dashboards", "build", "--out", str(tmp_path)]) == 0
    fresh = render_all()
    for rel, text in fresh.items():
        assert (tmp_path / rel).read_text(encoding="utf-8") == text
    assert len(capsys.readouterr().out.splitlines()) == len(fresh)


def test_cli_requires_the_build_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["dashboards"])
    assert exc.value.code == 2


def test_provisioning_and_configmap() -> None:
    files = render_all()
    provider = yaml.safe_load(files[PROVISIONING_FILE])["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
    cm = yaml.safe_load(files[CONFIGMAP_FILE])
    assert cm["kind"] == "ConfigMap"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(cm["data"]) == set(DASHBOARDS)
    for name, text in cm["data"].items():
        assert json.loads(text) == DASHBOARDS[name]


def test_queries_need_the_standard_pod_labels() -> None:
    with pytest.raises(ValueError, match="pod labels"):
        PanelQueries(Config(pod_labels=("cluster", "pod")))
