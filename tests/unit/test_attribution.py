"""Per-pod GPU attribution (agent/core/attribution.py) on its own and through the collectors:
how NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES are read against the node's GPUs, how the
sources combine per target and over targets, the fallback when nobody says, what /proc gives
(small trees under ``tmp_path``), and what the gpu, gpm, profiling and derived collectors and
the exported series make of the decision. The live end-to-end checks are in
``test_attribution_e2e.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from mrc_agent.agent.core import attribution as att
from mrc_agent.agent.core.attribution import (
    Attribution,
    TargetView,
    container_devices,
    decide,
    environ_gpus,
    explain,
    read_view,
)
from mrc_agent.agent.core.catalog import CATALOG
from mrc_agent.agent.core.collectors import FINISHERS, PASS_FINISHERS
from mrc_agent.agent.core.collectors import gpu as gpu_collector
from mrc_agent.agent.core.collectors.base import BuildContext, PassView, Processes, TargetState
from mrc_agent.agent.core.collectors.derived import DerivedCollector
from mrc_agent.agent.core.collectors.gpm import GpmCollector
from mrc_agent.agent.core.collectors.gpu import GpuCollector, GpuReadings
from mrc_agent.agent.core.collectors.process import ProcessCollector
from mrc_agent.agent.core.collectors.profiling import ProfilingCollector
from mrc_agent.agent.core.config import ConfigError, load
from mrc_agent.agent.core.hw import procfs
from mrc_agent.agent.core.hw.base import DeviceSample, GpmSample, GPUIdentity, ProfilingSample
from mrc_agent.agent.core.hw.procfs import ProcFS
from mrc_agent.agent.core.hw.replay import ReplayBackend, ReplayFormatError, load_trace
from mrc_agent.agent.core.hw.sources import Sources
from tests.support import pass_view, published, run_pass
from tests.unit.test_procfs import stat_line

NAME = "NVIDIA H200"
UUIDS = ("GPU-8f2a0c1e-1111-2222-3333-444444444444", "GPU-8f2b9d00-1111-2222-3333-444444444444",
         "GPU-12345678-aaaa-bbbb-cccc-dddddddddddd", "GPU-5e1c0000-aaaa-bbbb-cccc-dddddddddddd")
GPUS = [GPUIdentity(i, u, NAME) for i, u in enumerate(UUIDS)]
NV, CUDA = "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"


def _indices(gpus: set[GPUIdentity] | None) -> set[int] | None:
    return None if gpus is None else {g.index for g in gpus}


# --- the variables -------------------------------------------------------------------------------

@pytest.mark.parametrize(("environ", "usable", "container"), [
    ({}, None, None),
    ({"PATH": "/bin"}, None, None),
    ({NV: "all"}, {0, 1, 2, 3}, {0, 1, 2, 3}),
    ({NV: "ALL"}, {0, 1, 2, 3}, {0, 1, 2, 3}),
    ({NV: "none"}, set(), set()),
    ({NV: "void"}, set(), set()),
    ({NV: ""}, set(), set()),
    ({NV: UUIDS[2]}, {2}, {2}),
    ({NV: UUIDS[2].upper()}, {2}, {2}),
    ({NV: "2,0"}, {0, 2}, {0, 2}),
    ({NV: f" {UUIDS[1]} , GPU-not-on-this-node"}, {1}, {1}),
    # Names nothing of this node: no information (the volume-mounts strategy's path, a typo).
    ({NV: "/var/run/nvidia-container-devices"}, None, None),
    ({NV: "GPU-not-on-this-node"}, None, None),
    ({NV: "7"}, None, None),
    # MIG: the old form and <gpu>:<mig> name the parent; the new form does not.
    ({NV: f"MIG-{UUIDS[3]}/1/0"}, {3}, {3}),
    ({NV: "1:0,1:1"}, {1}, {1}),
    ({NV: "MIG-c0ffee00-1111-2222-3333-444444444444"}, None, None),
    ({NV: "MIG-GPU-00000000-0000-0000-0000-000000000000/1/0"}, None, None),  # not this node's
    ({NV: "7:0"}, None, None),
    # Only <index>:<index> is the <gpu>:<mig> form; whitespace and empty entries name nothing.
    ({NV: "1:a"}, None, None),
    ({NV: "a:1"}, None, None),
    ({NV: "1:0:0"}, None, None),
    ({NV: " 2 ,, 3 "}, {2, 3}, {2, 3}),
    # A device of another node, in any form, leaves the indices countable.
    ({NV: "7:0,2,3", CUDA: "1"}, {3}, {2, 3}),
    ({NV: "MIG-GPU-00000000-0000-0000-0000-000000000000/1/0,2,3", CUDA: "1"}, {3}, {2, 3}),
    # CUDA indices count the container's devices, in PCI (NVML index) order.
    ({NV: "2,3", CUDA: "1"}, {3}, {2, 3}),
    ({NV: "3,1", CUDA: "0"}, {1}, {1, 3}),
    ({NV: "1,2,3", CUDA: "2,0"}, {1, 3}, {1, 2, 3}),
    # ...and end at the first entry that names no device.
    ({NV: "2,3", CUDA: "1,5,0"}, {3}, {2, 3}),
    ({NV: "2,3", CUDA: "-1"}, set(), {2, 3}),
    ({NV: "2,3", CUDA: "NoDevFiles"}, set(), {2, 3}),
    ({NV: "2,3", CUDA: ""}, set(), {2, 3}),
    ({NV: "none", CUDA: "0"}, set(), set()),
    # UUID prefixes, unique within the container.
    ({NV: "all", CUDA: "GPU-8f2a"}, {0}, {0, 1, 2, 3}),
    ({NV: "all", CUDA: "GPU-8f2"}, set(), {0, 1, 2, 3}),  # ambiguous: invalid
    ({NV: "2,3", CUDA: "GPU-8f2a"}, set(), {2, 3}),  # not in the container
    ({NV: "all", CUDA: f"GPU-1234,{UUIDS[3]}"}, {2, 3}, {0, 1, 2, 3}),
    ({NV: "all", CUDA: f" {UUIDS[3].upper()} "}, {3}, {0, 1, 2, 3}),
    # The old MIG form names its device in CUDA_VISIBLE_DEVICES too.
    ({NV: f"MIG-{UUIDS[3]}/1/0", CUDA: f"MIG-{UUIDS[3]}/1/0"}, {3}, {3}),
    # A UUID the source does not report is still one of the container's devices.
    ({NV: "GPU-0dd0,2", CUDA: "GPU-0dd,GPU-1234"}, {2}, {2}),
    # Without NVIDIA_VISIBLE_DEVICES only UUIDs count: an index would be a guess.
    ({CUDA: "GPU-1234"}, {2}, None),
    ({CUDA: "1"}, None, None),
    # An index past a MIG device of unknown parent cannot be placed: the container's set.
    ({NV: "MIG-c0ffee00-1111-2222-3333-444444444444,2", CUDA: "0"}, {2}, {2}),
])
def test_the_variables_give_the_gpus_cuda_can_use(environ: Mapping[str, str],
                                                  usable: set[int] | None,
                                                  container: set[int] | None) -> None:
    got_usable, got_container = environ_gpus(environ, GPUS)
    assert _indices(got_usable) == usable
    assert _indices(got_container) == container


def test_container_devices_are_in_pci_order_with_unreported_ones_last() -> None:
    low = [u.lower() for u in UUIDS]
    assert container_devices(f"GPU-0dd0,GPU-0dd1,{UUIDS[3]},1:0,{UUIDS[1]}", GPUS) == [
        att._Device("", GPUS[1], whole=False), att._Device(low[1], GPUS[1]),
        att._Device(low[3], GPUS[3]),
        att._Device("gpu-0dd0", None), att._Device("gpu-0dd1", None)]
    # "1:0" and GPU 1's UUID are two devices, a slice and the whole GPU, kept in the order
    # listed; two slices of one GPU are one device: which slice each is is not known.
    assert container_devices("1:0,1:1", GPUS) == [att._Device("", GPUS[1], whole=False)]
    old = f"MIG-{UUIDS[2]}/1/0".lower()
    assert container_devices(f"MIG-{UUIDS[2]}/1/0", GPUS) == [
        att._Device(old, GPUS[2], whole=False)]


MIG_A = "MIG-aaaa1111-2222-3333-4444-555555555555"
MIG_B = "MIG-bbbb1111-2222-3333-4444-555555555555"
#: GPU 1 in MIG mode: the NVML source reports its two MIG devices beside it, under GPU 1's index.
MIG_GPUS = [*GPUS[:2], GPUIdentity(1, MIG_A, f"{NAME} MIG GI 1"),
            GPUIdentity(1, MIG_B, f"{NAME} MIG GI 2")]


@pytest.mark.parametrize(("environ", "usable"), [
    ({NV: MIG_A}, {UUIDS[1], MIG_A}),  # the slice, and its GPU's device-wide series
    ({NV: MIG_A.upper()}, {UUIDS[1], MIG_A}),
    ({NV: UUIDS[1]}, {UUIDS[1], MIG_A, MIG_B}),  # a whole GPU has all its slices
    ({NV: "1"}, {UUIDS[1], MIG_A, MIG_B}),
    ({NV: f"MIG-{UUIDS[1]}/1/0"}, {UUIDS[1]}),  # which slice is not known: its GPU only
    ({NV: "1:0"}, {UUIDS[1]}),
    ({NV: f"{MIG_B},{MIG_A}", CUDA: "1"}, {UUIDS[1], MIG_A}),  # listed order, same GPU
    ({NV: "all", CUDA: "MIG-bbbb"}, {UUIDS[1], MIG_B}),
])
def test_mig_devices_bring_their_gpu_and_a_whole_gpu_its_mig_devices(
        environ: Mapping[str, str], usable: set[str]) -> None:
    got, _ = environ_gpus(environ, MIG_GPUS)
    assert got is not None and {g.uuid for g in got} == usable


def test_a_process_on_a_mig_device_is_on_its_gpu_but_not_on_the_other_slices() -> None:
    samples = [DeviceSample(gpu=g, process_memory_bytes={10: 1.0} if g.uuid == MIG_B else
                            {20: 1.0} if g.uuid == UUIDS[1] else {}) for g in MIG_GPUS]
    on_slice = decide("targets", [TargetView(10, environ={})], samples)
    assert {g.uuid: set(s) for g, s in on_slice.gpus.items()} == {
        UUIDS[1]: {"nvml_process"}, MIG_B: {"nvml_process"}}
    on_gpu = decide("targets", [TargetView(20, environ={})], samples)
    assert [g.uuid for g in on_gpu.gpus] == [UUIDS[1]]
    assert container_devices(MIG_A, MIG_GPUS) == [att._Device(MIG_A.lower(), MIG_GPUS[2],
                                                              whole=False)]


# --- the decision --------------------------------------------------------------------------------

def _devices(**lists: Mapping[int, float]) -> list[DeviceSample]:
    """One sample per GPU; ``g2={55: 1e9}`` lists PID 55 on GPU 2."""
    return [DeviceSample(gpu=g, process_memory_bytes=dict(lists.get(f"g{g.index}", {})))
            for g in GPUS]


def _gpus(a: Attribution) -> dict[int, set[str]]:
    return {g.index: set(s) for g, s in a.gpus.items()}


def test_all_reports_every_gpu_whatever_the_targets_say() -> None:
    a = decide("all", [TargetView(10, environ={NV: UUIDS[1]})], _devices())
    assert a.mode == "all" and _gpus(a) == {i: {"all"} for i in range(4)}
    assert _gpus(Attribution("x", a.targets[0].gpus)) == {1: {"environ"}}  # still worked out
    # Its process memory still carries the target's PID.
    a = decide("all", [TargetView(10, nspid=7, environ={})], _devices(g2={7: 1.0}))
    assert a.owners == {(UUIDS[2], 7): 10} and a.owner(GPUS[2], 7) == 10
    assert explain(a)[-1] == ("GPU attribution",
                              "all: every GPU (--gpus all); reporting GPU(s) 0, 1, 2, 3")


@pytest.mark.parametrize("views", [
    [],
    [TargetView(10, why="/proc/10/environ: Permission denied")],
    [TargetView(10, environ={}), TargetView(11, environ={NV: "/var/run/devices"})],
])
def test_without_any_information_every_gpu_is_reported_as_unknown(
        views: list[TargetView]) -> None:
    a = decide("targets", views, _devices(g3={99: 1.0}))  # 99 is a neighbour
    assert a.mode == "unknown" and _gpus(a) == {i: {"unknown"} for i in range(4)}
    assert att.samples(a)[0] == ("mrc_agent_watched_gpus", ("unknown",), 4.0)
    assert a.owners == {} and a.owner(GPUS[3], 99) is None


def test_sources_unite_per_target_and_over_targets_in_device_order() -> None:
    views = [TargetView(10, environ={NV: UUIDS[3]}),
             TargetView(20, environ={}),  # silent, but on GPU 3 and GPU 1
             TargetView(30, why="unreadable")]  # no information: contributes nothing
    a = decide("targets", views, _devices(g1={20: 1.0}, g3={20: 2.0, 10: 3.0, 99: 4.0}))
    assert a.mode == "targets"
    assert list(_gpus(a).items()) == [(1, {"nvml_process"}), (3, {"environ", "nvml_process"})]
    assert [(t.pid, t.informed, t.why) for t in a.targets] == [
        (10, True, ""), (20, True, ""),
        (30, False, "environment unreadable (unreadable); on no GPU's process list")]
    assert a.owner(GPUS[3], 20) == 20 and a.owner(GPUS[3], 99) is None
    assert att.samples(a) == [
        ("mrc_agent_watched_gpus", ("targets",), 2.0),
        ("mrc_agent_gpu_attribution_info", GPUS[1].labels + ("nvml_process",), {}),
        ("mrc_agent_gpu_attribution_info", GPUS[3].labels + ("environ",), {}),
        ("mrc_agent_gpu_attribution_info", GPUS[3].labels + ("nvml_process",), {}),
    ]


def test_a_target_that_says_it_uses_no_gpu_is_information_not_a_fallback() -> None:
    a = decide("targets", [TargetView(10, environ={NV: "none"})], _devices())
    assert a.mode == "targets" and a.gpus == {}
    assert att.samples(a) == [("mrc_agent_watched_gpus", ("targets",), 0.0)]


def test_a_namespace_pid_matches_only_inside_the_containers_gpus() -> None:
    # The driver lists the target as 7 (its innermost PID) on GPU 1, and some other
    # container's process, also 7 in its own namespace, on GPU 0.
    inside = TargetView(4100, nspid=7, environ={NV: f"{UUIDS[1]},{UUIDS[2]}", CUDA: "1"})
    a = decide("targets", [inside], _devices(g0={7: 1.0}, g1={7: 2.0}))
    assert _gpus(a) == {1: {"nvml_nspid"}, 2: {"environ"}}
    assert a.owner(GPUS[1], 7) == 4100 and a.owner(GPUS[0], 7) is None
    # Without a container set to check against, the namespace PID is taken as it comes.
    a = decide("targets", [TargetView(4100, nspid=7, environ={})], _devices(g0={7: 1.0}))
    assert _gpus(a) == {0: {"nvml_nspid"}}


def test_the_agents_own_pid_on_the_list_is_exact_and_not_bounded_by_the_environment() -> None:
    a = decide("targets", [TargetView(4100, nspid=7, environ={NV: UUIDS[1]})],
               _devices(g0={4100: 1.0}))
    assert _gpus(a) == {0: {"nvml_process"}, 1: {"environ"}}


def test_explain_says_each_targets_gpus_and_why_not() -> None:
    a = decide("targets", [TargetView(10, environ={NV: UUIDS[2]}),
                           TargetView(11, why="/proc/11/environ: Permission denied"),
                           TargetView(12, environ={NV: "none"})], _devices())
    assert explain(a) == [
        ("GPUs of target 10", f"2 {UUIDS[2]} (environ)"),
        ("GPUs of target 11", "no information: environment unreadable (/proc/11/environ: "
                              "Permission denied); on no GPU's process list"),
        ("GPUs of target 12", "none"),
        ("GPU attribution", "targets: the targets' GPUs; reporting GPU(s) 2"),
    ]
    silent = decide("targets", [TargetView(13, environ={}),
                                TargetView(14, environ={NV: "/var/run/nvidia-container-devices"})],
                    _devices())
    assert explain(silent) == [
        ("GPUs of target 13", "no information: neither variable set; on no GPU's process list"),
        ("GPUs of target 14", "no information: environment names no GPU of this node; "
                              "on no GPU's process list"),
        ("GPU attribution", "unknown: every GPU: no target says which GPUs it uses; "
                            "reporting GPU(s) 0, 1, 2, 3"),
    ]
    both = decide("targets", [TargetView(15, environ={NV: "1,3"})], _devices(g3={15: 1.0}))
    assert explain(both) == [
        ("GPUs of target 15", f"1 {UUIDS[1]} (environ), 3 {UUIDS[3]} (environ+nvml_process)"),
        ("GPU attribution", "targets: the targets' GPUs; reporting GPU(s) 1, 3"),
    ]
    nothing = decide("targets", [TargetView(16, environ={NV: "none"})], _devices())
    assert explain(nothing)[-1] == ("GPU attribution",
                                    "targets: the targets' GPUs; reporting GPU(s) none")


# --- /proc -------------------------------------------------------------------------------------

def _proc(root: Path, pid: int, *, environ: bytes | None = None, nspid: str | None = None,
          start: int = 77, comm: bytes = b"python3") -> None:
    """Process ``pid`` under ``root`` with what ProcFS and the process collector read."""
    (root / str(pid) / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / "stat").write_bytes(b"cpu  1 2 3 4\nbtime 1700000000\n")
    (root / str(pid) / "stat").write_bytes(stat_line(pid, comm=comm, start=start))
    (root / str(pid) / "task" / str(pid) / "stat").write_bytes(stat_line(pid, comm=comm))
    status = b"Name:\tpython3\nvoluntary_ctxt_switches:\t1\nnonvoluntary_ctxt_switches:\t2\n"
    if nspid is not None:
        status += f"NSpid:\t{nspid}\n".encode()
    (root / str(pid) / "status").write_bytes(status)
    if environ is not None:
        (root / str(pid) / "environ").write_bytes(environ)


def test_environ_keeps_the_named_variables_first_one_winning(tmp_path: Path) -> None:
    _proc(tmp_path, 5, environ=b"PATH=/bin\0NVIDIA_VISIBLE_DEVICES=GPU-a\0CUDA_VISIBLE_DEVICES="
                               b"\0NVIDIA_VISIBLE_DEVICES=GPU-b\0junk\0X==y\0")
    fs = ProcFS(root=str(tmp_path))
    assert fs.environ(5, att.VARIABLES) == {NV: "GPU-a", CUDA: ""}
    assert fs.environ(5, ("X",)) == {"X": "=y"}


def test_environ_is_read_bounded_and_a_cut_entry_is_dropped(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    head = b"NVIDIA_VISIBLE_DEVICES=all\0"
    _proc(tmp_path, 5, environ=head + b"CUDA_VISIBLE_DEVICES=0,1,2,3\0")
    monkeypatch.setattr(procfs, "ENVIRON_READ_BYTES", len(head) + 25)  # cuts the second
    assert ProcFS(root=str(tmp_path)).environ(5, att.VARIABLES) == {NV: "all"}


def test_nspid_lists_the_namespaces_outermost_first(tmp_path: Path) -> None:
    _proc(tmp_path, 5, nspid="5\t40\t7")
    _proc(tmp_path, 6)  # a kernel before 4.1
    fs = ProcFS(root=str(tmp_path))
    assert fs.nspid(5) == (5, 40, 7) and fs.nspid(6) == ()
    fs.close()


def test_a_view_that_cannot_be_read_is_no_information_not_an_error(tmp_path: Path) -> None:
    _proc(tmp_path, 5, nspid="5")  # no environ file: as a process of another user reads
    (tmp_path / "6").mkdir()
    (tmp_path / "6" / "environ").mkdir()  # read() fails: EISDIR
    fs = ProcFS(root=str(tmp_path))
    v5, v6, gone = read_view(fs, 5), read_view(fs, 6), read_view(fs, 404)
    assert v5.environ is None and "5/environ" in v5.why and v5.nspid is None
    assert v6.environ is None and "6/environ" in v6.why
    assert gone == TargetView(404, None, None, gone.why) and gone.why
    fs.close()


@pytest.mark.parametrize(("nspid", "inner"), [
    ("5\t40\t7", 7),  # nested twice: the innermost
    ("5\t7", 7),
    ("5\t40\t5", None),  # the same number innermost: nothing to match apart from the PID
    ("5", None),
    (None, None),  # a kernel before 4.1
    ("5\tx", None),  # a line that does not parse
])
def test_a_view_has_the_innermost_namespace_pid_when_it_differs(
        tmp_path: Path, nspid: str | None, inner: int | None) -> None:
    _proc(tmp_path, 5, environ=b"CUDA_VISIBLE_DEVICES=0\0", nspid=nspid)
    fs = ProcFS(root=str(tmp_path))
    assert read_view(fs, 5) == TargetView(5, nspid=inner, environ={CUDA: "0"})
    fs.close()


def test_a_view_without_a_status_file_still_has_its_environment(tmp_path: Path) -> None:
    _proc(tmp_path, 5, environ=b"NVIDIA_VISIBLE_DEVICES=1\0", nspid="5\t7")
    (tmp_path / "5" / "status").unlink()
    fs = ProcFS(root=str(tmp_path))
    assert read_view(fs, 5) == TargetView(5, environ={NV: "1"})
    fs.close()


def test_the_process_collector_reads_each_view_once_per_process(tmp_path: Path) -> None:
    _proc(tmp_path, 5, environ=b"NVIDIA_VISIBLE_DEVICES=GPU-a\0", nspid="5\t7")
    fs = ProcFS(root=str(tmp_path))
    collector = ProcessCollector(procfs=fs)

    def view() -> TargetView | None:
        processes = published(collector.update(pass_view(1.0, (5,))), Processes)
        assert processes is not None
        return processes.by_pid[5].view

    assert view() == TargetView(5, nspid=7, environ={NV: "GPU-a"})
    (tmp_path / "5" / "environ").write_bytes(b"NVIDIA_VISIBLE_DEVICES=GPU-b\0")
    assert view() == TargetView(5, nspid=7, environ={NV: "GPU-a"})  # the initial one, kept
    # The PID now belongs to another process (new start time): read afresh.
    (tmp_path / "5" / "stat").write_bytes(stat_line(5, start=900))
    assert view() == TargetView(5, nspid=7, environ={NV: "GPU-b"})
    fs.close()


# --- the collectors ------------------------------------------------------------------------------

class Source:
    """Device, GPM and profiling source answering one sample of each per GPU."""

    def __init__(self, processes: Mapping[int, Mapping[int, float]] | None = None) -> None:
        self.processes = processes or {}

    def sample_devices(self) -> list[DeviceSample]:
        return [DeviceSample(gpu=g, gpu_util=0.1 * (g.index + 1), power_watts=100.0,
                             process_memory_bytes=dict(self.processes.get(g.index, {})))
                for g in GPUS[:2]]

    def sample_gpm(self) -> list[GpmSample]:
        return [GpmSample(gpu=g, sm_util=0.5) for g in GPUS[:2]]

    def sample_profiling(self) -> list[ProfilingSample]:
        return [ProfilingSample(gpu=g, sm_instructions_executed_total=1.0) for g in GPUS[:2]]


def _pass(source: Source, views: list[TargetView], gpus: str = "targets"
          ) -> tuple[PassView, list[tuple[str, tuple[str, ...]]]]:
    """One pass of gpu, gpm, profiling, derived and the finishers; (last view, series)."""
    view = _targets(*views, now=5.0)
    build = BuildContext(Sources(source, source, source), gpus=gpus)
    collectors = [gpu_collector.DEFINITION.factory(build), GpmCollector(source),
                  ProfilingCollector(source), DerivedCollector()]
    view, out = run_pass(view, collectors)
    out += [s for finish in PASS_FINISHERS for s in finish(view)]
    return view, [(name, labels) for name, labels, _ in out]


def _targets(*views: TargetView, now: float = 1.0) -> PassView:
    """A pass whose process collector read these targets' views."""
    return pass_view(now, [v.pid for v in views],
                     processes={v.pid: TargetState(v.pid, "python3", 1.0, 1.0, view=v)
                                for v in views})


