"""What a caller gives to predict on -- untrusted bytes -> raw (N, C, H, W) float32 pixels.

Accepted: an encoded image (PNG, JPEG, BMP, PGM/PPM: decoded and resized down exactly as
the fine-tune reads its image folders, edge_agent.data), a `.npy` array (one sample
(C, H, W), (H, W) for one channel, flat C*H*W, or a batch (N, C, H, W)), an `.npz` with an
array `x` of the same forms, or JSON `{"array": nested lists}`. The kind comes from the
content type when the caller names one, else from the bytes' magic. Sizes are checked
before decoding (pixels from the image header, array shapes from the npy header); every
refusal is an `InputRejected` whose message says what was wrong and what is accepted.
"""

from __future__ import annotations

import ast
import io
import json
import math
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
DEFAULT_MAX_PIXELS = 4_000_000  # e.g. 2000 x 2000: an RGB decode of 12 MB
DEFAULT_MAX_SAMPLES = 256  # one request's batch
IMAGE_TYPES = ("image/png", "image/jpeg", "image/bmp", "image/x-portable-graymap", "image/x-portable-pixmap", "image/x-ms-bmp")
ARRAY_TYPES = ("application/x-npy", "application/octet-stream")
ACCEPTED = ("an image (PNG, JPEG, BMP, PGM/PPM), a .npy array (application/x-npy), an .npz with 'x' "
            "(application/zip) or JSON {\"array\": [...]}")


