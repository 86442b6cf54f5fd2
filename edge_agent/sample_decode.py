"""One sample's pixels from untrusted bytes: an encoded image (any PIL mode with a known
full scale, raw 0..255 whatever its bit depth, resized down to the model's input, never
blown up) or a `.npy` array of raw values. Training's loader (data.py), the local
inference service and its sample store, and `model create`'s calibration all decode
through here, so a sample means the same numbers everywhere.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

MAX_IMAGE_PIXELS = 40_000_000  # decompression-bomb guard, checked before decoding


class ImageRefused(ValueError):
    """An image the decoder will not turn into pixels, with the skip reason to count."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ImageTooSmall(ImageRefused):
    """An image smaller than the model's input: blowing it up would invent the detail."""

    def __init__(self, detail: str) -> None:
        super().__init__("too-small", detail)


# How each PIL mode becomes raw 0..255 pixels. A mode in no table is refused by name.
# 8-bit modes PIL converts to L / RGB itself (palette, 1-bit, CMYK, YCbCr and HSV formulas).
_EIGHT_BIT_MODES = frozenset({"1", "L", "P", "RGB", "RGBX", "CMYK", "YCbCr", "HSV"})
# Modes with an alpha band: read only when every pixel is opaque, then without it.
_ALPHA_MODES = frozenset({"LA", "La", "PA", "RGBA", "RGBa"})
# 16-bit grey: full scale 65535, whatever the file's byte order.
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
# 32-bit integer pixels are 16-bit grey only from these formats (Pillow < 10 opens a 16-bit
# PNG as "I"; a PGM/PPM with maxval > 255 is scaled to 0..65535); elsewhere the range is unknown.
_SIXTEEN_BIT_I_FORMATS = frozenset({"PNG", "PPM"})
_REFUSED_MODES = {
    "F": "floating-point pixels have no known full scale",
    "I": "32-bit integer pixels have no known full scale",
    "LAB": "CIELab pixels: convert the image to RGB first",
}
_SIXTEEN_BIT_SCALE = 255.0 / 65535.0


def _opaque(img: Any) -> Any:
    """`img` without its alpha; `ImageRefused` when any pixel is not fully opaque (the model
    sees no alpha, and which background to flatten onto is the owner's choice)."""
    if img.mode in _ALPHA_MODES:
        alpha = np.asarray(img.getchannel("A"))
    elif "transparency" in img.info and img.mode in _SIXTEEN_BIT_MODES | {"I"}:
        alpha = np.where(np.asarray(img) == img.info["transparency"], 0, 255)
    elif "transparency" in img.info:
        alpha = np.asarray(img.convert("RGBA").getchannel("A"))
    else:
        return img
    clear = int(np.count_nonzero(alpha < 255))
    if clear:
        raise ImageRefused("transparent-image", f"{clear} of {alpha.size} pixels are (partly) transparent; the model "
                                            "sees no alpha: flatten the image onto its background first")
    if img.mode in ("LA", "La"):
        return img.getchannel("L")  # La (premultiplied) equals LA when every alpha is 255
    if img.mode in ("1", "L", "RGB") or img.mode in _SIXTEEN_BIT_MODES | {"I"}:
        return img  # no pixel has the transparent colour: the image is its own opaque self
    from PIL import Image

    rgb = img if img.mode in ("RGBA", "RGBa") else img.convert("RGBA")  # P, PA: through the palette
    return Image.merge("RGB", rgb.split()[:3])


def image_pixels(img: Any, channels: int, size: tuple[int, int], *, resample: int | None = None) -> np.ndarray:
    """Raw pixels of a decoded PIL image on a 0..255 scale whatever its mode and depth, as
    float32 (H, W) for 1 channel or (H, W, 3), resized to `size` (W, H) (default filter:
    bilinear). ImageRefused (with its skip reason) for transparent pixels or a mode with no
    known full scale. Shared by local data and the calibration images of `model create`."""
    return _pixels(_opaque(img), channels, size, resample)


def _pixels(img: Any, channels: int, size: tuple[int, int], resample: int | None = None) -> np.ndarray:
    """Raw 0..255 float32 pixels of an opaque image at `size` (W, H): (H, W) or (H, W, 3)."""
    from PIL import Image

    resample = Image.BILINEAR if resample is None else resample
    mode = img.mode
    if mode in _EIGHT_BIT_MODES:
        converted = img.convert("L" if channels == 1 else "RGB")
        if converted.size != size:
            converted = converted.resize(size, resample)
        return np.asarray(converted, dtype=np.float32)
    sixteen = mode in _SIXTEEN_BIT_MODES or (mode == "I" and img.format in _SIXTEEN_BIT_I_FORMATS)
    if not sixteen:
        why = _REFUSED_MODES.get(mode, "no known way to read these pixels")
        raise ImageRefused("unsupported-pixels", f"PIL mode {mode!r} ({img.format or 'unknown'} file): {why}")
    values = np.asarray(img).astype(np.float32)
    if values.min() < 0 or values.max() > 65535:  # an "I" image that is not 16-bit after all
        raise ImageRefused("unsupported-pixels", f"PIL mode {mode!r}: values {values.min():g}..{values.max():g} "
                                             "are outside 16 bits")
    grey = Image.fromarray(values * np.float32(_SIXTEEN_BIT_SCALE), mode="F")  # scaled, not clipped at 255
    if grey.size != size:
        grey = grey.resize(size, resample)
    out = np.asarray(grey, dtype=np.float32)
    return out if channels == 1 else np.repeat(out[:, :, None], 3, axis=2)


def decode_image_bytes(data: bytes, spec: Any, *, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded image bytes -> raw (1, C, H, W) float32 pixels at the model's input size, as
    training reads them (converted to its channels, on a 0..255 scale whatever the file's
    mode and bit depth, resized down, never blown up); raises `ImageRefused` with its skip
    reason (`ImageTooSmall` for an image smaller than the input, transparent pixels, a mode
    with no known full scale) and ValueError on any other problem. The size is checked from
    the header, before anything is decoded."""
    from PIL import Image

    channels, height, width = spec.shape
    with Image.open(io.BytesIO(data)) as img:
        if img.width * img.height > max_pixels:
            raise ValueError(f"{img.width}x{img.height} is over {max_pixels} pixels")
        img.load()  # decode fully here: truncated files fail now, not later
        if img.width < width or img.height < height:
            raise ImageTooSmall(f"{img.width}x{img.height} is smaller than the model's input {width}x{height}")
        pixels = image_pixels(img, channels, (width, height))
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return chw[None]


def decode_array_sample(data: bytes, spec: Any) -> np.ndarray:
    """One `.npy` sample (raw values (C, H, W), or (H, W) for one channel, or flat C*H*W)
    -> raw (1, C, H, W) float32; raises ValueError on a wrong shape, a non-numeric or a
    non-finite array (no pickles)."""
    arr = np.load(io.BytesIO(data), allow_pickle=False)
    c, h, w = spec.shape
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"array of {arr.dtype}, not numbers")
    if tuple(arr.shape) not in ((c, h, w), (c * h * w,)) and not (c == 1 and tuple(arr.shape) == (h, w)):
        raise ValueError(f"array of shape {tuple(arr.shape)}; the model takes ({c}, {h}, {w})")
    raw = arr.astype(np.float32).reshape(1, c, h, w)
    if not np.isfinite(raw).all():
        raise ValueError("NaN or infinite value")
    return raw
