"""Prometheus exposition for the agent and the instrumentation library for MRC services.

Depends only on prometheus-client (and starlette for the service middleware), never on the
agent's internals or on torch.
"""
