"""Images for the next message: which dropped files are images, and copies kept in the user data folder
(pasted images are saved as PNG), so a conversation's pictures survive the originals moving."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from PySide6.QtGui import QImage, QImageReader

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
KINDS_TEXT = "PNG, JPEG, WebP, BMP or GIF"


def not_an_image_message(path: str) -> str:
    return (f"{Path(path).name} is not an image: drop or paste a {KINDS_TEXT} picture to ask a "
            "vision-language model about it.")


def text_only_message(model_name: str) -> str:
    return (f"{model_name} is a text-only model and cannot see images. To ask about a picture, choose a "
            "vision-language model (for example a Qwen2.5-VL or Qwen2-VL Hugging Face folder) in the model "
            "picker, then drop the image again.")


def is_image(path: str) -> bool:
    p = Path(path)
    if not p.is_file() or p.suffix.lower() not in IMAGE_SUFFIXES:
        return False
    reader = QImageReader(str(p))
    return reader.canRead()


def keep_copy(path: str, folder: Path) -> str:
    """Copy a dropped image into `folder` (named by content hash); returns the copy's path."""
    src = Path(path)
    digest = hashlib.sha1(src.read_bytes()).hexdigest()[:16]
    dest = folder / f"{digest}{src.suffix.lower()}"
    if not dest.exists():
        shutil.copyfile(src, dest)
    return str(dest)


def save_pasted(image: QImage, folder: Path) -> str | None:
    if image.isNull():
        return None
    dest = folder / f"pasted-{time.strftime('%Y%m%d-%H%M%S')}-{int(time.time() * 1000) % 1000:03d}.png"
    return str(dest) if image.save(str(dest), "PNG") else None
