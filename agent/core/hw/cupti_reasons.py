"""What CUPTI's errors mean for the PM sampling source (:mod:`mrc_agent.agent.core.hw.cupti_pm`):
the bounded reasons a :class:`SourceUnavailable` carries, and which answers are such reasons (they
do not change while the agent runs, so they are not asked again) rather than failures that may pass
(retried with a backoff).

The result names are those of ``cupti.cupti.Result`` in cupti-python 13.4, the meanings those of
``cupti_result.h`` (CUPTI's API reference, "CUPTI Result Codes").
"""

from __future__ import annotations

from typing import Any

#: The bounded reasons a SourceUnavailable from the PM sampling source carries (label values of
#: ``mrc_agent_compute_memory_source_info``).
REASON_CODES = frozenset(
    {
        "attribution_unknown",  # several GPUs and no target says which are its own
        "binding_mismatch",  # cupti-python's API is not the one this agent calls (until restart)
        "cupti_incompatible",  # this CUPTI does not work with this driver
        "cupti_missing",
        "cupti_not_initialized",  # CUPTI cannot reach the CUDA driver even after cuInit
        "cuda_missing",
        "no_cuda_device",  # CUDA in this process has no device of the GPU's UUID
        "no_gpu",
        "no_permission",
        "profiler_busy",
        "unsupported_device",
    }
)

#: CUPTI result codes that mean the source cannot run here, and the bounded reason each becomes.
REASON_BY_RESULT: dict[str, str] = {
    "ERROR_INSUFFICIENT_PRIVILEGES": "no_permission",
    "ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES": "no_permission",
    # "performance monitoring hardware is in use by other client"
    "ERROR_HARDWARE_BUSY": "profiler_busy",
    # also what CUPTI answers under Nsight Systems / Nsight Compute / cuda-gdb
    "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED": "profiler_busy",
    # "CUPTI is disabled due to conflicts with other enabled profilers"
    "ERROR_DISABLED": "profiler_busy",
    "ERROR_OLD_PROFILER_API_INITIALIZED": "profiler_busy",
    "ERROR_NOT_SUPPORTED": "unsupported_device",
    "ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED": "unsupported_device",
    "ERROR_CMP_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_MIG_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_SLI_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_WSL_DEVICE_NOT_SUPPORTED": "unsupported_device",
    "ERROR_INVALID_CHIP_NAME": "unsupported_device",
    "ERROR_INVALID_DEVICE": "no_gpu",
    # "unable to initialize its connection to the CUDA driver": only reached after cuInit
    # and, where that did not help, with the primary context retained. The GPU is there (NVML
    # and CUDA both found it), so this is not "no_gpu"; asking again does not change it.
    "ERROR_NOT_INITIALIZED": "cupti_not_initialized",
    # A CUPTI newer than the driver (a cupti-python wheel ahead of the node's driver): it stays
    # so until one of them is changed, so it is a reason, not a failure retried forever.
    "ERROR_NOT_COMPATIBLE": "cupti_incompatible",
}

#: cupti-python / cuda-pathfinder exception classes (all RuntimeError subclasses) raised when
#: libcupti.so or one of its functions cannot be loaded.
_MISSING_LIBRARY_ERRORS = frozenset(
    {"DynamicLibNotFoundError", "DynamicLibNotAvailableError", "FunctionNotFoundError"}
)


#: Text cupti-python raises, as a RuntimeError, for ERROR_NOT_INITIALIZED from
#: profiler_initialize / profiler_host_initialize ("CUPTI could not load the nvperf* libraries
#: required for profiling ..."): its guess at the cause, not a load failure it saw.
_NVPERF_NOT_INITIALISED = "could not load the nvperf"


def runtime_errors(lib: Any) -> tuple[type[BaseException], ...]:
    """What a call into cupti.pm_sampling may raise (its docstrings): cuptiError for CUPTI codes
    it does not translate, MemoryError / PermissionError / RuntimeError / ValueError for those
    it does; and TypeError / AttributeError, which at this boundary mean a cupti-python whose
    signatures differ from those called here (:func:`classify`). Anything else is a bug."""
    return (lib.cupti.cuptiError, MemoryError, RuntimeError, ValueError, OSError, TypeError,
            AttributeError)


def classify(lib: Any, exc: BaseException) -> str | None:
    """The bounded reason a start-up error means, or ``None`` when it may be transient."""
    if isinstance(exc, lib.cupti.cuptiError):
        return REASON_BY_RESULT.get(result_name(lib, getattr(exc, "status", None)))
    # A changed signature or a renamed attribute of the binding: it stays so until the agent
    # (or cupti-python) is changed, so it is said once, never retried every pass.
    if isinstance(exc, (TypeError, AttributeError)):
        return "binding_mismatch"
    # cupti.pm_sampling translates some codes into builtin exceptions (Collector.enable):
    # INSUFFICIENT_PRIVILEGES -> PermissionError, INVALID_PARAMETER on the device index ->
    # ValueError, INVALID_OPERATION ("already enabled") and nvperf load failures -> RuntimeError.
    if isinstance(exc, PermissionError):
        return "no_permission"
    if isinstance(exc, ValueError):
        return "no_gpu"
    if isinstance(exc, RuntimeError):
        name, text = type(exc).__name__, str(exc)
        if type(exc) is RuntimeError and _NVPERF_NOT_INITIALISED in text:
            # The same code as a raw ERROR_NOT_INITIALIZED, after the same cuInit and primary
            # context retry (not_initialised): the same reason; the detail keeps the text.
            return "cupti_not_initialized"
        if name in _MISSING_LIBRARY_ERRORS or "nvperf" in text:
            return "cupti_missing"
        if name == "NotSupportedError":  # cupti-python: "CUDA driver is not found (...)"
            return "cuda_missing" if "not found" in text else "unsupported_device"
        if "already enabled" in text:  # someone else in this process holds PM sampling
            return "profiler_busy"
    return None


def not_initialised(lib: Any, exc: BaseException) -> bool:
    """CUPTI's ``ERROR_NOT_INITIALIZED`` from enable(), raw or as cupti-python translates it
    when profiler_initialize answers it (a RuntimeError about the nvperf libraries)."""
    if isinstance(exc, lib.cupti.cuptiError):
        return result_name(lib, getattr(exc, "status", None)) == "ERROR_NOT_INITIALIZED"
    return type(exc) is RuntimeError and _NVPERF_NOT_INITIALISED in str(exc)


def result_name(lib: Any, status: Any) -> str:
    """The ``cupti.cupti.Result`` name of ``status``, else its text."""
    try:
        return str(lib.cupti.Result(status).name)
    except (TypeError, ValueError):
        return str(status)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
