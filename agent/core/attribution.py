"""Per-pod GPU attribution: which of the GPUs the agent sees belong to its targets.

The sidecar runs with ``NVIDIA_VISIBLE_DEVICES=all``, so NVML shows it every GPU of the node;
reported as they are, each pod's agent would alert on its neighbours' GPUs. This module decides,
once per sampling pass, which GPUs are reported. The rule (docs/attribution.md says it for
operators):

* **A target's GPUs** are the union of
  - ``environ``: what its initial environment gives the CUDA inside it.
    ``NVIDIA_VISIBLE_DEVICES`` (set by the device plugin, read by the container runtime) names
    the devices of its container: ``all``; ``none``, ``void`` or empty (no GPU); or a list of
    NVML indices and ``GPU-`` UUIDs (a whole GPU: with its MIG devices), ``MIG-<uuid>`` (the
    MIG device the source reports under that UUID, with its physical GPU, whose device-wide
    series are the slice's too), ``MIG-GPU-<uuid>/<gi>/<ci>`` or ``<gpu>:<mig>`` (the older
    forms: their physical GPU). Tokens that name no device of this node (a device-list path of
    the ``volume-mounts`` strategy, an unknown UUID, a MIG UUID the source does not report) are
    ignored; a value none of whose tokens names one gives no information.
    ``CUDA_VISIBLE_DEVICES`` then narrows that set as CUDA does: indices count the container's
    devices in CUDA's order (NVML index order, which is PCI bus order, as CUDA's is on a node
    of one GPU model or with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), UUIDs may be unique prefixes
    (``GPU-8f2a``), and the list ends at the first token that names no device (``-1`` hides
    every GPU). Without a usable ``NVIDIA_VISIBLE_DEVICES`` only its UUIDs count: an index
    relative to devices nobody named would guess.
  - ``nvml_process``: the GPUs on whose NVML process list the target's PID appears;
  - ``nvml_nspid``: the GPUs on whose list its innermost-namespace PID (the last ``NSpid`` of
    ``/proc/PID/status``) appears — some drivers (580) report a containerised process by that
    number. Small numbers recur in every container, so such a match is kept only on a GPU of
    the set ``NVIDIA_VISIBLE_DEVICES`` gave the container, when it gave one: a process cannot
    use a GPU whose device files its container does not have.
* **The watched GPUs** are the union over targets (``mode="targets"``). When no target gives
  any information — no target, every environment unreadable or silent, no target on any GPU —
  every GPU is reported and the state says so (``mode="unknown"``): the agent never silently
  drops every GPU. ``--gpus all`` reports every GPU (``mode="all"``).

A target that says it uses no GPU (``NVIDIA_VISIBLE_DEVICES=none``) is information: with only
such targets no GPU is reported and ``mrc_agent_watched_gpus{mode="targets"}`` is 0.

The two variables are the target's to choose, and are read every pass, so the work is linear in
their length (devices are de-duplicated by hashing, UUID prefixes found by bisection in a
sorted list) and bounded: only the first :data:`MAX_DEVICE_TOKENS` entries of each are read,
and :func:`read_view` says once per target when it cut one. An index too long to be one names
no device.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity
from mrc_agent.agent.core.hw.procfs import ProcessGone, ProcFS
from mrc_agent.agent.core.sample import Sample, gauge, info

#: Values of the ``gpus`` setting.
MODE_TARGETS, MODE_ALL = "targets", "all"
GPU_MODES = (MODE_TARGETS, MODE_ALL)
#: The third ``mode`` label value: the setting is ``targets`` but no target gave information.
MODE_UNKNOWN = "unknown"

#: ``source`` label values: why a GPU is reported.
SOURCE_ENVIRON, SOURCE_PROCESS, SOURCE_NSPID = "environ", "nvml_process", "nvml_nspid"
SOURCE_ALL, SOURCE_UNKNOWN = "all", "unknown"

NVIDIA_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"
VARIABLES = (NVIDIA_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES)

#: Entries of either variable that are read. A node has a few dozen devices at most (8 GPUs of
#: 7 MIG slices each are 64 with the GPUs; 16 such GPUs 128), so a longer list is a mistake or
#: an attack, and its tail is ignored.
MAX_DEVICE_TOKENS = 256
#: Digits of an index at most: no node has a million devices, and ``int()`` refuses a few
#: thousand digits.
_MAX_INDEX_DIGITS = 6

log = logging.getLogger(__name__)

#: Labels of the per-GPU attribution series: the per-GPU labels of every GPU series
#: (``collectors.base.GPU``, which imports this module) and the reason.
_GPU_LABELS = ("gpu", "uuid", "gpu_model")

WATCHED_GPUS = gauge(
    "agent", "mrc_agent_watched_gpus", ("mode",),
    "GPUs whose series the agent reports this pass, and how they were chosen: targets (the "
    "GPUs the target processes can use), unknown (no target said which GPUs it uses, so "
    "every GPU is reported) or all (--gpus all).")
ATTRIBUTION = info(
    "agent", "mrc_agent_gpu_attribution_info", _GPU_LABELS + ("source",),
    "One series per reported GPU and reason it is reported: environ (a target's "
    "NVIDIA_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES), nvml_process (NVML lists a target's PID "
    "on it), nvml_nspid (NVML lists a target's innermost-namespace PID), all (--gpus all) or "
    "unknown (no target said which GPUs it uses).")
METRICS = (WATCHED_GPUS, ATTRIBUTION)


# --- what /proc says about a target ------------------------------------------------------------

@dataclass(frozen=True)
class TargetView:
    """What ``/proc`` says about one target for attribution. It does not change during the
    process's life (the initial environment, the namespace PIDs), so it is read once."""

    pid: int
    #: The PID in the target's own, innermost PID namespace, where that differs from ``pid``.
    nspid: int | None = None
    #: The :data:`VARIABLES` its initial environment sets; None when it cannot be read.
    environ: Mapping[str, str] | None = None
    #: Why ``environ`` is None.
    why: str = ""


