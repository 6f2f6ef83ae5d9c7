"""An example Alertmanager configuration for the MRC alerts, as a plain dict.

``severity="critical"`` goes to the on-call pager, ``severity="warning"`` to the ticket queue,
and anything else (``info``, an alert added without a severity) falls through to the ticket
queue rather than being dropped. These are kube-prometheus-stack's severities, so its own rules
route the same way. Alerts group per alert name and pod; a critical alert inhibits the warnings
of the same namespace and pod, so the pager does not also open tickets for the symptoms of the
same cause.
"""

from __future__ import annotations

from typing import Any

from mrc_agent.alerts.config import Config
from mrc_agent.alerts.queries import check_duration
from mrc_agent.alerts.rules import PAGE, TICKET

PAGE_RECEIVER = "mrc-page"
TICKET_RECEIVER = "mrc-ticket"


def alertmanager_config(cfg: Config) -> dict[str, Any]:
    """The configuration; webhook URLs and the page group wait come from ``cfg``."""
    group_by = ["alertname", *cfg.pod_keys]
    return {
        "global": {"resolve_timeout": "5m"},
        "route": {
            "receiver": TICKET_RECEIVER,
            "group_by": group_by,
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "24h",
            "routes": [
                {
                    "receiver": PAGE_RECEIVER,
                    "matchers": [f'severity="{PAGE}"'],
                    "group_wait": check_duration(cfg.page_group_wait),
                    "group_interval": "1m",
                    "repeat_interval": "1h",
                },
                {
                    "receiver": TICKET_RECEIVER,
                    "matchers": [f'severity="{TICKET}"'],
                },
            ],
        },
        "inhibit_rules": [
            {
                "source_matchers": [f'severity="{PAGE}"'],
                "target_matchers": [f'severity="{TICKET}"'],
                # Alertmanager treats a label missing on both sides as equal: outside Kubernetes
                # (no namespace/pod labels) a page inhibits every ticket without them.
                "equal": list(cfg.pod_keys),
            },
        ],
        "receivers": [
            {
                "name": PAGE_RECEIVER,
                "webhook_configs": [{"url": cfg.page_webhook_url, "send_resolved": True}],
            },
            {
                "name": TICKET_RECEIVER,
                "webhook_configs": [{"url": cfg.ticket_webhook_url, "send_resolved": True}],
            },
        ],
    }


HEADER = """\
# Example Alertmanager configuration for the MRC alerts.
#
# Routes severity="critical" to the on-call receiver `mrc-page` and severity="warning" (and
# anything else: info, no severity) to `mrc-ticket` — kube-prometheus-stack's severities; groups
# by alertname, namespace, pod; a critical alert inhibits the warnings of the same namespace/pod;
# every receiver is told when an alert resolves.
#
# The webhook URLs are placeholders on reserved example.com domains: replace them with your
# pager's and ticket system's webhook endpoints (or swap the receivers for pagerduty_configs /
# opsgenie_configs), or build with your own in alerts.config.Config(page_webhook_url=...,
# ticket_webhook_url=...).
"""
