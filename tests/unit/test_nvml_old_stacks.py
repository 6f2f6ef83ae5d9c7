"""Older drivers under both nvidia-ml-py versions the project declares, each on that version's
real module: 13.615 (installed) and 12.535 (its wheel, as .ci/run downloads it).

* A driver without the ``_v3`` process-list entry points: 12.535's unversioned call raises
  ``NVMLError_FunctionNotFound``, 13.x's ``throwOnVersionMismatch`` turns that into
  ``NVMLLibraryMismatchError``, which is not an ``NVMLError``. Under 13.x the ``_v2`` call
  serves the GPU; 12.535 has none, so per-process memory is absent. Either way the pass goes
  on and the missing call is remembered.
* An NVLink all-links scope answered with something other than NOT_SUPPORTED (a driver older
  than the scope takes UINT_MAX for a link index): the per-link reads serve the GPU, it is
  said once, and no pass fails for it. A lost GPU still fails the pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw.base import HardwareError
from mrc_agent.agent.tools.simgpu import nvml as fake_pynvml
from tests.nvml_support import backend, load_fake_for
from tests.unit.test_nvml_truth import _load_old_pynvml

LOGGER = "mrc_agent.agent.core.hw.nvml"
UUID0 = "GPU-00000000-fake-uuid"


@pytest.fixture(params=["13.615", "12.535"])
def version(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """(the real pynvml module of that version, the fake built on it)."""
    if request.param == "13.615":
        yield pynvml, fake_pynvml
    else:
        old = _load_old_pynvml()
        yield old, load_fake_for(old)


def test_a_driver_without_v3_process_lists_is_served_by_v2_through_the_real_call(
    version: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    module, fake_mod = version

    def entry_point(name: str) -> Any:
        if name.endswith("_v3"):  # what a driver without the entry point answers
            raise module.NVMLError(module.NVML_ERROR_FUNCTION_NOT_FOUND)
        raise AssertionError(f"unexpected entry point {name}")

    monkeypatch.setattr(module, "_nvmlGetFunctionPointer", entry_point)

    class OldDriver(fake_mod.FakeNvml):  # type: ignore[misc,name-defined]
        def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
            self._gpu("nvmlDeviceGetComputeRunningProcesses", handle)
            # The library's own unversioned call, with what it raises for a missing _v3.
            result: list[Any] = module.nvmlDeviceGetComputeRunningProcesses(handle)
            return result

        def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
            result: list[Any] = self._processes(
                "nvmlDeviceGetComputeRunningProcesses_v2", handle, "compute_processes")
            return result

    fake = OldDriver([fake_mod.gpu(compute_processes=[(4242, 3 * 2**30)])])
    b = backend(fake)
    for _ in range(2):
        [s] = b.sample_devices()
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1  # remembered, not retried
    if hasattr(module, "nvmlDeviceGetComputeRunningProcesses_v2"):
        assert s.process_memory_bytes == {4242: 3 * 2**30}
        assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2
    else:  # 12.535 has no _v2 call: the per-process memory is absent, the rest of the GPU not
        assert s.process_memory_bytes == {} and s.mem_used_bytes is not None
    assert "compute_processes" in b.info()["gpus"][0]["unsupported"]


@pytest.mark.parametrize("code_name", ["NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_UNKNOWN"])
def test_an_aggregate_scope_refused_otherwise_falls_back_to_the_links(
    version: tuple[Any, Any], code_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    module, fake_mod = version
    code = getattr(module, code_name)
    fake = fake_mod.FakeNvml([fake_mod.gpu(
        nvlink={0: fake_mod.nvlink(1, 2), 1: fake_mod.nvlink(3, 4)},
        nvlink_aggregate_scope=code)])
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            [s] = b.sample_devices()
    assert s.sources["nvlink"] == "per_link_sum"
    assert (s.nvlink_tx_bytes_total, s.nvlink_rx_bytes_total) == (4 * 1024, 6 * 1024)
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if "all-links scope" in r.getMessage()]
    assert said == [("WARNING", f"GPU 0 ({UUID0}): the NVLink all-links scope answered "
                     f"{module.NVMLError(code)} (code {code}); totals from the per-link reads")]


def test_a_lost_gpu_on_the_aggregate_scope_still_fails_the_pass(
    version: tuple[Any, Any],
) -> None:
    module, fake_mod = version
    fake = fake_mod.FakeNvml([fake_mod.gpu(
        nvlink={0: fake_mod.nvlink(1, 2)}, nvlink_aggregate_scope=module.NVML_ERROR_GPU_IS_LOST)])
    with pytest.raises(HardwareError):
        backend(fake).sample_devices()
