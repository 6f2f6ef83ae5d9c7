"""The service's measurements at the CUDA boundary, on the CPU: stage ends and peak memory.

There is no GPU on CI, so ``FakeCuda`` stands in for ``torch.cuda`` where
``reference_service/device.py`` calls it, and only there: a device whose queued work runs only
when something waits for it (taking ``WORK_S``), and whose allocator peak the test sets. The
decode, the resize code and the request bookkeeping are the real ones; the resize runs on the
CPU and then tells the fake device it left work queued, as a kornia resize on CUDA does.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import pytest
import torch
from PIL import Image

from mrc_agent.reference_service import preprocess as P
from mrc_agent.reference_service.device import (
    DeviceUsers,
    peak_memory,
    wait_for_queued_work,
)
from mrc_agent.reference_service.preprocess import core
from mrc_agent.reference_service.settings import Settings
from tests.unit.test_preprocess_units import jpeg

HALF = (0.5, 0.5, 0.5)
#: How long the fake device takes to run the work queued on it; the preprocess stage must
#: include it. Far above what a 40x30 resize costs once kornia is imported (under 10 ms), so
#: a stage stamped before the wait cannot reach it by accident.
WORK_S = 0.25


class _FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self._cuda = cuda

    def synchronize(self) -> None:
        if self._cuda.pending:
            time.sleep(WORK_S)  # the queued kernels run now, and only now
        self._cuda.calls.append(("synchronize", self._cuda.pending))
        self._cuda.pending = []


class _FakeStream:
    def __init__(self, cuda: FakeCuda) -> None:
        self._cuda = cuda

    def record_event(self) -> _FakeEvent:
        self._cuda.calls.append(("record_event", None))
        return _FakeEvent(self._cuda)


class FakeCuda:
    """``torch.cuda`` as :mod:`mrc_agent.reference_service.device` sees it, recording every call."""

    def __init__(self, peak: int = 0) -> None:
        self.calls: list[tuple[str, object]] = []
        #: Work queued on the device that has not run yet.
        self.pending: list[str] = []
        self.peak = peak

    def current_stream(self, device: torch.device) -> _FakeStream:
        self.calls.append(("current_stream", device))
        return _FakeStream(self)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.calls.append(("reset_peak_memory_stats", device))

    def max_memory_allocated(self, device: torch.device) -> int:
        self.calls.append(("max_memory_allocated", device))
        return self.peak


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """A fake device; both resize paths run on the CPU, then leave "resize" queued on it."""
    # kornia's first import takes about WORK_S itself: done here, it cannot pass for the wait.
    P.kornia_resize(torch.zeros(1, 1, 4, 4), (2, 2))
    fake = FakeCuda()

    def on_device(real: Callable[..., tuple[torch.Tensor, Image.Image | None]]
                  ) -> Callable[..., tuple[torch.Tensor, Image.Image | None]]:
        def resize(dec: object, target_hw: object, mean: object, std: object, device: str,
                   ocr_max_side: object) -> tuple[torch.Tensor, Image.Image | None]:
            out = real(dec, target_hw, mean, std, "cpu", ocr_max_side)
            if device.startswith("cuda"):
                fake.pending.append("resize")
            return out
        return resize

    monkeypatch.setattr(core, "_resize_pil", on_device(core._resize_pil))
    monkeypatch.setattr(core, "_resize_kornia", on_device(core._resize_kornia))
    return fake


# -- stage boundary: the preprocess stage ends after the device ran its work ----------------

@pytest.mark.parametrize("ocr_max_side", [None, 20], ids=["ocr-off", "ocr-on"])
@pytest.mark.parametrize("backend", ["auto", "pil"])
def test_preprocess_stage_ends_only_after_the_device_ran_the_resize(
        cuda: FakeCuda, ocr_max_side: int | None, backend: P.ResizeBackend) -> None:
    wait = functools.partial(wait_for_queued_work, cuda=cuda)
    pre = P.preprocess(jpeg(), (8, 8), HALF, HALF, "cuda:1", ocr_max_side, Settings(),
                       resize_backend=backend, wait=wait)
    # One event on the stream of the request's device, waited on with the resize still queued.
    assert cuda.calls == [("current_stream", torch.device("cuda:1")), ("record_event", None),
                          ("synchronize", ["resize"])]
    assert cuda.pending == []
    # The stage's end was stamped after that wait: it holds the device's WORK_S.
    assert pre.preprocess_s >= WORK_S
    assert tuple(pre.pixel_values.shape) == (1, 3, 8, 8)
    assert (pre.ocr_image is None) == (ocr_max_side is None)


@pytest.mark.parametrize("backend", ["auto", "kornia"])
def test_preprocess_on_the_cpu_touches_no_cuda(cuda: FakeCuda, backend: P.ResizeBackend) -> None:
    wait = functools.partial(wait_for_queued_work, cuda=cuda)
    pre = P.preprocess(jpeg(), (8, 8), HALF, HALF, "cpu", 20, Settings(),
                       resize_backend=backend, wait=wait)
    assert cuda.calls == []
    assert pre.preprocess_s < WORK_S


def test_waiting_syncs_an_event_on_the_current_stream_not_the_whole_device() -> None:
    fake = FakeCuda()
    wait_for_queued_work("cuda", cuda=fake)
    wait_for_queued_work(torch.device("cuda", 3), cuda=fake)
    wait_for_queued_work("cpu", cuda=fake)
    assert [name for name, _ in fake.calls] == ["current_stream", "record_event", "synchronize"] * 2
    assert [arg for name, arg in fake.calls if name == "current_stream"] == [
        torch.device("cuda"), torch.device("cuda", 3)]


# -- peak memory: process-wide, with the requests that shared the device -------------------

def test_peak_is_read_around_the_block_and_alone_means_shared_with_zero() -> None:
    fake, users = FakeCuda(peak=5 * 2**30), DeviceUsers()
    with users.occupy() as me, peak_memory("cuda:0", users, me, fake) as reading:
        fake.calls.append(("generate", None))
        assert reading.nbytes is None  # filled only once the block is over
    dev = torch.device("cuda:0")
    assert fake.calls == [("reset_peak_memory_stats", dev), ("generate", None),
                          ("max_memory_allocated", dev)]
    assert (reading.nbytes, reading.shared_with) == (5 * 2**30, 0)
    assert users.count == 0


def test_shared_with_counts_every_other_request_on_the_device_during_the_window() -> None:
    fake, users = FakeCuda(peak=1), DeviceUsers()
    with users.occupy():  # came and went before the window: its memory is not in the peak
        pass
    with users.occupy(), users.occupy() as me:  # one other request there when it opens
        with peak_memory("cuda", users, me, fake) as reading:
            # Another request starts preprocessing (on the event loop's side) and finishes
            # before the generation does: its memory was in the peak all the same.
            entered = threading.Event()

            def brief_request() -> None:
                with users.occupy():
                    entered.set()

            t = threading.Thread(target=brief_request)
            t.start()
            t.join()
            assert entered.is_set()
        with users.occupy():  # arrives after the reading: not counted
            pass
    assert reading.shared_with == 2
    assert users.count == 0


def test_warmup_without_a_token_counts_everyone_and_errors_release_the_device() -> None:
    fake, users = FakeCuda(peak=7), DeviceUsers()
    with pytest.raises(RuntimeError), users.occupy():
        raise RuntimeError("generation failed")
    assert users.count == 0  # a failed request does not stay "on the device"
    with users.occupy(), peak_memory("cuda:0", users, None, fake) as reading:
        pass
    assert (reading.nbytes, reading.shared_with) == (7, 1)


def test_peak_memory_on_the_cpu_reads_nothing() -> None:
    fake, users = FakeCuda(peak=7), DeviceUsers()
    with users.occupy() as me, users.occupy(), peak_memory("cpu", users, me, fake) as reading:
        pass
    assert (reading.nbytes, reading.shared_with) == (None, None)
    assert fake.calls == []
