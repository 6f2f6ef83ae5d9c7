"""The CUDA driver adapter against a fake ``cuda.bindings.driver`` module."""

from __future__ import annotations

import sys

import pytest

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from tests.fakes.fake_cupti import CUresult, FakeCupti, FakeDevice


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

    assert caught.value.reason == reason and result.name in caught.value.detail


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
