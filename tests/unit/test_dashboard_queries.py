"""The dashboards' building blocks on their own: PromQL selectors and escapes, Grafana macro
substitution, the panel constructors and the grid layout, grafanalib's output brought to the
current model, and the build's file writing, import envelope and ConfigMap size limit.

``test_dashboards.py`` checks the built dashboards as a whole (and the committed copy); these
tests reach the branches the three shipped dashboards never take (a wrapping row, a collapsed
row, a variable with a default, a value that needs escaping, an oversized ConfigMap).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from grafanalib.core import Dashboard, RowPanel, Template, Templating

from mrc_agent.alerts.config import DEFAULT
from mrc_agent.dashboards import build
from mrc_agent.dashboards.build import (
    _panels,
    build_all,
    configmap_yaml,
    importable,
    render_all,
    run_build,
    template_queries,
    write,
)
from mrc_agent.dashboards.panels import (
    Cell,
    Section,
    _layout,
    current_json,
    dashboard,
    heatmap,
    histogram_bars,
    override_by_type,
    render,
    stat,
    table,
    timeseries,
    variables,
)
from mrc_agent.dashboards.queries import (
    PanelQueries,
    Query,
    _promql_regex_literal,
    substitute_macros,
)

Q = Query("up", "{{pod}}")
CUSTOM = dataclasses.replace(DEFAULT, runbook_base="https://example.org/runbooks")


def _promql_string(literal: str) -> str:
    """The value of a double-quoted PromQL string with this body (Go's escapes)."""
    return re.sub(r'\\(.)', r"\1", literal)


def one_panel(cell: Cell) -> dict[str, Any]:
    """``cell`` as its dashboard JSON, through the same path the shipped dashboards take."""
    built = dashboard("t", "u", "d", variables({}), [Section("s", [cell])])
    return built["panels"][1]


# -- queries ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["1.5+MP", "a|b", "(x)*?[y]{2}^$", "back\\slash", 'quo"te',
                                   "X", "<1MP"])
def test_regex_literal_matches_exactly_its_value(value: str) -> None:
    literal = _promql_regex_literal(value)
    assert not re.search(r'(?<!\\)"', literal), "an unescaped quote would end the string"
    pattern = _promql_string(literal)
    assert re.fullmatch(pattern, value)
    assert not re.fullmatch(pattern, value + "x")


def test_regex_literal_leaves_plain_values_alone() -> None:
    assert _promql_regex_literal("1-4MP") == "1-4MP"
    assert _promql_regex_literal("1.5") == "1\\\\.5"


def test_gpu_selector_adds_an_extra_matcher_after_the_gpu_one() -> None:
    q = PanelQueries(DEFAULT)
    assert q.gpu('le="1"') == ('{cluster=~"$cluster",namespace=~"$namespace",pod=~"$pod",'
                               'gpu=~"$gpu",le="1"}')
    assert q.gpu() == '{cluster=~"$cluster",namespace=~"$namespace",pod=~"$pod",gpu=~"$gpu"}'


def test_an_unknown_template_variable_is_a_key_error_naming_it() -> None:
    q = PanelQueries(DEFAULT)
    with pytest.raises(KeyError, match="nonesuch"):
        q.variable_query("nonesuch")
    with pytest.raises(KeyError, match="gpu"):
        q.service_variable_query("gpu")  # the service dashboards have no GPU variable
    assert q.service_variable_query("cluster") == "label_values(mrc_requests_total, cluster)"


def test_the_latency_matrix_has_no_legend() -> None:
    assert PanelQueries(DEFAULT).latency_quantile_matrix(0.9).legend == ""


# -- macros ----------------------------------------------------------------------------------

def test_macro_defaults_and_every_macro_form() -> None:
    expr = "$__range $__rate_interval $__interval $__interval_ms $__range_s $__range_ms"
    assert substitute_macros(expr) == "3600s 60s 15s 15000 3600 3600000"
    assert substitute_macros(expr, range_s=7200.4, rate_interval_s=0.5, interval_s=0.25) == (
        "7200400ms 500ms 250ms 250 7200 7200400")