def _gpu_readings(view: PassView) -> GpuReadings:
    readings = view.get(GpuReadings)
    assert readings is not None
    return readings


def test_each_pass_finisher_emits_what_it_declares_and_the_catalogue_holds_it() -> None:
    """The catalogue is assembled from the registrations: a finisher that emitted a metric it
    did not declare would be served with no help text, or not at all."""
    view, _ = _pass(Source(), [TargetView(10, environ={NV: UUIDS[1]})])
    catalogued = {spec.name for spec in CATALOG}
    for finisher in FINISHERS:
        emitted = {name for name, _, _ in finisher.finish(view)}
        declared = {spec.name for spec in finisher.metrics}
        assert emitted and emitted <= declared <= catalogued, finisher.name


def _uuids(series: list[tuple[str, tuple[str, ...]]]) -> set[str]:
    """Every GPU UUID any series names."""
    return {v for _, labels in series for v in labels if v.startswith("GPU-")}


def test_only_the_targets_gpus_have_series_in_every_gpu_collector() -> None:
    view, series = _pass(Source(), [TargetView(10, environ={NV: UUIDS[1]})])
    assert _uuids(series) == {UUIDS[1]}
    for metric in ("mrc_gpu_utilization_ratio", "mrc_gpu_sm_active_ratio",
                   "mrc_gpu_sm_instructions_executed_total", "mrc_gpu_idle_window_seconds",
                   "mrc_gpu_starved"):
        assert [n for n, _ in series if n == metric], metric
    # The derived signals judge the target on its own GPU only.
    readings = _gpu_readings(view)
    assert set(readings.util) == {GPUS[1]} and set(readings.util_points) == {GPUS[1]}
    assert ("mrc_agent_watched_gpus", ("targets",)) in series
    assert ("mrc_agent_gpu_attribution_info", GPUS[1].labels + ("environ",)) in series


