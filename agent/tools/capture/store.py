"""The captures directory (:class:`CaptureStore`): one sub-directory per capture holding
``capture.json`` and the diagnosis files, listed, served and pruned by count, bytes and age.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mrc_agent.agent.tools.diagnose.writers import FILES

log = logging.getLogger(__name__)


META = "capture.json"
_ID = re.compile(r"^\d{8}T\d{6}Z-\d{1,10}-[0-9a-f]{6}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class CaptureStore:
    """The captures directory: one sub-directory per capture, named by its id, holding
    ``capture.json`` (the metadata) and the diagnosis files. Only directories whose names are
    capture ids and that hold a ``capture.json`` are ever listed or deleted."""

    def __init__(self, root: str, max_count: int, max_bytes: int, retention_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._clock = clock
        self._lock = threading.RLock()
        os.makedirs(root, mode=0o700, exist_ok=True)

    def _dir(self, cid: str) -> str | None:
        if not _ID.match(cid):
            return None
        path = os.path.join(self.root, cid)
        return path if os.path.isfile(os.path.join(path, META)) else None

    def create(self, alert: str, pid: int) -> str:
        now = self._clock()
        cid = (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + f"-{pid}-"
               + secrets.token_hex(3))
        with self._lock:
            os.mkdir(os.path.join(self.root, cid), 0o700)
            self._write(cid, {"id": cid, "alert": alert, "pid": pid, "started": now,
                              "started_at": _iso(now), "status": "running", "verdict": None})
        return cid

    def _write(self, cid: str, meta: dict[str, Any]) -> None:
        path = os.path.join(self.root, cid, META)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, path)

    def meta(self, cid: str) -> dict[str, Any] | None:
        path = self._dir(cid)
        if path is None:
            return None
        try:
            with open(os.path.join(path, META), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict):
            return None
        meta["files"] = self._files(path)
        meta["bytes"] = _size(path)
        return meta

    def update(self, cid: str, **fields: Any) -> None:
        with self._lock:
            meta = self.meta(cid)
            if meta is None:
                return  # deleted meanwhile
            meta.pop("files", None)
            meta.pop("bytes", None)
            meta.update(fields)
            self._write(cid, meta)

    @staticmethod
    def _files(path: str) -> list[str]:
        names = []
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False) and _FILE.match(entry.name) and (
                    entry.name != META):
                names.append(entry.name)
        order = list(FILES.values())
        return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))

    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [n for n in names if self._dir(n) is not None]

    def entries(self) -> list[dict[str, Any]]:
        """Every capture's metadata, newest first."""
        metas = [m for m in (self.meta(c) for c in self.ids()) if m is not None]
        return sorted(metas, key=lambda m: (m.get("started", 0), m["id"]), reverse=True)

    def file_path(self, cid: str, name: str) -> str | None:
        """The path of one file of one capture, or None: no path outside that directory, no
        link, nothing but a plain file with a plain name."""
        path = self._dir(cid)
        if path is None or not _FILE.match(name) or name.endswith(".tmp"):
            return None
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        real = os.path.realpath(full)
        if os.path.dirname(real) != os.path.realpath(path):
            return None
        return full

    def bytes_of(self, cid: str) -> int:
        """Bytes the capture ``cid`` takes on disk (0 when it is gone)."""
        return _size(os.path.join(self.root, cid))

    def usage(self) -> tuple[int, int]:
        ids = self.ids()
        return len(ids), sum(self.bytes_of(c) for c in ids)

    def prune(self, keep: Sequence[str] = (), room_for: int = 0) -> list[str]:
        """Delete captures past retention, then the oldest until at most ``max_count -
        room_for`` remain and their bytes fit ``max_bytes``. ``keep`` (the running capture) is
        never deleted. Returns the ids deleted."""
        deleted = []
        with self._lock:
            metas = sorted(self.entries(), key=lambda m: (m.get("started", 0), m["id"]))
            now = self._clock()
            alive = []
            for m in metas:
                if m["id"] not in keep and now - float(m.get("started", 0)) > self.retention_s:
                    deleted.append(m["id"])
                else:
                    alive.append(m)
            total = sum(int(m["bytes"]) for m in alive)
            count = len(alive)
            for m in list(alive):
                if count <= self.max_count - room_for and total <= self.max_bytes:
                    break
                if m["id"] in keep:
                    continue
                deleted.append(m["id"])
                count -= 1
                total -= int(m["bytes"])
            for cid in deleted:
                shutil.rmtree(os.path.join(self.root, cid), ignore_errors=True)
        if deleted:
            log.info("captures deleted (retention/limits): %s", ", ".join(deleted))
        return deleted


def _size(path: str) -> int:
    total = 0
    try:
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return total  # deleted meanwhile: what was counted stands
    return total


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