def test_macro_durations_of_one_second_and_below() -> None:
    assert substitute_macros("[$__rate_interval]", rate_interval_s=1) == "[1s]"
    assert substitute_macros("[$__rate_interval]", rate_interval_s=0.75) == "[750ms]"
    for bad in (0, -1):
        with pytest.raises(ValueError, match="must be > 0"):
            substitute_macros("x", rate_interval_s=bad)


def test_datasource_variable_defaults_to_prometheus_unless_given() -> None:
    assert substitute_macros("${datasource} $datasource") == "prometheus prometheus"
    assert substitute_macros("$datasource", vars={"datasource": "thanos"}) == "thanos"
    assert substitute_macros('{pod=~"$pod"}', default_var="mrc-.*") == '{pod=~"mrc-.*"}'


# -- panel constructors ----------------------------------------------------------------------

def test_panels_are_half_the_grid_wide_and_stats_a_quarter_by_default() -> None:
    for cell in (timeseries("t", [Q], "s", description="d"),
                 table("t", [Q], "s", description="d"),
                 heatmap("t", Q, "short", "s", description="d"),
                 histogram_bars("t", Q, "short", description="d")):
        assert (cell.w, cell.h) == (12, 8)
    assert (stat("t", [Q], "s", description="d").w, stat("t", [Q], "s", description="d").h) \
        == (6, 4)


def test_panel_constructors_keep_the_size_they_are_given() -> None:
    cells = [timeseries("t", [Q], "s", description="d", w=5, h=3),
             table("t", [Q], "s", description="d", w=5, h=3),
             stat("t", [Q], "s", description="d", w=5, h=3),
             heatmap("t", Q, "short", "s", description="d", w=5, h=3),
             histogram_bars("t", Q, "short", description="d", w=5, h=3)]
    assert [(c.w, c.h) for c in cells] == [(5, 3)] * 5


def test_a_stat_colours_its_value_by_default() -> None:
    options = one_panel(stat("t", [Q], "s", description="d"))["options"]
    assert options["colorMode"] == "value"
    options = one_panel(stat("t", [Q], "s", description="d", color_mode="background"))["options"]
    assert options["colorMode"] == "background"