def test_the_all_setting_reports_both_gpus_through_the_factory() -> None:
    view, series = _pass(Source(), [TargetView(10, environ={NV: UUIDS[1]})], gpus="all")
    assert _uuids(series) == {UUIDS[0], UUIDS[1]}
    assert ("mrc_agent_watched_gpus", ("all",)) in series
    decided = view.get(Attribution)
    assert decided is not None and decided.mode == "all"


def test_a_target_listed_by_its_namespace_pid_gets_its_memory_under_the_agents_pid() -> None:
    source = Source({0: {7: 5e9, 99: 1e9}})
    view, series = _pass(source, [TargetView(4100, nspid=7, environ={})])
    assert _uuids(series) == {UUIDS[0]}
    assert ("mrc_gpu_process_memory_used_bytes", GPUS[0].labels + ("4100", "python3")) in series
    assert not [labels for name, labels in series if "99" in labels]
    assert _gpu_readings(view).gpus_of_pid == {4100: {GPUS[0]}}


def test_with_the_gpu_collector_off_gpm_and_profiling_decide_from_the_environment() -> None:
    """No gpu collector: the first collector with GPUs decides from the targets' environments
    (no process lists), so a pod's agent still skips its neighbours' GPUs."""
    view = _targets(TargetView(10, environ={NV: UUIDS[1]}))
    view, gpm = run_pass(view, [GpmCollector(Source())])
    assert _uuids([(n, labels) for n, labels, _ in gpm]) == {UUIDS[1]}
    view, prof = run_pass(view, [ProfilingCollector(Source())])
    assert _uuids([(n, labels) for n, labels, _ in prof]) == {UUIDS[1]}
    assert gpu_collector.attribution_samples(view) == [
        ("mrc_agent_watched_gpus", ("targets",), 1.0),
        ("mrc_agent_gpu_attribution_info", GPUS[1].labels + ("environ",), {})]


