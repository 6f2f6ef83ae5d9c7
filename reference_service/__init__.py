"""The instrumented reference MRC service: an image and a question in, a VLM's answer out.

A FastAPI application that runs the MRC chain (fetch → decode → preprocess → OCR → answer) over a
vision-language model and exports what it does through the ``mrc_agent.exporters`` instrumentation
library, so the sidecar has a realistic service to watch. ``python -m mrc_agent.reference_service``
(also ``mrc-agent serve``) starts it; :mod:`mrc_agent.reference_service.main` wires the app: state,
routers, error handlers, and the lifespan that loads the model.

* :mod:`~mrc_agent.reference_service.routers`: HTTP routers, one per concern (``/mrc`` endpoints;
  the OpenAI chat API, whose shapes :mod:`~mrc_agent.reference_service.chat` holds; ``/health``
  and ``/ready``).
* :mod:`~mrc_agent.reference_service.pipeline`: one request's chain, each stage timed.
* :mod:`~mrc_agent.reference_service.model`: the VLM layer (embedded tiny model or a local
checkpoint,
  NF4, attention-kernel detection, generation with timings).
* :mod:`~mrc_agent.reference_service.preprocess`: image decoding and limits, one room per concern
  (base64, header checks, draft-mode decode, the CPU and GPU resize paths, the decode pool).
* :mod:`~mrc_agent.reference_service.fetch`, :mod:`~mrc_agent.reference_service.ocr`,
  :mod:`~mrc_agent.reference_service.cache`: SSRF-safe ``image_url`` fetching, the OCR step, the
  context-aware answer cache.
* :mod:`~mrc_agent.reference_service.settings`, :mod:`~mrc_agent.reference_service.state`,
  :mod:`~mrc_agent.reference_service.limiter`, :mod:`~mrc_agent.reference_service.middleware`,
  :mod:`~mrc_agent.reference_service.errors`, :mod:`~mrc_agent.reference_service.logs`: limits,
  lifetime state, admission control, the body-size cap, the error type, per-request log lines.
* :mod:`~mrc_agent.reference_service.loadgen`: ``mrc-agent loadgen``, a request mix for load tests.

The service imports ``exporters`` (the instrumentation it demonstrates), never ``agent``: the
sidecar observes it from outside, as it would any other service.
"""
