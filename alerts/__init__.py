"""Prometheus recording and alerting rules and an Alertmanager example for MRC services, as
code: thresholds in :mod:`alerts.config`, PromQL in :mod:`alerts.queries`, rules in
:mod:`alerts.rules`, files written by :mod:`alerts.build` (``mrc-agent alerts build``)."""