def test_with_the_gpu_collector_off_and_no_target_information_every_gpu_is_reported() -> None:
    view, gpm = run_pass(pass_view(), [GpmCollector(Source())])
    assert len(gpm) == 2
    view, prof = run_pass(view, [ProfilingCollector(Source())])
    assert len(prof) == 2
    decided = view.get(Attribution)
    assert decided is not None and decided.mode == "unknown"


class FailingDevices(Source):
    """Device state that fails from its second call on; GPM keeps answering."""

    def __init__(self, processes: Mapping[int, Mapping[int, float]]) -> None:
        super().__init__(processes)
        self.calls = 0

    def sample_devices(self) -> list[DeviceSample]:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return super().sample_devices()


def test_a_failed_gpu_pass_keeps_the_last_decision_for_gpm_and_profiling() -> None:
    """The target is only on GPU 0's process list (its environment says nothing): a failed
    device pass must not widen gpm and profiling to the neighbour's GPU 1."""
    source = FailingDevices({0: {10: 1e9}})
    collector = GpuCollector(source)
    for expected_gpu_series in (True, False):
        view = _targets(TargetView(10, environ={}))
        update = collector.update(view)
        if expected_gpu_series:
            assert update.error is None
            assert _uuids([(n, ls) for n, ls, _ in update.samples]) == {UUIDS[0]}
        else:
            assert isinstance(update.error, RuntimeError) and update.samples == []
        view, series = run_pass(view.with_outputs(update.outputs),
                                [GpmCollector(source), ProfilingCollector(source)])
        assert _uuids([(n, ls) for n, ls, _ in series]) == {UUIDS[0]}
        decided = view.get(Attribution)
        assert decided is not None and set(decided.gpus) == {GPUS[0]}


