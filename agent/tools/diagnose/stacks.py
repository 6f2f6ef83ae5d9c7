"""Collapsed stacks: :class:`Frame` and :class:`Stack`, read from py-spy's output or made from
the agent's own continuous samples, the samples per thread, the top functions by self and total
time, and the share of samples in image code.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mrc_agent.agent.core.stacks import StackSample
from mrc_agent.agent.tools.diagnose.pyspy import PY_SPY_RATE

#: Function names of CPU-side image work: decoding, resizing, colour conversion, tensor
#: conversion and normalisation, whatever library does it (PIL, OpenCV, kornia, torchvision,
#: hand-written). Matched case-insensitively anywhere in the qualified name.
IMAGE_FUNCTION = re.compile(
    r"resiz|decod|draft|thumbnail|convert|to_?tensor|normali[sz]|preprocess|interpolat|"
    r"imread|imdecode|jpe?g|png|webp|crop|rescale|warp_?affine|image|img|pixel",
    re.IGNORECASE)
#: Files of image libraries, and modules named like image or preprocessing code.
IMAGE_FILE = re.compile(
    r"(^|/)(PIL|cv2|kornia|torchvision|imageio|skimage|simplejpeg|turbojpeg|pyvips|"
    r"albumentations)(/|\.|$)|(^|/)[^/]*(preprocess|image|img|decod|resiz)[^/]*\.py$",
    re.IGNORECASE)


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None

    @property
    def key(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{self.function} ({where})" if where else self.function


@dataclass(frozen=True)
class Stack:
    thread: str
    frames: tuple[Frame, ...]  # outermost first
    count: int


_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text)
    if m is None:
        return Frame(text, "", None)
    line = m.group("line")
    return Frame(m.group("fn"), m.group("file"), int(line) if line else None)


def _thread_label(head: str) -> str:
    """``thread (123): MainThread`` -> ``MainThread (123)``; ``thread (0x7f…)`` as is."""
    m = re.match(r"^thread \((?P<tid>[^)]*)\)(?::\s*(?P<name>.*))?$", head)
    if m is None:
        return head
    tid, name = m.group("tid"), m.group("name")
    return f"{name} ({tid})" if name else f"thread {tid}"


def parse_collapsed(text: str) -> list[Stack]:
    """py-spy's raw output: ``[thread (TID): NAME;]frame;frame;... COUNT`` per line."""
    out: list[Stack] = []
    for line in text.splitlines():
        body, _, count = line.rstrip().rpartition(" ")
        if not body or not count.isdigit():
            continue
        parts = body.split(";")
        thread = "all threads"
        while parts and parts[0].startswith(("thread (", "process (")):
            head = parts.pop(0)
            if head.startswith("thread ("):
                thread = _thread_label(head)
        out.append(Stack(thread, tuple(parse_frame(p) for p in parts), int(count)))
    return out


def thread_samples(stacks: Iterable[Stack]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for s in stacks:
        totals[s.thread] += s.count
    return totals


def top_functions(stacks: Sequence[Stack], limit: int = 10,
                  rate: float = PY_SPY_RATE) -> dict[str, list[dict[str, Any]]]:
    """Top functions by self time (leaf frame) and by total, inclusive time (anywhere on the
    stack, counted once per stack), keyed by function and file:line."""
    total_samples = sum(s.count for s in stacks) or 1
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    frames: dict[str, Frame] = {}
    for s in stacks:
        if not s.frames:
            continue
        leaf = s.frames[-1]
        frames[leaf.key] = leaf
        self_c[leaf.key] += s.count
        for key in {f.key for f in s.frames}:
            total_c[key] += s.count
        for f in s.frames:
            frames.setdefault(f.key, f)

    def row(key: str) -> dict[str, Any]:
        f = frames[key]
        return {"function": f.function, "file": f.file, "line": f.line, "frame": key,
                "self_samples": self_c[key], "total_samples": total_c[key],
                "self_ratio": round(self_c[key] / total_samples, 4),
                "total_ratio": round(total_c[key] / total_samples, 4),
                "self_seconds": round(self_c[key] / rate, 3),
                "total_seconds": round(total_c[key] / rate, 3)}

    by_self = sorted(self_c, key=lambda k: (-self_c[k], -total_c[k], k))[:limit]
    by_total = sorted(total_c, key=lambda k: (-total_c[k], -self_c[k], k))[:limit]
    return {"self": [row(k) for k in by_self], "total": [row(k) for k in by_total]}


def is_image_frame(frame: Frame) -> bool:
    return bool(IMAGE_FUNCTION.search(frame.function) or IMAGE_FILE.search(frame.file))


def image_share(stacks: Sequence[Stack]) -> tuple[float, list[tuple[str, int]]]:
    """Share of samples with image code on the stack, and the commonest image frames (the
    innermost matching frame of each stack)."""
    total = sum(s.count for s in stacks)
    hits = 0
    where: Counter[str] = Counter()
    for s in stacks:
        match = next((f for f in reversed(s.frames) if is_image_frame(f)), None)
        if match is not None:
            hits += s.count
            where[match.key] += s.count
    return (hits / total if total else 0.0), where.most_common(5)



def austin_frame(text: str) -> Frame:
    """One of austin's ``file:qualname:line`` frames as a :class:`Frame`."""
    head, sep, line = text.rpartition(":")
    if not sep or not line.isdigit():
        head, line = text, ""
    path, sep, qualname = head.rpartition(":")
    if not sep:
        return Frame(head, "", int(line) if line else None)
    return Frame(qualname, path, int(line) if line else None)


def from_samples(samples: Iterable[StackSample]) -> list[Stack]:
    """The agent's continuous samples (:class:`~mrc_agent.agent.core.stacks.StackSample`) as
    collapsed stacks: one :class:`Stack` per thread and distinct stack, counting its samples.
    austin's thread ``T<interpreter>:<tid>`` is labelled ``thread <tid>``."""
    counts: Counter[tuple[str, tuple[str, ...]]] = Counter(
        (s.thread.rpartition(":")[2] or s.thread, s.frames) for s in samples if s.frames)
    return [Stack(f"thread {tid}", tuple(austin_frame(f) for f in frames), n)
            for (tid, frames), n in sorted(counts.items())]


def collapsed(stacks: Iterable[Stack]) -> str:
    """``stacks`` in py-spy's raw format (``thread (TID);function (file:line);... COUNT``),
    which :func:`parse_collapsed` reads back."""
    lines = []
    for s in stacks:
        tid = s.thread.removeprefix("thread ")
        lines.append(";".join([f"thread ({tid})", *(f.key for f in s.frames)])
                     + f" {s.count}")
    return "\n".join(lines) + ("\n" if lines else "")
