"""The sidecar core: everything ``mrc-agent run`` executes.

Config, the one wiring module, the runner and its targets, the collectors and the hardware adapters
behind them. Nothing here imports :mod:`mrc_agent.agent.tools`; the tools import this.
"""
