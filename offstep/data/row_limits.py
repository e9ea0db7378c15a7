"""How large a dataset file may be: checked from its metadata and size before its rows are read.

A parquet file's size says little about its rows: a constant, dictionary-encoded column holds 20
million rows in 75 KB, and reading them as Python values takes about 2 KB each (measured: 2.1 KB
per GSM8K row at the peak of ``load_records``). The row count (parquet: the footer's ``num_rows``;
JSON lines: the newlines, counted without parsing) is held to ``data.max_rows``, and the memory the
rows would take to what the machine has available.
"""

from __future__ import annotations

import os

from offstep.errors import DatasetError

DEFAULT_MAX_ROWS = 10_000_000  # verl's largest prompt sets hold a few million rows
ROW_BYTES = 1500  # Python objects per row beside the row's data (measured above: ~2.1 KB in all)
DATA_FACTOR = 3  # the data's bytes as Python strings, and the file's text or Arrow buffers beside them


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _parquet_size(path: str) -> tuple[int, int] | None:
    """(rows, uncompressed bytes) from the footer; None if it cannot be read (the reader says why)."""
    try:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
    except Exception:  # noqa: BLE001 - a damaged file: _read_parquet reports it
        return None
    return meta.num_rows, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def _json_size(path: str) -> tuple[int, int]:
    """(lines, bytes) of a JSON-lines file, counted in chunks without parsing."""
    lines, last = 0, b"\n"
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n"), os.path.getsize(path)


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_size(path: str, ext: str, max_rows: int, keys: dict) -> tuple[int, int] | None:
    """Refuse ``path`` before it is read if it holds more than ``max_rows`` rows (0: no limit), or
    if its rows would take more memory than is available; returns (rows, data bytes) where known."""
    key = keys.get("max_rows", "data.max_rows")
    if max_rows < 0:
        raise DatasetError(f"{key}={max_rows} must be >= 0 (the most rows a data file may hold; 0: no limit)")
    size = _parquet_size(path) if ext == ".parquet" else _json_size(path)
    if size is None:
        return None
    rows, data = size
    need = rows * ROW_BYTES + data * DATA_FACTOR
    if max_rows and rows > max_rows:
        raise DatasetError(
            f"{path}: {rows:,} rows ({_gb(os.path.getsize(path))} on disk), over {key}={max_rows:,}, the most a "
            f"data file may hold; reading them would take about {_gb(need)} of memory. A file this small with this "
            f"many rows is more likely broken or crafted than a real prompt set. Fix: give a file with fewer rows "
            f"(a subset of this one), or, if it really holds this many prompts, raise {key} (0: no limit) on a "
            "machine with the memory for them."
        )
    available = _available_memory()
    if available is not None and need > available:
        raise DatasetError(
            f"{path}: reading its {rows:,} rows ({_gb(data)} of data) would take about {_gb(need)} of memory, "
            f"and {_gb(available)} is available. Fix: give a file with fewer rows (a subset of this one), or run on "
            "a machine with more memory."
        )
    return size


def out_of_memory(path: str, size: tuple[int, int] | None, keys: dict) -> DatasetError:
    """The message for a MemoryError while ``path`` was read (nothing is wrong with its format)."""
    what = f" ({size[0]:,} rows, {_gb(size[1])} of data)" if size else ""
    key = keys.get("max_rows", "data.max_rows")
    return DatasetError(
        f"{path}: ran out of memory while reading its rows{what}. Fix: give a file with fewer rows (a subset of "
        f"this one; lower {key} to refuse such files before they are read), or run on a machine with more memory."
    )
