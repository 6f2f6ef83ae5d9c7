"""Image decoding and preprocessing for the MRC chain, with every limit checked before the work.

The order of checks is the point of this package: cheap refusals first, so a hostile input never
costs more than its header.

1. :func:`decode_base64` refuses by the *encoded* length before decoding anything.
2. :func:`probe` reads only the header: size in bytes, format (a fixed allowlist, so Pillow never
   hands a stream to Ghostscript or another exotic plugin), structure within counts no real
   image exceeds (a crafted header costs milliseconds), pixel count (a 50000×50000 PNG is
   refused here from 33 bytes of IHDR, with no allocation), with Pillow's own
   decompression-bomb check as a backstop.
3. :func:`preprocess` decodes and produces the model input and the OCR image; on the event loop,
   :func:`preprocess_async` runs it on a :class:`DecodePool` under the decode timeout.

The rooms, one concern each (an arrow means "imports"):

* :mod:`~mrc_agent.reference_service.preprocess.b64`: base64 and ``data:`` URL decoding, refused by
length
  first (:func:`decode_base64`, :func:`max_encoded_len`).
* :mod:`~mrc_agent.exporters.imagewalk` (shared with the OpenAI meter): the bounded walk of a
  stream's structure before Pillow parses it, and the magic numbers (:func:`~.imagewalk.walk`).
* :mod:`~mrc_agent.reference_service.preprocess.header`: the format allowlist and every limit the
header
  decides (:func:`probe`). header → structure.
* :mod:`~mrc_agent.reference_service.preprocess.decoding`: JPEG draft-mode decode, colour modes to
RGB,
  EXIF orientation and the geometry both resize paths share. decoding → header.
* :mod:`~mrc_agent.reference_service.preprocess.cpu`: the "pil" resize path (Lanczos with
  ``reducing_gap``, greyscale OCR shrink). cpu → decoding.
* :mod:`~mrc_agent.reference_service.preprocess.gpu`: the "kornia" resize path, antialiased, on the
device
  (:func:`kornia_resize`). gpu → decoding.
* :mod:`~mrc_agent.reference_service.preprocess.naive`: the slow path ``--preprocess naive`` keeps
  for the demo (full decode, plain Lanczos, a Python pixel loop on one thread). naive → decoding.
* :mod:`~mrc_agent.reference_service.preprocess.pool`: :class:`DecodePool`, daemon threads, the
timeout and
  the stuck-thread cap; it knows nothing of images.
* :mod:`~mrc_agent.reference_service.preprocess.core`: :func:`preprocess`, :func:`preprocess_async`
and
  their result, ``Preprocessed``. core → decoding, cpu, gpu, pool, and
  :mod:`~mrc_agent.reference_service.device` (waiting for the device before the stage ends).

Everything used outside the package is re-exported here: import from
``reference_service.preprocess``.
"""

from __future__ import annotations

from mrc_agent.reference_service.preprocess.b64 import decode_base64, max_encoded_len
from mrc_agent.reference_service.preprocess.core import (
    ResizeBackend,
    preprocess,
    preprocess_async,
    probe_async,
)
from mrc_agent.reference_service.preprocess.gpu import kornia_resize
from mrc_agent.reference_service.preprocess.header import probe
from mrc_agent.reference_service.preprocess.pool import DecodePool

__all__ = [
    "DecodePool",
    "ResizeBackend",
    "decode_base64",
    "kornia_resize",
    "max_encoded_len",
    "preprocess",
    "preprocess_async",
    "probe",
    "probe_async",
]
