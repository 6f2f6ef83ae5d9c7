"""MIG in the trace format and in GPM: rows are keyed by UUID (a MIG device shares its parent
GPU's index), and GPM of a MIG device is said to be its GPU instance's, not its own.

Everything below the NVML adapter is the hand-written fake (agent/tools/simgpu/nvml.py):
a MIG device is a compute instance, and ``nvmlGpmMigSampleGet`` takes only a GPU instance id.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.attribution import Attribution
from mrc_agent.agent.core.collectors.gpm import GPM_SCOPE_INFO, METRICS, GpmCollector
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.replay import (
    FORMAT_VERSION,
    ReplayBackend,
    ReplayFormatError,
    load_trace,
)
from mrc_agent.agent.core.hw.sources import Sources
from mrc_agent.agent.tools.record import record
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu, mig_device
from mrc_agent.agent.tools.tracegen import write_trace
from tests.support import pass_view

SM = pynvml.NVML_GPM_METRIC_SM_UTIL
PARENT = "GPU-00000000-fake-uuid"
MIG_A, MIG_B = "MIG-aaaaaaaa-fake-mig-uuid", "MIG-bbbbbbbb-fake-mig-uuid"


def two_slices(same_instance: bool = False) -> FakeNvml:
    """GPU 0 in MIG mode with two MIG devices: on GPU instances 1 and 2, or both on 1 (two
    compute instances of one GPU instance)."""
    second = 1 if same_instance else 2
    return FakeNvml([gpu(index=0, gpm={SM: 90.0}, mig=[
        mig_device(1, uuid=MIG_A, gpm={SM: 30.0}),
        mig_device(second, uuid=MIG_B, gpm={SM: 60.0}),
    ])])


def nvml(fake: FakeNvml, clock: list[float]) -> NvmlBackend:
    return NvmlBackend(lib=fake, clock=lambda: clock[0], wall_clock=lambda: 1.7e9 + clock[0],
                       pcie_thread=False, gpm_interval=0.25)


def recorded(fake: FakeNvml) -> list[dict[str, Any]]:
    clock = [100.0]

    def sleep(seconds: float) -> None:
        clock[0] += max(seconds, 0.05)

    backend = nvml(fake, clock)
    out = io.StringIO()
    record(Sources(device=backend, gpm=backend), out, duration=1.0, interval=0.25,
           clock=lambda: clock[0], sleep=sleep)
    backend.close()
    header, *rows = (json.loads(line) for line in out.getvalue().splitlines())
    assert header == {"version": FORMAT_VERSION}
    return rows


def write(tmp_path: Path, rows: list[dict[str, Any]]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- record -------------------------------------------------------------------------------


def test_record_keeps_a_row_for_the_parent_and_for_each_mig_slice() -> None:
    rows = recorded(two_slices())
    ticks = sorted({r["t"] for r in rows})
    assert len(ticks) == 5
    for t in ticks:
        at = [r for r in rows if r["t"] == t]
        assert [(r["gpu"], r["uuid"]) for r in at] == [(0, PARENT), (0, MIG_A), (0, MIG_B)]
    parent, a, b = rows[-3:]
    assert "power_watts" in parent and "sm_util" not in parent  # MIG mode: GPM per instance
    assert a["mem_total_bytes"] == 18 * 2**30 and a["name"].endswith("MIG GI 1")
    assert a["sm_util"] == pytest.approx(0.3) and a["gpu_instance"] == 1
    assert b["sm_util"] == pytest.approx(0.6) and b["gpu_instance"] == 2
    assert "gpu_instance" not in parent


# --- replay -------------------------------------------------------------------------------


def test_a_recorded_mig_trace_replays_each_row_under_its_own_uuid(tmp_path: Path) -> None:
    path = write(tmp_path, recorded(two_slices()))
    clock = [0.0]
    backend = ReplayBackend(path, clock=lambda: clock[0])
    assert [(i.index, i.uuid) for i in backend.identities] == [
        (0, PARENT), (0, MIG_A), (0, MIG_B)]
    clock[0] = backend.period - 0.01  # the last tick: every row has GPM by then
    devices = backend.sample_devices()
    assert [s.gpu.uuid for s in devices] == [PARENT, MIG_A, MIG_B]
    assert devices[0].power_watts is not None and devices[1].power_watts is None
    assert devices[1].mem_total_bytes == 18 * 2**30
    gpm = {s.gpu.uuid: s for s in backend.sample_gpm()}
    assert set(gpm) == {MIG_A, MIG_B}
    assert gpm[MIG_A].sm_util == pytest.approx(0.3) and gpm[MIG_A].gpu_instance == 1
    assert gpm[MIG_B].sm_util == pytest.approx(0.6) and gpm[MIG_B].gpu_instance == 2


def test_util_points_and_process_lists_are_kept_per_uuid(tmp_path: Path) -> None:
    rows = []
    for i in range(4):
        rows.append({"t": i * 0.5, "gpu": 0, "uuid": PARENT, "gpu_util": 1.0,
                     "processes": {"10": 1.0}})
        rows.append({"t": i * 0.5, "gpu": 0, "uuid": MIG_A, "mem_used_bytes": float(i),
                     "processes": {"20": 2.0}})
    clock = [0.0]
    backend = ReplayBackend(write(tmp_path, rows), clock=lambda: clock[0])
    clock[0] = 1.2
    parent, mig = backend.sample_devices()
    assert [u for _, u in parent.util_samples] == [1.0] and mig.util_samples == []
    assert parent.process_memory_bytes == {10: 1.0} and mig.process_memory_bytes == {20: 2.0}
    assert mig.mem_used_bytes == 2.0


@pytest.mark.parametrize(
    ("rows", "line", "reason"),
    [
        # One UUID twice at one time: which row is the device's is not said.
        ([{"t": 0, "gpu": 0, "uuid": MIG_A}, {"t": 0, "gpu": 0, "uuid": MIG_B},
          {"t": 0, "gpu": 0, "uuid": MIG_A}], 3, "two rows for uuid"),
        # One GPU index holds one whole GPU; only MIG devices share it.
        ([{"t": 0, "gpu": 0, "uuid": "GPU-a"}, {"t": 0, "gpu": 0, "uuid": "GPU-b"}], 2,
         "changed uuid"),
        # A device does not move to another GPU.
        ([{"t": 0, "gpu": 0, "uuid": MIG_A}, {"t": 1, "gpu": 1, "uuid": MIG_A}], 2, "moved"),
        ([{"t": 0, "gpu": 0, "uuid": MIG_A, "gpu_instance": -1}], 1, "'gpu_instance'"),
        ([{"t": 0, "gpu": 0, "uuid": MIG_A, "gpu_instance": 1},
          {"t": 1, "gpu": 0, "uuid": MIG_A, "gpu_instance": 2}], 2, "gpu_instance"),
        ([{"t": 0, "gpu": 0, "uuid": "GPU-a", "gpu_instance": 1}], 1, "MIG"),
        ([{"t": 1, "gpu": 0, "uuid": MIG_A}, {"t": 1, "gpu": 0, "uuid": PARENT},
          {"t": 0.5, "gpu": 0, "uuid": MIG_A}], 3, "goes backwards"),
    ],
)
def test_a_bad_mig_trace_names_the_line(tmp_path: Path, rows: list[dict[str, Any]], line: int,
                                        reason: str) -> None:
    path = write(tmp_path, rows)
    with pytest.raises(ReplayFormatError) as err:
        load_trace(path)
    assert f"{path}:{line}:" in str(err.value) and reason in str(err.value)


def test_the_committed_traces_still_load_one_device_per_index() -> None:
    from tests.conftest import DATA, REPO

    for path in (DATA / "fixed_device.jsonl",
                 REPO / "agent" / "tools" / "data" / "demo_starved.jsonl"):
        backend = ReplayBackend(str(path), clock=lambda: 0.0)
        ids = backend.identities
        assert ids and [i.index for i in ids] == list(range(len(ids)))
        assert not any(i.is_mig for i in ids)


def test_tracegen_writes_mig_slices_that_replay(tmp_path: Path) -> None:
    out = io.StringIO()
    lines = write_trace(out, gpus=2, duration=1.0, step=0.5, mig=2)
    assert lines == 2 * 2 * 3  # two steps, two GPUs, each itself and two slices
    path = tmp_path / "mig.jsonl"
    path.write_text(out.getvalue())
    now = [0.0]
    backend = ReplayBackend(str(path), clock=lambda: now[0])
    ids = backend.identities
    assert [i.index for i in ids] == [0, 0, 0, 1, 1, 1]
    assert len({i.uuid for i in ids}) == 6 and sum(i.is_mig for i in ids) == 4
    now[0] = 0.5  # GPM is a window between two samples: the trace's first row has none
    assert {s.gpu_instance for s in backend.sample_gpm()} == {1, 2}


# --- GPM of a MIG device is its GPU instance's ---------------------------------------------


def gpm_windows(fake: FakeNvml) -> list[Any]:
    clock = [0.0]
    backend = nvml(fake, clock)
    assert backend.sample_gpm() == []  # primes
    clock[0] = 1.0
    samples = backend.sample_gpm()
    backend.close()
    return samples


def test_two_compute_instances_of_one_gpu_instance_share_one_gpm_sample() -> None:
    fake = two_slices(same_instance=True)
    a, b = gpm_windows(fake)
    assert (a.gpu.uuid, b.gpu.uuid) == (MIG_A, MIG_B)
    # nvmlGpmMigSampleGet takes a GPU instance id only: the numbers are GPU instance 1's.
    assert a.gpu_instance == b.gpu_instance == 1
    assert a.sm_util == b.sm_util == pytest.approx(0.3)
    # Sampled once per GPU instance per window (prime + one window), not once per MIG device.
    assert fake.calls["nvmlGpmMigSampleGet"] == 2
    assert fake.calls["nvmlGpmSampleFree"] == 2


def test_gpm_of_mig_devices_is_labelled_gpu_instance_scoped() -> None:
    samples = gpm_windows(two_slices(same_instance=True))

    class Source:
        def sample_gpm(self) -> list[Any]:
            return samples

    out = GpmCollector(Source()).update(pass_view(wall=1.7e9)).samples
    scope = [labels for name, labels, _ in out if name == GPM_SCOPE_INFO.name]
    name = "NVIDIA H100 80GB HBM3 MIG GI 1"
    assert scope == [("0", MIG_A, name, "gpu_instance", "1"),
                     ("0", MIG_B, name, "gpu_instance", "1")]
    assert GPM_SCOPE_INFO.labels[-2:] == ("scope", "gpu_instance")
    # The GPU instance's values once, under its first compute instance: not again under MIG_B.
    assert [(labels[1], v) for n, labels, v in out if n == "mrc_gpu_sm_active_ratio"] == [
        (MIG_A, pytest.approx(0.3))]


def _gpm_series(samples: list[Any], watched: set[str] | None = None) -> dict[str, list]:
    """The GPM collector's samples of ``samples`` by family, watching the MIG devices
    ``watched`` (all of them when None), each as (uuid, value)."""

    class Source:
        def sample_gpm(self) -> list[Any]:
            return samples

    gpus = {s.gpu: frozenset({"test"}) for s in samples
            if watched is None or s.gpu.uuid in watched}
    view = pass_view(wall=1.7e9, outputs=[Attribution("test", gpus)])
    out: dict[str, list] = {}
    for name, labels, value in GpmCollector(Source()).update(view).samples:
        out.setdefault(name, []).append((labels[1], value))
    return out


def test_gpm_of_a_gpu_instance_is_exported_once_whatever_its_compute_instances() -> None:
    """Every GPM value of a MIG device is its GPU instance's (nvmlGpmMigSampleGet takes a GPU
    instance id): a GPU instance with two compute instances gives one series per family, two
    GPU instances give one each, and a pod given only the second compute instance still sees
    its GPU instance's values, under that one's uuid."""
    shared = gpm_windows(two_slices(same_instance=True))
    fams = _gpm_series(shared)
    gpm_families = [m.name for m in METRICS if m is not GPM_SCOPE_INFO]
    for family in gpm_families:
        assert len(fams.get(family, [])) <= 1, (family, fams.get(family))
    assert fams["mrc_gpu_sm_active_ratio"] == [(MIG_A, pytest.approx(0.3))]
    assert sum(v for _, v in fams["mrc_gpu_sm_active_ratio"]) == pytest.approx(0.3)
    assert [u for u, _ in fams[GPM_SCOPE_INFO.name]] == [MIG_A, MIG_B]

    apart = _gpm_series(gpm_windows(two_slices(same_instance=False)))
    assert apart["mrc_gpu_sm_active_ratio"] == [(MIG_A, pytest.approx(0.3)),
                                                (MIG_B, pytest.approx(0.6))]

    only_b = _gpm_series(shared, watched={MIG_B})
    assert only_b["mrc_gpu_sm_active_ratio"] == [(MIG_B, pytest.approx(0.3))]
    assert [u for u, _ in only_b[GPM_SCOPE_INFO.name]] == [MIG_B]


def test_a_whole_gpu_has_no_scope_series() -> None:
    fake = FakeNvml([gpu(index=0, gpm={SM: 90.0})])
    (whole,) = gpm_windows(fake)
    assert whole.gpu_instance is None

    class Source:
        def sample_gpm(self) -> list[Any]:
            return [whole]

    out = GpmCollector(Source()).update(pass_view(wall=1.7e9)).samples
    assert [n for n, _, _ in out if n == GPM_SCOPE_INFO.name] == []


def test_one_rule_tells_a_mig_device_in_any_case() -> None:
    """Attribution and the collectors ask the same property; NVML's UUIDs are upper case, a
    configuration or a container runtime may write them lower."""
    from mrc_agent.agent.core.hw.base import GPUIdentity

    for uuid, mig in (("MIG-4e9c", True), ("mig-4e9c", True), ("Mig-4e9c", True),
                      ("GPU-4e9c", False), ("gpu-mig-4e9c", False), ("MIG", False)):
        assert GPUIdentity(0, uuid, "NVIDIA H200").is_mig is mig, uuid
