"""Prometheus recording and alerting rules and an Alertmanager example for MRC services, as
code: thresholds in :mod:`mrc_agent.alerts.config`, PromQL in :mod:`mrc_agent.alerts.queries`, rules
in :mod:`mrc_agent.alerts.rules`, files written by :mod:`mrc_agent.alerts.build` (``mrc-agent alerts
build``)."""