def _tokens(value: str) -> list[str]:
    """The first :data:`MAX_DEVICE_TOKENS` comma-separated entries of ``value``, unstripped
    (one pass over the value; the rest is not split)."""
    tokens = value.split(",", MAX_DEVICE_TOKENS)
    return tokens[:MAX_DEVICE_TOKENS]


def read_view(procfs: ProcFS, pid: int) -> TargetView:
    """The :class:`TargetView` of ``pid``; a file that cannot be read is no information,
    never an error. A variable of more than :data:`MAX_DEVICE_TOKENS` entries is kept cut to
    those, with a warning (a view is read once per process, so once per target)."""
    environ: dict[str, str] | None
    try:
        environ, why = procfs.environ(pid, VARIABLES), ""
    except ProcessGone as exc:
        environ, why = None, str(exc)
    for name, value in list((environ or {}).items()):
        count = value.count(",") + 1
        if environ is not None and count > MAX_DEVICE_TOKENS:
            log.warning("pid %d: %s lists %d devices; only the first %d are read (a node has "
                        "a few dozen)", pid, name, count, MAX_DEVICE_TOKENS)
            environ[name] = ",".join(_tokens(value))
    try:
        ns = procfs.nspid(pid)
    except ProcessGone:
        ns = ()
    # NSpid starts with ``pid`` itself: a last field that differs is an inner namespace's.
    inner = ns[-1] if ns and ns[-1] != pid else None
    return TargetView(pid=pid, nspid=inner, environ=environ, why=why)


# --- the environment variables -----------------------------------------------------------------

