"""Reading the files the agent is pointed at — pidfile, token file, config file, replay trace —
without trusting them: only regular files, opened without blocking (a FIFO or a device cannot
hang the sampler or the start-up), and never more than a stated number of bytes (``/dev/zero``
or a runaway file cannot fill memory). And finding the helper programs the agent runs (py-spy,
austin): :func:`find_executable`.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys


class FileRefused(OSError):
    """The path is not a regular file, or holds more than the reader accepts."""


def read_fd(fd: int, limit: int, chunk: int = 1 << 20) -> bytes:
    """Up to ``limit`` bytes from ``fd``'s current position, in reads of at most ``chunk``,
    stopping at end of file. OSError from a read propagates; the caller closes ``fd``."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        got = os.read(fd, min(left, chunk))
        if not got:
            break
        chunks.append(got)
        left -= len(got)
    return b"".join(chunks)


def read_bounded(path: str, max_bytes: int, what: str, *, truncate: bool = False) -> bytes:
    """At most ``max_bytes`` of the regular file ``path``. Larger files raise
    :class:`FileRefused` (``truncate``: their first ``max_bytes`` are returned instead).
    Other errors (missing file, no permission) raise the usual :class:`OSError`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{what} {path} is not a regular file")
        if st.st_size > max_bytes and not truncate:
            raise FileRefused(f"{what} {path} is {st.st_size} bytes; at most {max_bytes} are read")
        # One more byte than accepted tells a file that grew since fstat.
        data = read_fd(fd, max_bytes + (0 if truncate else 1))
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileRefused(f"{what} {path} holds more than {max_bytes} bytes")
    return data


def describe(exc: OSError) -> str:
    """The reason to print for ``exc``: FileRefused says it all, others their strerror."""
    if isinstance(exc, FileRefused):
        return str(exc)
    return exc.strerror or str(exc)


def find_executable(name: str, explicit: str | None = None, *, package: str = "") -> str:
    """A helper program: ``explicit`` when given, else the one installed beside this Python
    (a virtual environment's ``bin``, where the agent's extras put it), else the first on
    ``PATH``. FileNotFoundError says which was missing: ``NAME not found at PATH`` or
    ``NAME is not installed``, the latter with how to install it when ``package`` names the
    PyPI package of the ``diagnose`` extra that brings it."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise FileNotFoundError(f"{name} not found at {explicit}")
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found is None:
        # Only when nothing was named: a wrong explicit path is a typo, not a missing install.
        hint = f" (pip install 'mrc-agent[diagnose]' or pip install {package})" if package else ""
        raise FileNotFoundError(f"{name} is not installed{hint}")
    return found
