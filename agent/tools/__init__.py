"""Operator tools around the sidecar: diagnose, on-alert capture, report, doctor, record, demo
and trace generation.

They import :mod:`mrc_agent.agent.core` (its config, collectors, runner and hardware adapters) and
never the reverse: ``mrc-agent run`` executes only the core, plus the capture endpoints when a
webhook token is configured.
"""
