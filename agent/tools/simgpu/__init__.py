"""The simulated GPU: one hand-written, data-driven fake of the NVML and CUPTI libraries, in
the wheel because ``mrc-agent selfcheck --dry`` runs on it; the tests use the same fake.

- :mod:`.nvml` stands in for ``pynvml`` (with the GPU descriptions of :mod:`.nvml_data`),
  :mod:`.cupti` for ``cupti-python`` (with the CUDA driver calls of :mod:`.cuda` and the
  chips' metric sets of :mod:`.chips`). Both answer with the real libraries' vocabulary, so
  the agent's own adapters (``NvmlBackend``, ``CuptiPmSampler``) run on them unchanged.
- A scenario is data: the tests write the dicts and dataclasses by hand and move them on
  between samples; the self-check's dry run (``selfcheck/dry_device.py``) writes them from its
  :class:`~mrc_agent.agent.tools.selfcheck.dry.DryModel` at the moment each call answers,
  through the fakes' ``refresh`` / ``gpm_between`` / ``on_call`` hooks.

How this relates to the other simulated GPUs: replay (``agent/core/hw/replay.py``) is the trace
format, one JSON row per device and sample in the agent's own units, what ``mrc-agent record``
writes on a real GPU and ``--gpu-backend replay:PATH`` plays back. ``agent/tools/tracegen.py``
writes synthetic traces in that format, which the demo (``agent/tools/demo.py``) replays where
no NVML answers. Those sit above the adapters (they stand in for what the adapters return);
this package sits below them (it stands in for the libraries), so it is what tests the
adapters and what the dry run reads through them. A dry self-check writes its own trace
(``dry_h200_trace.jsonl``) through the real adapters, in the same replay format, and
``tests/unit/test_gpu_pipeline.py`` records from these fakes into a trace and replays it.
"""
