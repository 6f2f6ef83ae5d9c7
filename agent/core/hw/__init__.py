"""Hardware adapters: the only code that talks to ``/proc``, NVML, CUPTI or a replayed trace.

Each answers through the small Protocols and sample types of :mod:`mrc_agent.agent.core.hw.base` and
turns the library's errors into :class:`~mrc_agent.agent.core.hw.base.HardwareError` or
:class:`~mrc_agent.agent.core.hw.base.SourceUnavailable`, so the rest of the agent never imports
``pynvml`` or ``cupti``: ``procfs`` (target processes), ``nvml`` (device state, NVLink, GPM, XID
events), ``cupti_pm`` and ``profiling`` (CUPTI PM sampling, built on first use), ``replay``
(recorded traces) and ``sources`` (the set a collector run reads).
"""
