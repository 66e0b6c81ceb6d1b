"""Reading and writing the project's files: atomic writes, and one clear error for every unreadable input.

Every file uniap-lightning writes (plans, profiles, caches, reports, exports) goes through a temporary file in the
same folder and a rename, so a concurrent reader or a crash mid-write never leaves half a file under the real
name. Every file it reads by name is checked the same way (missing, a folder, binary, not JSON) and refused with
a :class:`~uniap_lightning.errors.UniAPError` that names the file. Torch-free: the planner uses it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError


def write_bytes_atomic(path: str | Path, write: Any) -> Path:
    """``write(file)`` into a temporary file in the same folder (a binary file object), flushed to disk, then
    ``os.replace`` onto ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_json_atomic(path: str | Path, data: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def _named(what: str, path: Path) -> str:
    return f"{what}{str(path)!r}" if what.endswith("=") else f"{what} {str(path)!r}"


def read_text(path: str | Path, what: str) -> str:
    """The text of a file given by the user; a missing, unreadable or binary file is a clear error."""
    path = Path(path)
    if not path.exists():
        raise UniAPError(f"{_named(what, path)} does not exist")
    if path.is_dir():
        raise UniAPError(f"{_named(what, path)} is a folder, not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UniAPError(f"{_named(what, path)} is not a text file (byte {err.start} is not UTF-8)") from err
    except OSError as err:
        raise UniAPError(f"{_named(what, path)} cannot be read ({err.strerror or err})") from err


def read_json(path: str | Path, what: str) -> Any:
    """The JSON document in a file given by the user; anything else is a clear error naming the file."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UniAPError(f"{_named(what, path)} is not valid JSON: {err}") from err


def check_output_file(path: str | Path, what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written: a folder, or in a missing folder."""
    path = Path(path)
    if path.is_dir():
        raise UniAPError(f"{_named(what, path)} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise UniAPError(f"{_named(what, path)}: the folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UniAPError(f"{_named(what, path)}: the folder {str(parent)!r} is not writable")
    return path