@dataclass(frozen=True)
class _Device:
    """A device CUDA in the container enumerates: the UUID it may be named by (lower case; ""
    when unknown), the device it is as the source reports it (a GPU or a MIG device; None when
    not reported), and whether it is a ``whole`` GPU (then its MIG devices are the container's
    too) or a slice whose MIG device is not known (then only its physical GPU is)."""

    uuid: str
    gpu: GPUIdentity | None
    whole: bool = True


def _is_index(token: str) -> bool:
    return token.isascii() and token.isdigit()


def _index(token: str) -> int | None:
    """``token`` as a device index; None when it is not one (or too long to be one)."""
    return int(token) if _is_index(token) and len(token) <= _MAX_INDEX_DIGITS else None


def _reported(device: GPUIdentity) -> _Device:
    return _Device(device.uuid.lower(), device, whole=not device.is_mig)


def _gpus_of(devices: Sequence[_Device], gpus: Sequence[GPUIdentity]) -> set[GPUIdentity]:
    """The reported devices ``devices`` stand for: each one, the physical GPU of each MIG
    device (its device-wide series are the slice's too), and the MIG devices of each whole GPU
    (a container given a whole GPU has all its slices)."""
    out = {d.gpu for d in devices if d.gpu is not None}
    whole = {d.gpu.index for d in devices if d.gpu is not None and d.whole}
    parents = {g.index for g in out if g.is_mig}
    out.update(g for g in gpus if (g.is_mig and g.index in whole)
               or (not g.is_mig and g.index in parents))
    return out


def _nvidia_token(token: str, by_index: Mapping[int, GPUIdentity],
                  by_uuid: Mapping[str, GPUIdentity]) -> _Device | None:
    """The device one entry names; ``by_index``: the GPUs (not MIG devices) by index,
    ``by_uuid``: every reported device by lower-case UUID."""
    low = token.lower()
    if _is_index(low):
        index = _index(low)
        g = by_index.get(index) if index is not None else None
        return _reported(g) if g else None
    gpu_part, sep, mig_part = low.partition(":")
    if sep and _is_index(gpu_part) and _is_index(mig_part):  # "<gpu>:<mig>": a slice of it
        index = _index(gpu_part)
        g = by_index.get(index) if index is not None else None
        return _Device("", g, whole=False) if g else None
    if low.startswith("mig-gpu-"):  # "MIG-GPU-<uuid>/<gi>/<ci>", drivers before 470
        parent = low[len("mig-"):].partition("/")[0]
        g = by_uuid.get(parent)
        return _Device(low, g, whole=False) if g else None
    if low.startswith(("mig-", "gpu-")):  # a MIG device (if the source reports it) or a GPU
        g = by_uuid.get(low)
        return _reported(g) if g else _Device(low, None)
    return None  # a device-list path, a typo: names nothing


def container_devices(value: str, gpus: Sequence[GPUIdentity]) -> list[_Device] | None:
    """The devices ``NVIDIA_VISIBLE_DEVICES=value`` gives a container, in CUDA's enumeration
    order; None when the value names no device of ``gpus`` (no information). Only the first
    :data:`MAX_DEVICE_TOKENS` entries are read."""
    text = value.strip()
    if text.lower() == "all":
        return [_reported(g) for g in sorted(gpus, key=lambda g: g.index)]
    if text.lower() in ("", "none", "void"):
        return []
    by_index = {g.index: g for g in gpus if not g.is_mig}
    by_uuid: dict[str, GPUIdentity] = {}
    for g in gpus:
        by_uuid.setdefault(g.uuid.lower(), g)  # the first of a UUID reported twice, as before
    found: dict[_Device, None] = {}  # de-duplicated in the order listed
    for token in _tokens(text):
        device = _nvidia_token(token.strip(), by_index, by_uuid)
        if device is not None:
            found.setdefault(device)
    if not any(d.gpu is not None for d in found):
        return None
    # CUDA numbers devices in PCI order (NVML's index order), not in the order listed; a device
    # the source does not report goes last. The sort is stable: MIG devices of one GPU, and
    # unreported devices, keep the order listed.
    return sorted(found, key=lambda d: d.gpu.index if d.gpu else 1 << 30)


