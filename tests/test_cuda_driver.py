"""The CUDA driver adapter against a fake ``cuda.bindings.driver`` module."""

from __future__ import annotations

import logging
import sys

import pytest

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from tests.fakes.fake_cupti import CUresult, FakeCupti, FakeDevice

LOGGER = "mrc_agent.agent.core.hw.cuda_driver"


def driver_for(*indices: int) -> tuple[CudaDriver, FakeCupti]:
    lib = FakeCupti({i: FakeDevice() for i in indices})
    return CudaDriver(lib.driver), lib


def test_init_calls_cuinit_once_however_often_it_is_asked() -> None:
    cuda, lib = driver_for(0)

    cuda.init()
    cuda.init()

    assert lib.driver.calls == ["cuInit"] and lib.driver.initialised


def test_retain_and_release_a_primary_context() -> None:
    cuda, lib = driver_for(0, 1)

    cuda.retain_primary_context(1)
    cuda.retain_primary_context(1)  # held once, not twice

    assert lib.driver.retained == {1: 1} and cuda.retained == (1,)
    assert lib.driver.current == 1  # made current, as NVIDIA's samples do
    assert lib.driver.calls[0] == "cuInit"  # retaining initialises first
    cuda.close()
    cuda.close()
    assert lib.driver.retained == {} and cuda.retained == ()


def test_missing_libcuda_is_cuda_missing_with_the_container_hint() -> None:
    cuda, lib = driver_for(0)
    lib.driver.library_missing = True

    with pytest.raises(SourceUnavailable) as caught:
        cuda.init()

    assert caught.value.reason == "cuda_missing"
    assert "NVIDIA_DRIVER_CAPABILITIES to include compute" in caught.value.detail
    assert "display driver" in caught.value.detail  # cuda-pathfinder's own words kept


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (CUresult.CUDA_ERROR_NO_DEVICE, "no_gpu"),
        (CUresult.CUDA_ERROR_STUB_LIBRARY, "cuda_missing"),
    ],
)
def test_cuinit_results_that_rule_cuda_out_are_bounded_reasons(result: CUresult,
                                                               reason: str) -> None:
    cuda, lib = driver_for(0)
    lib.driver.init_results = [result]

    with pytest.raises(SourceUnavailable) as caught:
        cuda.init()

    assert caught.value.reason == reason
    assert caught.value.detail == f"cuInit failed: {result.name} ({int(result)})"


def test_other_results_are_hardware_errors_and_init_can_be_asked_again() -> None:
    cuda, lib = driver_for(0)
    lib.driver.init_results = [CUresult.CUDA_ERROR_UNKNOWN]

    with pytest.raises(HardwareError) as caught:
        cuda.init()
    assert not isinstance(caught.value, SourceUnavailable)

    cuda.init()
    assert lib.driver.initialised


def test_retaining_a_device_cuda_does_not_know_is_no_gpu() -> None:
    cuda, lib = driver_for(0)

    with pytest.raises(SourceUnavailable) as caught:
        cuda.retain_primary_context(5)

    assert caught.value.reason == "no_gpu" and "cuDeviceGet" in caught.value.detail
    assert lib.driver.retained == {}


def test_without_cuda_bindings_init_is_cuda_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # `import` fails

    with pytest.raises(SourceUnavailable) as caught:
        CudaDriver().init()

    assert caught.value.reason == "cuda_missing" and "cupti-python" in caught.value.detail
    assert caught.value.detail.endswith("(install mrc-agent[profiling])")


def test_a_failed_call_names_the_call_and_the_result() -> None:
    cuda, lib = driver_for(0)
    lib.driver.init_results = [CUresult.CUDA_ERROR_UNKNOWN]

    with pytest.raises(HardwareError) as caught:
        cuda.init()

    assert str(caught.value) == "cuInit failed: CUDA_ERROR_UNKNOWN (999)"


def test_a_refused_device_names_cudeviceget_exactly() -> None:
    cuda, _ = driver_for(0)

    with pytest.raises(SourceUnavailable) as caught:
        cuda.retain_primary_context(5)

    assert caught.value.detail == "cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE (101)"


@pytest.mark.parametrize(
    ("call", "result", "error"),
    [
        ("cuDevicePrimaryCtxRetain", CUresult.CUDA_ERROR_OUT_OF_MEMORY, HardwareError),
        ("cuDevicePrimaryCtxRetain", CUresult.CUDA_ERROR_NO_DEVICE, SourceUnavailable),
        ("cuCtxSetCurrent", CUresult.CUDA_ERROR_INVALID_CONTEXT, HardwareError),
        ("cuCtxSetCurrent", CUresult.CUDA_ERROR_NO_DEVICE, SourceUnavailable),
    ],
)
def test_a_failed_retain_names_the_call_and_holds_no_context(
    call: str, result: CUresult, error: type[HardwareError]
) -> None:
    cuda, lib = driver_for(0, 1)
    lib.driver.errors = {call: [result]}

    with pytest.raises(HardwareError) as caught:
        cuda.retain_primary_context(1)

    assert type(caught.value) is error  # a bounded reason only where the result means one
    assert str(caught.value).endswith(f"{call} failed: {result.name} ({int(result)})")
    # A context retained before cuCtxSetCurrent failed is given back at once.
    assert lib.driver.retained == {} and cuda.retained == ()


def test_retaining_logs_that_the_context_holds_device_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cuda, _ = driver_for(0, 1)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        cuda.retain_primary_context(1)

    [message] = [r.getMessage() for r in caplog.records]
    assert "retained the CUDA primary context of GPU 1 for CUPTI" in message
    assert "holds device memory until the agent stops" in message


def test_a_failed_release_is_logged_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    cuda, lib = driver_for(0)
    cuda.retain_primary_context(0)
    lib.driver.retained.clear()  # the driver no longer knows the context

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cuda.close()

    [message] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert message.startswith("releasing the CUDA primary context of GPU 0 failed: ")
    assert message.endswith("cuDevicePrimaryCtxRelease failed: CUDA_ERROR_INVALID_CONTEXT (201)")
    assert cuda.retained == ()


def test_releasing_a_context_never_retained_asks_the_driver_nothing() -> None:
    cuda, lib = driver_for(0)

    cuda.release_primary_context(0)

    assert lib.driver.calls == []


def test_a_runtime_error_from_a_driver_call_is_a_hardware_error_naming_it() -> None:
    cuda, lib = driver_for(0)
    lib.driver.errors = {"cuInit": [RuntimeError("driver shutting down")]}

    with pytest.raises(HardwareError) as caught:
        cuda.init()

    assert not isinstance(caught.value, SourceUnavailable)
    assert str(caught.value) == "cuInit: driver shutting down"


def test_without_a_module_cuda_bindings_driver_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lib = FakeCupti({0: FakeDevice()})
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", lib.driver)

    CudaDriver().init()

    assert lib.driver.calls == ["cuInit"] and lib.driver.initialised
