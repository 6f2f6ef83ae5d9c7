"""The simulated GPU: one hand-written, data-driven fake of the NVML and CUPTI libraries, in
the wheel because ``mrc-agent selfcheck --dry`` and ``tracegen`` (whose traces the demo
replays) run on it; the tests use the same fake.

- :mod:`.nvml` stands in for ``pynvml`` (with the GPU descriptions of :mod:`.nvml_data`),
  :mod:`.cupti` for ``cupti-python`` (with the CUDA driver calls of :mod:`.cuda` and the
  chips' metric sets of :mod:`.chips`). Both answer with the real libraries' vocabulary, so
  the agent's own adapters (``NvmlBackend``, ``CuptiPmSampler``) run on them unchanged.
- A scenario is data: the tests write the dicts and dataclasses by hand and move them on
  between samples; the self-check's dry run (``selfcheck/dry_device.py``) writes them from its
  :class:`~mrc_agent.agent.tools.selfcheck.dry.DryModel` at the moment each call answers,
  through the fakes' ``refresh`` / ``gpm_between`` / ``on_call`` hooks.

Replay (``agent/core/hw/replay.py``) is not another simulated GPU but the trace format: one
JSON row per device and sample in the agent's own units, what ``mrc-agent record`` writes and
``--gpu-backend replay:PATH`` plays back. Every synthetic trace is recorded from this package:
``agent/tools/tracegen.py`` drives it with a pattern on a virtual clock and records it through
the real adapters with ``record``'s recorder (the demo's embedded trace is one), and a dry
self-check writes ``dry_h200_trace.jsonl`` the same way in real time. ``ClockedCupti`` (in
:mod:`.cupti`) is the CUPTI both of them read: hardware that completes sampling intervals on a
clock, from cumulative counters they supply.
"""