def cuda_devices(value: str, devices: list[_Device] | None,
                 gpus: Sequence[GPUIdentity]) -> list[_Device] | None:
    """The devices ``CUDA_VISIBLE_DEVICES=value`` leaves CUDA of ``devices`` (the container's,
    from :func:`container_devices`; None when unknown); None when that cannot be told."""
    if not value.strip():
        return []  # set but empty: CUDA sees no device
    pool = devices if devices is not None else [_reported(g) for g in gpus]
    # The pool's UUIDs sorted: the devices a prefix names are one run of this list.
    named = sorted((d.uuid, i) for i, d in enumerate(pool) if d.uuid)
    keys = [uuid for uuid, _ in named]
    chosen: list[_Device] = []
    for raw in _tokens(value):
        token = raw.strip().lower()
        if _is_index(token):
            # An index counts the container's devices: unknown ones, or ones whose place in
            # CUDA's order is unknown (not reported by the source), make it a guess.
            if devices is None or any(d.gpu is None for d in devices):
                return None
            index = _index(token)
            if index is None or index >= len(pool):
                break
            chosen.append(pool[index])
            continue
        if not token.startswith(("gpu-", "mig-")):
            break  # "-1", "NoDevFiles": CUDA stops at the first invalid entry
        at = bisect.bisect_left(keys, token)
        unique = (at < len(keys) and keys[at].startswith(token)
                  and not (at + 1 < len(keys) and keys[at + 1].startswith(token)))
        if not unique:
            break  # unknown or ambiguous prefix
        chosen.append(pool[named[at][1]])
    return chosen


def environ_gpus(environ: Mapping[str, str], gpus: Sequence[GPUIdentity]
                 ) -> tuple[set[GPUIdentity] | None, set[GPUIdentity] | None]:
    """(the devices the environment lets CUDA use, the devices of the container): each None
    when the environment does not tell."""
    nvidia = environ.get(NVIDIA_VISIBLE_DEVICES)
    devices = container_devices(nvidia, gpus) if nvidia is not None else None
    boundary = _gpus_of(devices, gpus) if devices is not None else None
    cuda = environ.get(CUDA_VISIBLE_DEVICES)
    if cuda is not None:
        narrowed = cuda_devices(cuda, devices, gpus)
        if narrowed is not None:
            return _gpus_of(narrowed, gpus), boundary
    return boundary, boundary


# --- the decision ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TargetGpus:
    """The GPUs attributed to one target, each with its sources; ``informed`` is False when the
    target gave no information at all (``why`` says what was missing)."""

    pid: int
    gpus: Mapping[GPUIdentity, frozenset[str]]
    informed: bool
    why: str = ""


@dataclass(frozen=True)
class Attribution:
    """One pass's decision: the ``mode`` label, the watched GPUs with their sources, each
    target's GPUs, and which NVML PID on which GPU is which target."""

    mode: str
    gpus: Mapping[GPUIdentity, frozenset[str]]
    targets: tuple[TargetGpus, ...] = ()
    #: (GPU UUID, PID as NVML lists it) -> the target's PID as the agent sees it.
    owners: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def watches(self, gpu: GPUIdentity) -> bool:
        return gpu in self.gpus

    def owner(self, gpu: GPUIdentity, nvml_pid: int) -> int | None:
        """The target whose process NVML lists as ``nvml_pid`` on ``gpu``, or None."""
        return self.owners.get((gpu.uuid, nvml_pid))


