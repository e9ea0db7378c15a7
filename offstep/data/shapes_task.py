"""The ``shapes`` task: a 56x56 picture of 1 to ``max_shapes`` filled shapes (squares, discs,
triangles in random colours and places), and the question "How many shapes are in the image?".
Scored by the last number in the reply (data_source ``"shapes"``). The images are PNG bytes in
verl's multimodal ``images`` column, with ``<image>`` in the prompt; everything is drawn in code.
The tiny random model (``model.path=tiny_vl``) cannot learn it: it shows the mechanics only."""

from __future__ import annotations

import io

import numpy as np

from offstep.errors import ConfigError

SHAPES_INSTRUCTION = "Answer with a number."
_SIZE = 56
_COLOURS = ("red", "green", "blue", "black", "orange", "purple")


def _picture(rng, count: int) -> tuple[bytes, str]:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (_SIZE, _SIZE), "white")
    draw = ImageDraw.Draw(img)
    key = []
    for _ in range(count):
        x, y = (int(v) for v in rng.integers(0, _SIZE - 12, size=2))
        kind, colour = int(rng.integers(3)), _COLOURS[int(rng.integers(len(_COLOURS)))]
        box = [x, y, x + 11, y + 11]
        if kind == 0:
            draw.rectangle(box, fill=colour)
        elif kind == 1:
            draw.ellipse(box, fill=colour)
        else:
            draw.polygon([(x, y + 11), (x + 11, y + 11), (x + 5, y)], fill=colour)
        key.append(f"{kind}{colour}{x},{y}")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), ";".join(key)


def shapes(n: int, seed: int, max_shapes: int = 4) -> list[dict]:
    """``n`` distinct pictures of 1..``max_shapes`` shapes (see the module docstring)."""
    if not 1 <= int(max_shapes) <= 9:
        raise ConfigError(f"shapes: max_shapes must be in 1..9, got {max_shapes}.")
    rng = np.random.default_rng([int(seed), 0x5A9E])

    rows, seen = [], set()
    for _ in range(50 * int(n) + 2000):
        if len(rows) == int(n):
            return rows
        count = int(rng.integers(1, int(max_shapes) + 1))
        png, key = _picture(rng, count)
        if key in seen:
            continue
        seen.add(key)
        rows.append(
            {
                "data_source": "shapes",
                "prompt": [
                    {"role": "user", "content": f"<image>How many shapes are in the image? {SHAPES_INSTRUCTION}"}
                ],
                "images": [{"bytes": png, "path": None}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": str(count)},
                "extra_info": {"count": count, "shapes": key},  # key: the picture drawn, distinct per row
            }
        )
    raise ConfigError(f"shapes: could only draw {len(rows)} distinct pictures of {n}. Fix: request fewer.")