def test_a_gpu_collector_failing_from_its_first_pass_leaves_the_environment_decision() -> None:
    source = FailingDevices({})
    source.calls = 1
    view = _targets(TargetView(10, environ={NV: "0"}))
    with pytest.raises(RuntimeError):
        GpuCollector(source).update(view)
    assert view.get(Attribution) is None
    _, gpm = run_pass(view, [GpmCollector(source)])
    assert _uuids([(n, ls) for n, ls, _ in gpm]) == {UUIDS[0]}


def test_the_default_gpu_collector_attributes() -> None:
    view = _targets(TargetView(10, environ={NV: "none"}))
    assert GpuCollector(Source()).update(view).samples == []


# --- the setting -------------------------------------------------------------------------------

def test_the_gpus_setting_reads_from_flag_environment_and_file(tmp_path: Path) -> None:
    assert load({}, env={}).gpus == "targets"
    assert load({}, env={"MRC_AGENT_GPUS": "all"}).gpus == "all"
    f = tmp_path / "a.yaml"
    f.write_text("gpus: all\n")
    assert load({"gpus": "targets"}, env={}, config_path=str(f)).gpus == "targets"
    assert load({}, env={}, config_path=str(f)).gpus == "all"
    with pytest.raises(ConfigError) as err:
        load({"gpus": "mine"}, env={})
    assert str(err.value) == "gpus 'mine' is not targets or all"


