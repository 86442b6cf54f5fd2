"""Calibration samples for `model create`: an array, an .npz, or a folder of .npy arrays and
images (labelled sub-folders too), validated against the bundle's input spec.

Split from bundle_create.py, which quantises with what this returns.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from ..atomic import read_limited
from ..errors import InputError
from .bundle import MAX_FILE_BYTES, InputSpec, _load_npz_array, check_calibration


def load_calibration(source: str | os.PathLike[str] | np.ndarray, spec: InputSpec, *,
                     max_files: int = 10_000) -> np.ndarray:
    """Calibration samples as normalised NCHW float32, validated against `spec`.

    `source` is an array (already normalised), an .npz (array "x", "data" or "images", or
    its only array: already normalised NCHW), or a folder of .npy arrays (normalised, one
    CHW sample or an NCHW batch each) and/or images (.png/.jpg/.bmp/.pgm: raw pixels,
    resized to the input size and normalised with the input spec; needs Pillow). The
    folder may also hold them in sub-folders, one level down: a labelled data folder as
    `edge-agent finetune --data` takes it calibrates with all its classes."""
    if isinstance(source, np.ndarray):
        return check_calibration(source, spec, where="calibration array")
    path = Path(source)
    if path.is_file():
        return _load_npz_array(read_limited(path, MAX_FILE_BYTES), spec, where=str(path), key=None)
    if not path.is_dir():
        raise InputError(f"{path}: calibration data not found (need an .npz file or a folder)")
    visible = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    files = [p for p in visible if p.is_file()]
    for folder in (p for p in visible if p.is_dir()):  # label sub-folders: every class calibrates
        files += sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        if len(files) > max_files:
            break
    if len(files) > max_files:
        raise InputError(f"{path}: {len(files)} files, over the limit of {max_files}")
    batches: list[np.ndarray] = []
    for item in files:
        suffix = item.suffix.lower()
        if suffix == ".npy":
            try:
                array = np.load(io.BytesIO(read_limited(item, MAX_FILE_BYTES)), allow_pickle=False)
            except ValueError as exc:
                raise InputError(f"{item}: not a readable .npy array ({exc})") from None
            batches.append(check_calibration(array[None] if array.ndim == 3 else array, spec, where=str(item)))
        elif suffix in (".png", ".jpg", ".jpeg", ".bmp", ".pgm", ".ppm"):
            batches.append(_load_image(item, spec))
    if not batches:
        raise InputError(f"{path}: no .npy or image files (in the folder or its sub-folders)")
    return np.concatenate(batches, axis=0)


def calibration_shape(source: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """(C, H, W) of the calibration arrays (an .npz, or the first .npy of a folder), for
    sources that do not carry their input shape (an MXNet symbol); None for images only."""
    import zipfile

    path = Path(source)
    if path.is_file():
        data = read_limited(path, MAX_FILE_BYTES)
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                if sum(i.file_size for i in zf.infolist()) > MAX_FILE_BYTES:
                    raise InputError(f"{path}: over the limit of {MAX_FILE_BYTES} bytes uncompressed")
            npz = np.load(io.BytesIO(data), allow_pickle=False)
            key = next((k for k in ("x", "data", "images") if k in npz.files),
                       npz.files[0] if len(npz.files) == 1 else None)
            shape = npz[key].shape if key else ()
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
            raise InputError(f"{path}: not a readable NPZ file ({exc})") from None
    elif path.is_dir():
        visible = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        files = [p for p in visible if p.is_file()] + [
            f for d in visible if d.is_dir() for f in sorted(d.iterdir()) if f.is_file()]
        first = next((f for f in files if f.suffix.lower() == ".npy"), None)
        if first is None:
            return None
        try:
            shape = np.load(io.BytesIO(read_limited(first, MAX_FILE_BYTES)), allow_pickle=False).shape
        except ValueError as exc:
            raise InputError(f"{first}: not a readable .npy array ({exc})") from None
    else:
        raise InputError(f"{path}: calibration data not found (need an .npz file or a folder)")
    if len(shape) not in (3, 4) or min(shape, default=0) <= 0:
        raise InputError(f"{path}: calibration arrays have shape {tuple(shape)}, not (N, C, H, W)")
    return tuple(int(v) for v in shape[-3:])  # type: ignore[return-value]


def _load_image(path: Path, spec: InputSpec) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise InputError(f"{path}: reading images needs Pillow (pip install Pillow), or give .npy/.npz") from None
    channels, height, width = spec.shape
    if channels not in (1, 3):
        raise InputError(f"{path}: images can only feed 1- or 3-channel inputs, this model has {channels}")
    from ..sample_decode import ImageRefused, image_pixels

    try:
        with Image.open(io.BytesIO(read_limited(path, 64 << 20))) as img:
            if img.width * img.height > 64_000_000:  # decompression bomb guard
                raise InputError(f"{path}: {img.width}x{img.height} image is too large")
            # the fine-tune's own decoding (16-bit scaled, not clipped; alpha refused), with
            # the bicubic filter calibration always resized with
            pixels = image_pixels(img, channels, (width, height), resample=Image.BICUBIC)
    except ImageRefused as exc:
        raise InputError(f"{path}: {exc.reason}: {exc}") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(f"{path}: not a readable image ({exc})") from None
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return check_calibration(spec.normalise(chw[None]), spec, where=str(path))
