"""The CUDA driver adapter against a fake ``cuda.bindings.driver`` module."""

from __future__ import annotations

import logging
import sys

import pytest

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver, format_uuid
from mrc_agent.agent.tools.simgpu.cupti import CUresult, CUuuid, FakeCupti, FakeDevice, fake_uuid

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


# -- CUDA ordinals by UUID ----------------------------------------------------------------------


def test_format_uuid_writes_the_16_bytes_as_nvml_writes_a_gpu_uuid() -> None:
    raw = bytes.fromhex("5e1c8f2a0b3d4e6f8091a2b3c4d5e6f7")

    assert format_uuid(raw) == "GPU-5e1c8f2a-0b3d-4e6f-8091-a2b3c4d5e6f7"
    with pytest.raises(HardwareError):
        format_uuid(raw[:15])


def test_ordinals_map_each_cuda_device_by_its_uuid_once() -> None:
    lib = FakeCupti({0: FakeDevice(uuid=fake_uuid(5)), 1: FakeDevice()})
    cuda = CudaDriver(lib.driver)

    assert cuda.ordinals() == {fake_uuid(5): 0, fake_uuid(1): 1}
    assert cuda.ordinals() == {fake_uuid(5): 0, fake_uuid(1): 1}
    assert lib.driver.calls == ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid",
                                "cuDeviceGet", "cuDeviceGetUuid"]


def test_ordinals_prefer_cudevicegetuuid_v2_which_names_mig_instances() -> None:
    lib = FakeCupti({0: FakeDevice()})
    mig = "MIG-8c7d1f2e-3a4b-5c6d-7e8f-90a1b2c3d4e5"

    def v2(dev: int) -> tuple[CUresult, CUuuid]:
        lib.driver.calls.append("cuDeviceGetUuid_v2")
        return (CUresult.CUDA_SUCCESS, CUuuid(bytes.fromhex(mig[4:].replace("-", ""))))

    lib.driver.cuDeviceGetUuid_v2 = v2  # type: ignore[attr-defined]  # cuda-bindings 12.x

    assert list(CudaDriver(lib.driver).ordinals()) == ["GPU-" + mig[4:]]
    assert "cuDeviceGetUuid_v2" in lib.driver.calls and "cuDeviceGetUuid" not in lib.driver.calls


def test_a_failing_uuid_query_is_a_hardware_error_tried_again_later() -> None:
    lib = FakeCupti({0: FakeDevice()})
    lib.driver.errors["cuDeviceGetUuid"] = [CUresult.CUDA_ERROR_UNKNOWN]
    cuda = CudaDriver(lib.driver)

    with pytest.raises(HardwareError) as caught:
        cuda.ordinals()

    assert not isinstance(caught.value, SourceUnavailable)
    assert "cuDeviceGetUuid failed: CUDA_ERROR_UNKNOWN" in str(caught.value)
    assert cuda.ordinals() == {fake_uuid(0): 0}
