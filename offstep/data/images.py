"""The images of vision-language prompt rows (verl's multimodal layout): an ``images`` column of
image structs ``{"bytes": ..., "path": ...}`` (as Hugging Face's Image feature and verl's geo3k
preprocessing write them), raw bytes or paths, one per ``<image>`` placeholder in the prompt.

Images are read with Pillow. A path is read only from under the data file's folder and through no
symbolic link; an image's size is checked before it is decoded (decompression bombs). Each image is
fitted once, here, to the size the model's processor wants (``fit_image``: one bicubic resize) and
kept as PNG bytes, so every processor after (the engine's, the trainer's) resamples nothing and sees
the same pixels. Each image's placeholder token is expanded to its count of image tokens in token
space: Hugging Face's ``Qwen2VLProcessor`` needs torchvision, which offstep does not."""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offstep.errors import DatasetError
from offstep.files import read_bytes

PLACEHOLDER = "<image>"  # verl's image placeholder in a prompt's text
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # an image with more pixels is refused before it is decoded
MAX_IMAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ImageSpec:
    """How a model wants its images: pixels within ``[min_pixels, max_pixels]``, sides multiples of
    ``factor`` (patch size x merge size), each ``factor x factor`` block one ``image_token_id``."""

    image_token_id: int
    min_pixels: int
    max_pixels: int
    factor: int


def _where(path: str, row: int) -> str:
    return f"{path}: row {row}"


def read_images(value: Any, row: int, path: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[bytes]:
    """The image files of one row's ``images`` value (a list of structs/bytes/paths, or one), each
    checked to be an image Pillow reads of at most ``max_pixels`` pixels. :class:`DatasetError`
    naming the file, the row and the fix otherwise."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "tolist") else [value]
    out = []
    for k, item in enumerate(items):
        data = _image_bytes(item, row, k, path)
        _check_image(data, row, k, path, max_pixels)
        out.append(data)
    return out


def _image_bytes(item: Any, row: int, k: int, path: str) -> bytes:
    if isinstance(item, dict):
        if item.get("bytes"):
            return bytes(item["bytes"])
        item = item.get("path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if not isinstance(item, str) or not item:
        raise DatasetError(
            f"{_where(path, row)}: image {k} is {type(item).__name__}, not image bytes or a path. Fix: store each "
            "image as {'bytes': <file bytes>, 'path': None}, as bytes, or as a path relative to the data file's folder"
        )
    root = Path(os.path.abspath(os.path.dirname(path)))
    target = Path(os.path.abspath(root / item))
    if not target.is_relative_to(root):
        raise DatasetError(
            f"{_where(path, row)}: image {k} path {item!r} is outside the data file's folder {root}: refused. Fix: "
            "put the images under that folder, or store their bytes in the column"
        )
    if os.path.realpath(target) != os.path.join(os.path.realpath(root), os.path.relpath(target, root)):
        raise DatasetError(
            f"{_where(path, row)}: image {k} path {item!r} goes through a symbolic link: refused. Fix: copy the image "
            "file itself under the data file's folder"
        )
    if not target.is_file():
        raise DatasetError(
            f"{_where(path, row)}: image {k} file {target} is missing. Fix: put the file there, or fix the row's path"
        )
    try:
        return read_bytes(target, MAX_IMAGE_BYTES)
    except Exception as exc:  # unreadable, not a regular file, too large
        raise DatasetError(f"{_where(path, row)}: image {k} file {target} cannot be read ({exc})") from None


def _open(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _check_image(data: bytes, row: int, k: int, path: str, max_pixels: int) -> None:
    from PIL import Image

    try:
        img = _open(data)  # reads the header only
        w, h = img.size
    except Image.DecompressionBombError as exc:
        raise DatasetError(
            f"{_where(path, row)}: image {k} is too large ({exc}): refused before decoding. Fix: shrink the image"
        ) from None
    except Exception as exc:
        raise DatasetError(
            f"{_where(path, row)}: image {k} is not an image Pillow can read ({type(exc).__name__}: {exc}). Fix: "
            "store PNG or JPEG file bytes"
        ) from None
    if w * h > max_pixels:
        raise DatasetError(
            f"{_where(path, row)}: image {k} is {w}x{h} = {w * h} pixels, over data.max_image_pixels={max_pixels}: "
            "refused before decoding. Fix: shrink the image, or raise data.max_image_pixels"
        )
    try:
        img.load()
    except Exception as exc:
        raise DatasetError(
            f"{_where(path, row)}: image {k} cannot be decoded ({type(exc).__name__}: {exc}); the file is damaged "
            "or truncated. Fix: store it again"
        ) from None


def fitted_size(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """The size the model's processor resizes an image to: sides rounded to multiples of
    ``spec.factor``, pixels scaled into ``[min_pixels, max_pixels]`` keeping the aspect ratio."""
    f = spec.factor
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > spec.max_pixels:
        scale = math.sqrt(height * width / spec.max_pixels)
        h, w = max(f, math.floor(height / scale / f) * f), max(f, math.floor(width / scale / f) * f)
    elif h * w < spec.min_pixels:
        scale = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * scale / f) * f, math.ceil(width * scale / f) * f
    return h, w


def fit_image(data: bytes, spec: ImageSpec) -> tuple[bytes, int]:
    """An image (file bytes) resized once to the model's size, as PNG bytes, and its image-token count."""
    from PIL import Image

    img = _open(data).convert("RGB")
    h, w = fitted_size(img.height, img.width, spec)
    if (h, w) != (img.height, img.width):
        img = img.resize((w, h), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), (h // spec.factor) * (w // spec.factor)


def count_placeholders(messages: list[dict]) -> int:
    return sum(m["content"].count(PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))


def with_image_parts(messages: list[dict]) -> list[dict]:
    """Messages whose text has ``<image>`` placeholders, as content parts (``{"type": "image"}``
    between ``{"type": "text"}`` parts), for a vision-language chat template."""
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(m)
            continue
        parts: list[dict] = []
        for i, piece in enumerate(content.split(PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts})
    return out


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int], where: str) -> list[int]:
    """``ids`` with the ``k``-th ``image_token_id`` repeated ``counts[k]`` times."""
    found = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(found) != len(counts):
        raise DatasetError(
            f"{where}: the rendered prompt has {len(found)} image tokens for {len(counts)} images. Fix: use the "
            "model's own chat template, which renders each image part as one image token"
        )
    out: list[int] = []
    for t in ids:
        out.extend([t] * counts.pop(0) if t == image_token_id else [t])
    return out


