"""The *MRC latency heatmap*: request latency by resolution x prompt-length bucket.

Rows are the image resolution buckets, columns the prompt-length buckets, each cell the P90
latency over the selected time range, coloured from green to red at the latency alert's value: at
a glance, whether long prompts, huge photos or both blow the SLA. The order of rows and columns is
fixed (``<1MP, 1-4MP, >4MP`` x ``0-50, 50-100, 100+``), whatever order Prometheus returns the
series in:

* the query adds a ``resolution_rank`` label ("1", "2", "3"), a ``sortBy`` transformation sorts
  the rows on it, and ``groupingToMatrix`` (which keeps the order in which rows first appear)
  builds the matrix with ``resolution`` as rows and ``prompt_length`` as columns;
* an ``organize`` transformation puts the columns in order (``indexByName``).

Below the matrices, the same buckets over time.
"""

from __future__ import annotations

from typing import Any

from mrc_agent.alerts.config import Config
from mrc_agent.dashboards.panels import (
    Alerts,
    Section,
    above,
    below,
    dashboard,
    override_by_type,
    runbook,
    table,
    timeseries,
    transformation,
    variables,
)
from mrc_agent.dashboards.queries import (
    PROMPT_LENGTH_ORDER,
    RESOLUTION_ORDER,
    RESOLUTION_RANK_LABEL,
    PanelQueries,
)

UID = "mrc-latency-heatmap"
TITLE = "MRC latency heatmap"

ROW_FIELD = "resolution"
COLUMN_FIELD = "prompt_length"
#: The name groupingToMatrix gives its first column ("<rowField>\\<columnField>").
CORNER_FIELD = f"{ROW_FIELD}\\{COLUMN_FIELD}"
CORNER_TITLE = "resolution \\ prompt length"


def matrix_transformations() -> list[dict[str, Any]]:
    """sortBy rank -> groupingToMatrix -> organize: the fixed row and column order."""
    return [
        transformation("sortBy", fields={},
                       sort=[{"field": RESOLUTION_RANK_LABEL, "desc": False}]),
        transformation("groupingToMatrix", rowField=ROW_FIELD, columnField=COLUMN_FIELD,
                       valueField="Value", emptyValue="null"),
        transformation(
            "organize",
            indexByName={CORNER_FIELD: 0,
                         **{name: i for i, name in enumerate(PROMPT_LENGTH_ORDER, start=1)}},
            renameByName={CORNER_FIELD: CORNER_TITLE}, excludeByName={}),
    ]


#: The row labels are text: keep them uncoloured while the value cells are coloured.
_PLAIN_LABELS = override_by_type("string", custom__cellOptions={"type": "auto"})


def build(cfg: Config) -> dict[str, Any]:
    q = PanelQueries(cfg)
    t = cfg.thresholds
    sla_ms = t.ttft_seconds * 1000
    buckets = (f"Rows: {', '.join(RESOLUTION_ORDER)}; "
               f"columns: {', '.join(PROMPT_LENGTH_ORDER)} characters.")
    matrices = Section("Selected time range", [
        table(
            "P90 latency by resolution x prompt length", [q.latency_quantile_matrix(0.9)], "s",
            w=14, h=8, transformations=matrix_transformations(), overrides=[_PLAIN_LABELS],
            colour_cells=True, colour_scale=("continuous-GrYlRd", 0.0, t.latency_p99_seconds),
            thresholds=above(t.latency_p99_seconds), links=runbook(cfg, Alerts.LATENCY),
            description=(
                "P90 request latency over the selected range per image resolution (rows) and "
                "prompt length (columns). Green at 0 s to red at the latency alert's "
                f"{t.latency_p99_seconds:g} s. {buckets}")),
        table(
            f"First token within {sla_ms:g} ms by resolution x prompt length",
            [q.ttft_within_sla_matrix], "percentunit", w=10, h=8,
            transformations=matrix_transformations(), overrides=[_PLAIN_LABELS],
            colour_cells=True, thresholds=below(t.ttft_objective),
            links=runbook(cfg, Alerts.TTFT_FAST_BURN, Alerts.TTFT_SLOW_BURN),
            description=(
                f"Share of requests with a first token within {sla_ms:g} ms over the selected "
                f"range, per bucket; red below the {t.ttft_objective:.0%} objective. {buckets}")),
    ])
    over_time = Section("The same buckets over time", [
        timeseries(
            "P90 latency by bucket", [q.latency_quantile_by_bucket(0.9)], "s", min_value=0,
            description=f"P90 request latency per resolution x prompt-length bucket. {buckets}"),
        timeseries(
            "P99 latency by bucket", [q.latency_quantile_by_bucket(0.99)], "s", min_value=0,
            thresholds=above(t.latency_p99_seconds), links=runbook(cfg, Alerts.LATENCY),
            description=(
                "P99 request latency per bucket; the dashed line is the alert's "
                f"{t.latency_p99_seconds:g} s (held {t.latency_for}).")),
    ])
    return dashboard(
        TITLE, UID,
        "Request latency by image resolution x prompt length: P90 over the selected range "
        "as a fixed-order matrix, and the same buckets over time.",
        variables({"cluster": q.service_variable_query("cluster"),
                   "namespace": q.service_variable_query("namespace"),
                   "pod": q.service_variable_query("pod")}),
        [matrices, over_time])