def test_heatmap_and_bar_gauge_units_reach_the_panel() -> None:
    p = one_panel(heatmap("t", Q, "reqps", "ms", description="d"))
    assert p["fieldConfig"]["defaults"]["unit"] == "reqps"
    assert p["options"]["cellValues"]["unit"] == "reqps"
    assert p["options"]["yAxis"]["unit"] == "ms"
    p = one_panel(histogram_bars("t", Q, "bytes", description="d"))
    assert p["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_override_by_type_writes_grafanas_matcher_and_dotted_property_ids() -> None:
    assert override_by_type("string", custom__cellOptions={"type": "auto"},
                            color={"mode": "fixed"}) == {
        "matcher": {"id": "byType", "options": "string"},
        "properties": [{"id": "custom.cellOptions", "value": {"type": "auto"}},
                       {"id": "color", "value": {"mode": "fixed"}}]}


# -- layout ----------------------------------------------------------------------------------

def _cell(w: int, h: int = 8) -> Cell:
    return timeseries(f"{w}x{h}", [Q], "s", description="d", w=w, h=h)


def test_layout_wraps_a_row_that_does_not_fit_under_its_tallest_panel() -> None:
    sections = [Section("a", [_cell(12, 5), _cell(12, 8), _cell(13, 4), _cell(12), _cell(1, 2)])]
    grid = [(p.gridPos.x, p.gridPos.y, p.gridPos.w, p.gridPos.h) for p in _layout(sections)]
    assert grid == [(0, 0, 24, 1),  # the row
                    (0, 1, 12, 5), (12, 1, 12, 8),  # 24 columns: full, no wrap
                    (0, 9, 13, 4),  # wrapped below the taller (8) of the two
                    (0, 13, 12, 8),  # 13 + 12 = 25 > 24: wrapped again
                    (12, 13, 1, 2)]


def test_an_empty_section_takes_only_its_row() -> None:
    grid = [(p.gridPos.x, p.gridPos.y) for p in _layout([Section("a"), Section("b", [_cell(6)])])]
    assert grid == [(0, 0), (0, 1), (0, 2)]


# -- grafanalib's output made current --------------------------------------------------------

def test_a_variable_with_a_default_keeps_its_current_value() -> None:
    templating = Templating(list=[
        Template(name="env", label="env", query="a,b", type="custom", default="b"),
        Template(name="pod", label="pod", query="label_values(up, pod)")])
    data = current_json(Dashboard(title="t", templating=templating))
    env, pod = data["templating"]["list"]
    assert env["current"]["value"] == "b"
    assert "current" not in pod
    assert not {"useTags", "tagsQuery", "auto"} & set(env)


def test_panels_inside_a_collapsed_row_are_made_current_too() -> None:
    inner = timeseries("inner", [Q], "s", description="d").panel
    row = RowPanel(title="r", collapsed=True, panels=[inner])
    data = current_json(Dashboard(title="t", panels=[row]).auto_panel_ids())
    (out,) = data["panels"]
    assert set(out) <= {"type", "collapsed", "title", "datasource", "gridPos", "id", "panels",
                        "repeat"}
    (nested,) = out["panels"]
    assert nested["title"] == "inner"
    assert not {"span", "editable", "error", "height"} & set(nested)
    assert nested["fieldConfig"]["overrides"] == []


def test_render_keeps_non_ascii_text_readable() -> None:
    assert render({"b": "P90 µs × 2", "a": 1}) == '{\n  "a": 1,\n  "b": "P90 µs × 2"\n}\n'


# -- build -----------------------------------------------------------------------------------

def test_panels_walks_collapsed_rows_and_tolerates_no_panels() -> None:
    dash = {"panels": [{"id": 1, "type": "row", "panels": [{"id": 2}, {"id": 3}]}, {"id": 4}]}
    assert [p["id"] for p in _panels(dash)] == [1, 2, 3, 4]
    assert list(_panels({})) == []


def test_template_queries_list_every_query_variable() -> None:
    names = {(dash, var) for dash, var, _ in template_queries()}
    assert names == {
        *((title, v) for title in ("MRC golden triangle", "MRC service", "MRC latency heatmap")
          for v in ("cluster", "namespace", "pod")),
        ("MRC golden triangle", "gpu")}
    assert all(query.startswith("label_values(") for _, _, query in template_queries())


def test_importable_leaves_the_dashboard_it_wraps_unchanged() -> None:
    dash = build_all()["mrc-service.json"]
    before = json.dumps(dash, sort_keys=True)
    shared = importable(dash)
    assert json.dumps(dash, sort_keys=True) == before
    ds = next(v for v in shared["templating"]["list"] if v["type"] == "datasource")
    assert ds["current"]["value"] == "${DS_PROMETHEUS}"


def test_importable_refuses_a_panel_type_it_cannot_name() -> None:
    dash = copy.deepcopy(build_all()["mrc-service.json"])
    dash["panels"][1]["type"] = "piechart"
    with pytest.raises(ValueError, match=r"no plugin name for panel types \['piechart'\]"):
        importable(dash)


def test_configmap_size_limit_is_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = {"a.json": "{\n  \"a\": 1\n}\n"}
    size = len(configmap_yaml(texts).encode())
    monkeypatch.setattr(build, "CONFIGMAP_LIMIT_BYTES", size)
    assert len(configmap_yaml(texts).encode()) == size  # exactly at the limit: fine
    monkeypatch.setattr(build, "CONFIGMAP_LIMIT_BYTES", size - 1)
    with pytest.raises(ValueError, match=rf"is {size} bytes, over the {size - 1} a ConfigMap"):
        configmap_yaml(texts)


def test_write_returns_the_paths_it_wrote_for_the_given_config(tmp_path: Path) -> None:
    paths = write(tmp_path, CUSTOM)
    expected = render_all(CUSTOM)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in paths) == sorted(expected)
    for path in paths:
        assert path.read_text(encoding="utf-8") == expected[path.relative_to(tmp_path).as_posix()]


def test_run_build_prints_each_path_and_uses_the_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_build(str(tmp_path), CUSTOM) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == sorted(str(tmp_path / rel) for rel in render_all(CUSTOM))
    golden = (tmp_path / "mrc-golden-triangle.json").read_text(encoding="utf-8")
    assert "https://example.org/runbooks/" in golden