class InputRejected(InputError):
    """Bytes that are not a usable input; `status` is the HTTP answer (400, 413, 415, 422)."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def kind_of(data: bytes, content_type: str = "") -> str:
    """'image' | 'npy' | 'npz' | 'json' from the content type, else from the magic bytes."""
    ctype = content_type.split(";", 1)[0].strip().lower()
    if ctype.startswith("image/"):
        return "image"
    if ctype in ("application/x-npy", "application/npy"):
        return "npy"
    if ctype in ("application/zip", "application/x-npz"):
        return "npz"
    if ctype == "application/json":
        return "json"
    if ctype and ctype not in ("application/octet-stream", "application/x-www-form-urlencoded"):
        raise InputRejected(f"content type {ctype!r} is not accepted; send {ACCEPTED}", 415)
    if data.startswith(NPY_MAGIC):
        return "npy"
    if data.startswith(ZIP_MAGIC):
        return "npz"
    if data[:1] in (b"{", b"["):
        return "json"
    return "image"


def samples_from_array(arr: np.ndarray, spec: Any, *, max_samples: int = DEFAULT_MAX_SAMPLES,
                       where: str = "array") -> np.ndarray:
    """A numeric array of one sample or a batch -> raw (N, C, H, W) float32, checked."""
    c, h, w = spec.shape
    shape = tuple(arr.shape)
    if arr.dtype.kind not in "fiub":
        raise InputRejected(f"{where}: values of type {arr.dtype}, not numbers")
    if shape in ((c, h, w), (c * h * w,)) or (c == 1 and shape == (h, w)):
        batch = arr.reshape(1, c, h, w)
    elif len(shape) >= 2 and (shape[1:] in ((c, h, w), (c * h * w,)) or (c == 1 and shape[1:] == (h, w))):
        batch = arr.reshape(shape[0], c, h, w)
    else:
        raise InputRejected(f"{where}: shape {shape}; the model takes ({c}, {h}, {w}) per sample "
                            f"(or ({h}, {w}) for one channel, ({c * h * w},) flattened, or a batch (N, {c}, {h}, {w}))")
    if len(batch) > max_samples:
        raise InputRejected(f"{where}: {len(batch)} samples in one request; at most {max_samples}", 413)
    if len(batch) == 0:
        raise InputRejected(f"{where}: no samples")
    raw = batch.astype(np.float32)
    if not np.isfinite(raw).all():
        raise InputRejected(f"{where}: NaN or infinite value")
    return raw


def _npy_header(data: bytes, where: str) -> tuple[dict[str, Any], int]:
    """The .npy header (format 1.0 to 3.0) and where the data starts. Parsed here with
    ast.literal_eval: numpy's own reader tokenizes the header, which cost more than running
    the digits model."""
    if len(data) < 10 or not data.startswith(NPY_MAGIC):
        raise InputRejected(f"{where}: not a .npy array (bad magic)", 400)
    major = data[6]
    if major == 1:
        size, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        size, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise InputRejected(f"{where}: .npy format version {major} is not supported", 400)
    if size > 64 * 1024 or start + size > len(data):
        raise InputRejected(f"{where}: not a .npy array (header of {size} bytes)", 400)
    try:
        header = ast.literal_eval(data[start:start + size].decode("latin1" if major < 3 else "utf-8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise InputRejected(f"{where}: not a .npy array (unreadable header)", 400) from None
    if not isinstance(header, dict) or not {"descr", "fortran_order", "shape"} <= header.keys():
        raise InputRejected(f"{where}: not a .npy array (header without descr, fortran_order, shape)", 400)
    shape = header["shape"]
    if not isinstance(shape, tuple) or len(shape) > 8 or not all(isinstance(v, int) and v >= 0 for v in shape):
        raise InputRejected(f"{where}: .npy shape {str(shape)[:60]} is not a shape", 400)
    return header, start + size


def _npy(data: bytes, spec: Any, max_samples: int, where: str) -> np.ndarray:
    header, offset = _npy_header(data, where)
    shape = header["shape"]
    if math.prod(shape) > max_samples * math.prod(spec.shape):
        raise InputRejected(f"{where}: array of shape {tuple(shape)} is larger than {max_samples} samples "
                            f"of {tuple(spec.shape)}", 413)
    try:
        dtype = np.dtype(header["descr"])
    except (TypeError, ValueError):
        raise InputRejected(f"{where}: .npy type {str(header['descr'])[:40]!r} is not a numpy type") from None
    if dtype.hasobject:
        raise InputRejected(f"{where}: object arrays are not accepted")
    count = math.prod(shape)
    if len(data) - offset < count * dtype.itemsize:
        raise InputRejected(f"{where}: the .npy data is shorter than its shape {tuple(shape)} says", 400)
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    arr = arr.reshape(shape[::-1]).T if header["fortran_order"] else arr.reshape(shape)
    return samples_from_array(arr, spec, max_samples=max_samples, where=where)


def _npz(data: bytes, spec: Any, max_samples: int, where: str) -> np.ndarray:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            if "x.npy" not in names:
                raise InputRejected(f"{where}: the .npz needs an array 'x' (has {', '.join(names)[:80] or 'none'})")
            info = archive.getinfo("x.npy")
            if info.file_size > 4 * (max_samples * math.prod(spec.shape) * 8 + 4096):
                raise InputRejected(f"{where}: 'x' is {info.file_size} bytes uncompressed; too large", 413)
            inner = archive.read("x.npy")
    except zipfile.BadZipFile as exc:
        raise InputRejected(f"{where}: not a readable .npz ({exc})", 400) from None
    return _npy(inner, spec, max_samples, f"{where}: x")


def _json(data: bytes, spec: Any, max_samples: int, where: str) -> np.ndarray:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InputRejected(f"{where}: not JSON ({str(exc)[:120]})", 400) from None
    if not isinstance(obj, dict) or "array" not in obj:
        raise InputRejected(f"{where}: JSON must be an object with \"array\": nested lists of numbers", 400)
    try:
        arr = np.asarray(obj["array"], dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise InputRejected(f"{where}: \"array\" is not a regular nested list of numbers ({str(exc)[:80]})") from None
    return samples_from_array(arr, spec, max_samples=max_samples, where=where)


def _image(data: bytes, spec: Any, max_pixels: int, where: str) -> np.ndarray:
    from ..sample_decode import ImageTooSmall, decode_image_bytes

    if spec.shape[0] not in (1, 3):
        raise InputRejected(f"{where}: this model takes {spec.shape[0]} channels; send an array, not an image", 415)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InputRejected(f"{where}: decoding images needs Pillow on this device; send an array", 415) from None
    try:
        return decode_image_bytes(data, spec, max_pixels=max_pixels)
    except ImageTooSmall as exc:
        raise InputRejected(f"{where}: {exc}; images are never blown up") from None
    except UnidentifiedImageError:
        raise InputRejected(f"{where}: not an image (nor an array); send {ACCEPTED}", 415) from None
    except Image.DecompressionBombError as exc:
        raise InputRejected(f"{where}: {exc}", 413) from None
    except (ValueError, OSError, SyntaxError) as exc:
        status = 413 if "pixels" in str(exc) else 422
        raise InputRejected(f"{where}: unusable image ({str(exc)[:160]})", status) from None


def decode(data: bytes, spec: Any, *, content_type: str = "", max_pixels: int = DEFAULT_MAX_PIXELS,
           max_samples: int = DEFAULT_MAX_SAMPLES, where: str = "request body") -> np.ndarray:
    """Untrusted bytes -> raw (N, C, H, W) float32 for a model with input `spec`."""
    if not data:
        raise InputRejected(f"{where}: empty; send {ACCEPTED}", 400)
    kind = kind_of(data, content_type)
    if kind == "npy":
        return _npy(data, spec, max_samples, where)
    if kind == "npz":
        return _npz(data, spec, max_samples, where)
    if kind == "json":
        return _json(data, spec, max_samples, where)
    return _image(data, spec, max_pixels, where)


# ---------------------------------------------------------------- files for `predict`

FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".pgm", ".ppm", ".npy", ".npz")


def expand_paths(paths: list[str], *, max_files: int = 100_000) -> Iterator[Path | None]:
    """Files named, and the files with known suffixes under folders named (sorted), in
    order; None stands for `-` (standard input). A path that does not exist is an error."""
    count = 0
    for name in paths:
        if name == "-":
            yield None
            continue
        p = Path(name)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in FILE_SUFFIXES
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
        elif p.is_file():
            found = [p]
        else:
            raise InputError(f"{p}: no such file or folder")
        for f in found:
            count += 1
            if count > max_files:
                raise InputError(f"more than {max_files} files to predict on; split the job")
            yield f
