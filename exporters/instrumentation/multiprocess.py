"""prometheus-client's multiprocess mode, for a service run as several uvicorn/gunicorn workers.

In this mode prometheus-client keeps every value in memory-mapped files in the directory named by
``PROMETHEUS_MULTIPROC_DIR``, and a scrape merges the files of every worker. prometheus-client
picks its value store when it is first imported, so the variable must be in the environment
*before the process starts*, never set from Python afterwards: :func:`multiprocess_enabled`
refuses a mismatch. The launcher empties the directory once, before any worker starts
(:func:`prepare_multiproc_dir`), and each worker calls :func:`mark_process_dead` as it exits so its
live gauges stop counting. How the metrics themselves are stored in this mode is
:mod:`mrc_agent.exporters.instrumentation.stores`.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import values as _prom_values
from prometheus_client.multiprocess import mark_process_dead as _mark_process_dead

#: The environment variable naming the multiprocess directory.
_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_enabled() -> bool:
    """Whether prometheus-client runs in multiprocess mode in this process.

    Raises ``RuntimeError`` when the environment and prometheus-client disagree: the variable was
    set after prometheus-client was imported (values would silently stay per process), or removed
    after (values could not be written).
    """
    env = bool(os.environ.get(_ENV))
    store = _prom_values.ValueClass is not _prom_values.MutexValue
    if env and not store:
        raise RuntimeError(f"{_ENV} was set after prometheus_client was imported; set it in the "
                           "environment before the process starts")
    if store and not env:
        raise RuntimeError(f"prometheus_client runs in multiprocess mode but {_ENV} is unset")
    return env


def prepare_multiproc_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Create the multiprocess directory and delete stale ``*.db`` files from a previous run.

    Call it in the launcher, once, before any worker starts (never from a worker: it would delete
    the files of the workers already running). ``path`` defaults to ``$PROMETHEUS_MULTIPROC_DIR``.
    """
    raw = path if path is not None else os.environ.get(_ENV)
    if not raw:
        raise ValueError(f"no multiprocess directory given and {_ENV} is unset")
    d = Path(raw)
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("*.db"):
        f.unlink()
    return d


def mark_process_dead(pid: int | None = None) -> None:
    """Drop the live gauges (in flight, queued, model info) of an exited worker; no-op otherwise.

    Call it from the worker's shutdown (lifespan) with no argument, or from a process manager's
    child-exit hook with the child's pid. Counters and histograms of dead workers are kept, as
    they must be for ``rate()``.
    """
    if multiprocess_enabled():
        _mark_process_dead(os.getpid() if pid is None else pid)
