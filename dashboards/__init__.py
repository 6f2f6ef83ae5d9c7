"""Grafana dashboards for MRC services, as code (grafanalib, mixin style).

``mrc-agent dashboards build`` writes them to ``dashboards/generated/``; a test fails when the
committed files drift from a fresh build.

* ``queries`` — every PromQL expression, selectors from ``alerts.config`` plus the template
  variables, and :func:`~mrc_agent.dashboards.queries.substitute_macros` for running them outside
  Grafana;
* ``panels`` — panel constructors over grafanalib and the one place where its gaps are filled;
* ``golden``, ``service``, ``heatmap`` — the three dashboards;
* ``build`` — the files (dashboard JSON, provisioning YAML, ConfigMap) and
  :func:`~mrc_agent.dashboards.build.all_queries`;
* ``validate`` — Grafana's JSON schema (vendored in ``schema/``) applied to the output.

Thresholds come from ``alerts.config``, so the line on a panel is the line that pages.
"""