def row_images(row: dict, i: int, path: str, messages: list[dict], image_key: str, max_pixels: int) -> list[bytes]:
    """A row's image files (``read_images`` of its ``image_key`` column), one per ``<image>``
    placeholder of its messages, or :class:`DatasetError` naming the row."""
    images = read_images(row.get(image_key), i, path, max_pixels) if image_key in row else []
    n = count_placeholders(messages)
    if n != len(images):
        raise DatasetError(
            f"{_where(path, i)}: the prompt has {n} {PLACEHOLDER} placeholders for {len(images)} images in column "
            f"{image_key!r}. Fix: put one {PLACEHOLDER} in the prompt's text where each image goes (verl's layout)"
        )
    return images


def check_image_model(records: list, spec: ImageSpec | None) -> None:
    """Rows with images need a vision-language model (``spec``): :class:`DatasetError` naming the first."""
    first = next((r for r in records if r.images), None)
    if first is not None and spec is None:
        raise DatasetError(
            f"data_source {first.data_source!r} row {first.index} has images, but model.path is a text model. Fix: "
            "use a vision-language model (Qwen2-VL, Qwen2.5-VL, or the alias tiny_vl), or drop the images column"
        )


def encode_images(record: Any, ids: list[int], spec: ImageSpec) -> tuple[list[int], tuple[bytes, ...]]:
    """A row with images: its prompt ids with each image token expanded, and its fitted images."""
    where = f"data_source {record.data_source!r} row {record.index}"
    fitted = [fit_image(b, spec) for b in record.images]
    ids = expand_image_tokens(ids, spec.image_token_id, [n for _, n in fitted], where)
    return ids, tuple(png for png, _ in fitted)