def _target(view: TargetView, gpus: Sequence[GPUIdentity],
            listed: Mapping[GPUIdentity, Collection[int]],
            owners: dict[tuple[str, int], int]) -> TargetGpus:
    found: dict[GPUIdentity, set[str]] = {}
    usable = boundary = None
    if view.environ is not None:
        usable, boundary = environ_gpus(view.environ, gpus)
    for g in usable or ():
        found.setdefault(g, set()).add(SOURCE_ENVIRON)
    for g in gpus:
        pids = listed[g]
        if view.pid in pids:
            source, nvml_pid = SOURCE_PROCESS, view.pid
        elif view.nspid is not None and view.nspid in pids and (
                boundary is None or g in boundary):
            source, nvml_pid = SOURCE_NSPID, view.nspid
        else:
            continue
        owners[(g.uuid, nvml_pid)] = view.pid
        # A process on a MIG device is on its physical GPU too; one on the physical GPU's
        # list is on some slice of it, which one is not known.
        for h in gpus:
            if h == g or (h.index == g.index and not h.is_mig):
                found.setdefault(h, set()).add(source)
    informed = usable is not None or bool(found)
    why = ""
    if not informed:
        env = (f"environment unreadable ({view.why})" if view.environ is None
               else "environment names no GPU of this node" if view.environ
               else "neither variable set")
        why = f"{env}; on no GPU's process list"
    ordered = {g: frozenset(found[g]) for g in gpus if g in found}  # in the devices' order
    return TargetGpus(view.pid, ordered, informed, why)


def decide(setting: str, views: Sequence[TargetView],
           samples: Sequence[DeviceSample]) -> Attribution:
    """The GPUs to report this pass under the ``gpus`` setting (module docstring)."""
    gpus = [s.gpu for s in samples]
    listed = {s.gpu: s.process_memory_bytes.keys() for s in samples}
    owners: dict[tuple[str, int], int] = {}
    targets = tuple(_target(v, gpus, listed, owners) for v in views)
    if setting == MODE_ALL:
        return Attribution(MODE_ALL, dict.fromkeys(gpus, frozenset({SOURCE_ALL})), targets,
                           owners)
    if not any(t.informed for t in targets):
        # No target is on any list, so no NVML PID has an owner.
        return Attribution(MODE_UNKNOWN, dict.fromkeys(gpus, frozenset({SOURCE_UNKNOWN})),
                           targets)
    union: dict[GPUIdentity, frozenset[str]] = {}
    for t in targets:
        for g, sources in t.gpus.items():
            union[g] = union.get(g, frozenset()) | sources
    # In the devices' order, as every other per-GPU series.
    return Attribution(MODE_TARGETS, {g: union[g] for g in gpus if g in union}, targets,
                       owners)


def samples(att: Attribution) -> list[Sample]:
    """The attribution series of one pass."""
    out: list[Sample] = [(WATCHED_GPUS.name, (att.mode,), float(len(att.gpus)))]
    for g, sources in att.gpus.items():
        out.extend((ATTRIBUTION.name, g.labels + (s,), {}) for s in sorted(sources))
    return out


def explain(att: Attribution) -> list[tuple[str, str]]:
    """(what, detail) lines for people (``mrc-agent doctor``): each target's GPUs with their
    sources, then the decision."""
    def gpu_list(gpus: Mapping[GPUIdentity, frozenset[str]]) -> str:
        return ", ".join(f"{g.index} {g.uuid} ({'+'.join(sorted(s))})" for g, s in gpus.items())

    lines = []
    for t in att.targets:
        detail = gpu_list(t.gpus) if t.gpus else ("none" if t.informed else
                                                   f"no information: {t.why}")
        lines.append((f"GPUs of target {t.pid}", detail))
    chosen = {
        MODE_TARGETS: "the targets' GPUs",
        MODE_UNKNOWN: "every GPU: no target says which GPUs it uses",
        MODE_ALL: "every GPU (--gpus all)",
    }[att.mode]
    shown = ", ".join(str(g.index) for g in att.gpus) or "none"
    lines.append(("GPU attribution", f"{att.mode}: {chosen}; reporting GPU(s) {shown}"))
    return lines
