"""Turn what a user passes as an image (a path, bytes, a PIL image) into a fully decoded PIL image.

Every failure is a one-line `BadInputError` that names the image and says why: the file is missing,
the data is not an image, the file is truncated (we force a full decode, PIL is lazy otherwise), the
image is over the pixel limit (a decompression bomb guard that replaces PIL's own warning/error), or
it is degenerate (zero-sized, or an aspect ratio the Qwen2-VL resizing rules refuse).

Small images are not refused: the processor upscales them to `min_pixels` exactly as the reference
processor does (a 1x1 image becomes 56x56), so a tiny image is valid input.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

from engine.errors import BadInputError

MAX_IMAGE_PIXELS = 50_000_000    # refuse images above 50 megapixels (decompression bomb guard)
MAX_ASPECT_RATIO = 200           # the reference's smart_resize refuses ratios above this


def _describe(image, index: int | None) -> str:
    where = f"image {index}" if index is not None else "image"
    if isinstance(image, (str, os.PathLike)):
        return f"{where} '{image}'"
    if isinstance(image, (bytes, bytearray, memoryview)):
        return f"{where} ({len(image)} bytes)"
    return where


def load_image(image, *, index: int | None = None, max_pixels: int = MAX_IMAGE_PIXELS):
    """A path (str/Path), encoded bytes, or a PIL image -> a loaded PIL image (any mode; the processor
    converts to RGB). `index` names the image in messages ("image 2 ...")."""
    from PIL import Image, UnidentifiedImageError

    what = _describe(image, index)
    if isinstance(image, Image.Image):
        _check_size(image.width, image.height, what, max_pixels)
        try:
            image.load()
        except (OSError, ValueError) as exc:
            raise BadInputError(f"{what}: cannot be decoded ({_reason(exc)})") from exc
        return image
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise BadInputError(f"{what}: no such file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise BadInputError(f"{what}: cannot be read ({exc.strerror or exc})") from exc
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    else:
        raise BadInputError(f"{what}: expected a file path, image bytes or a PIL image, "
                            f"got {type(image).__name__}")
    if not data:
        raise BadInputError(f"{what}: empty (0 bytes), not an image")
    # PIL's own guard warns above MAX_IMAGE_PIXELS and raises above twice that; we check the size from
    # the header ourselves (before any pixel is decoded) and silence PIL's, so the message is ours.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:
            raise BadInputError(f"{what}: over the {max_pixels / 1e6:g} megapixel limit "
                                "(a decompression bomb?)") from exc
        except UnidentifiedImageError as exc:
            raise BadInputError(f"{what}: not an image (PIL cannot identify the format)") from exc
        except (OSError, ValueError, SyntaxError) as exc:
            raise BadInputError(f"{what}: not a readable image ({_reason(exc)})") from exc
        _check_size(img.width, img.height, what, max_pixels)
        try:
            img.load()  # force the full decode: a truncated file fails here, not later
        except Image.DecompressionBombError as exc:
            raise BadInputError(f"{what}: over the {max_pixels / 1e6:g} megapixel limit "
                                "(a decompression bomb?)") from exc
        except (OSError, ValueError, SyntaxError) as exc:
            msg = _reason(exc)
            kind = "truncated" if "truncat" in msg.lower() else "corrupt"
            raise BadInputError(f"{what}: {kind} image data, cannot be decoded ({msg})") from exc
    return img


def _check_size(width: int, height: int, what: str, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise BadInputError(f"{what}: has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise BadInputError(f"{what}: {width}x{height} is {width * height / 1e6:.1f} megapixels, over the "
                            f"{max_pixels / 1e6:g} megapixel limit (a decompression bomb?); downscale it first")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise BadInputError(f"{what}: {width}x{height} has an aspect ratio of {ratio:.0f}:1, over the "
                            f"{MAX_ASPECT_RATIO}:1 the model's image resizing accepts")


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