# --- the replay trace's process lists ------------------------------------------------------------

@pytest.mark.parametrize(("processes", "reason"), [
    ([1, 2], "'processes' must be an object"),
    ({"12a": 1.0}, "'processes' key '12a' is not a PID"),
    ({"0": 1.0}, "is not a PID"),
    ({"4194305": 1.0}, "is not a PID"),
    ({"12": -1}, "'processes' value for 12 must be a number >= 0"),
    ({"12": "1G"}, "must be a number"),
    ({str(p): 1.0 for p in range(1, 1026)}, "at most 1024"),
])
def test_a_bad_process_list_in_a_trace_names_the_line(tmp_path: Path, processes: object,
                                                      reason: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"t": 0, "gpu": 0, "gpu_util": 0.5}) + "\n"
                    + json.dumps({"t": 1, "gpu": 0, "processes": processes}) + "\n")
    with pytest.raises(ReplayFormatError) as err:
        load_trace(str(path))
    assert f"{path}:2: " in str(err.value) and reason in str(err.value)


def test_a_trace_replays_its_process_lists_as_nvml_would(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"t": 0, "gpu": 0, "gpu_util": 0.5, "processes": {"41": 2e9}},
            {"t": 0, "gpu": 1, "gpu_util": 0.5},
            {"t": 1, "gpu": 0, "gpu_util": 0.5, "processes": {"41": 3e9, "42": 1.0}},
            {"t": 1, "gpu": 1, "gpu_util": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    now = [100.0]
    backend = ReplayBackend(str(path), clock=lambda: now[0])
    lists = [s.process_memory_bytes for s in backend.sample_devices()]
    assert lists == [{41: 2e9}, {}]
    now[0] += 1.5
    assert backend.sample_devices()[0].process_memory_bytes == {41: 3e9, 42: 1.0}
    now[0] += 1.0  # the next loop: the first record again
    assert backend.sample_devices()[0].process_memory_bytes == {41: 2e9}


# --- a hostile environment ---------------------------------------------------------------------
# A target's environment is the target's to choose: 14,000 distinct tokens (110 KB, a legal
# environment) cost 8 s of CPU per pass while duplicates were found by a list search. The work
# is linear in the value and bounded by MAX_DEVICE_TOKENS.

def _many(n: int) -> str:
    return ",".join(f"GPU-{i:08x}" for i in range(n))


def test_a_long_device_list_is_read_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(att, "MAX_DEVICE_TOKENS", 1 << 20, raising=False)  # no cap: the work
    n, calls = 14_000, 0
    compare = att._Device.__eq__

    def counted(self: object, other: object) -> bool:
        nonlocal calls
        calls += 1
        # Quadratic de-duplication would make ~n^2/2 comparisons; stop long before.
        assert calls <= 4 * n, "device comparisons grow faster than the list"
        return compare(self, other)  # type: ignore[arg-type]

    monkeypatch.setattr(att._Device, "__eq__", counted)
    devices = container_devices(f"{_many(n)},{UUIDS[1]},{_many(n)}", GPUS)
    assert devices is not None and len(devices) == n + 1 and devices[0].gpu == GPUS[1]


def test_uuid_prefixes_against_a_long_device_list_are_linear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES' prefixes against the container's devices: ten times the tokens
    costs about ten times the CPU, not a hundred (a ratio, not a time: the machine is busy)."""
    import time

    monkeypatch.setattr(att, "MAX_DEVICE_TOKENS", 1 << 20, raising=False)

    def cost(n: int) -> float:
        environ = {NV: f"{UUIDS[0]},{_many(n)}", CUDA: _many(n)}
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            usable, _ = environ_gpus(environ, GPUS)
            best = min(best, time.process_time() - started)
        assert usable == set()  # the listed devices are nobody's GPU of this node
        return best

    small, large = cost(1_500), cost(15_000)
    assert large < 30 * max(small, 1e-3), (small, large)


def test_tokens_past_the_cap_are_ignored() -> None:
    cap = att.MAX_DEVICE_TOKENS
    assert 64 <= cap <= 1024  # a node has a few dozen devices (8 GPUs x 7 MIG slices)
    within, _ = environ_gpus({NV: f"{_many(cap - 1)},{UUIDS[2]}"}, GPUS)
    assert _indices(within) == {2}
    past, _ = environ_gpus({NV: f"{_many(cap)},{UUIDS[2]}"}, GPUS)
    assert past is None  # the only device of this node is past the cap: no information
    usable, _ = environ_gpus({NV: "all", CUDA: f"{'-1,' * 100_000}0"}, GPUS)
    assert usable == set()
    # An index too long for int() names no device.
    assert container_devices("1" * 5000, GPUS) is None
    assert environ_gpus({NV: "all", CUDA: "1" * 5000}, GPUS)[0] == set()


def test_a_view_keeps_the_first_tokens_and_says_so_once(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    cap = att.MAX_DEVICE_TOKENS
    value = f"{UUIDS[1]},{_many(14_000)}"
    _proc(tmp_path, 5, environ=f"{NV}={value}\0{CUDA}=0\0".encode())
    fs = ProcFS(root=str(tmp_path))
    with caplog.at_level("WARNING", logger=att.__name__):
        view = read_view(fs, 5)
    fs.close()
    assert view.environ is not None and view.environ[CUDA] == "0"
    assert view.environ[NV].split(",") == value.split(",")[:cap]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"pid 5: {NV} lists 14001 devices" in warned[0], warned
    assert _indices(environ_gpus(view.environ, GPUS)[0]) == {1}
