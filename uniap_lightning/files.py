"""Reading and writing the project's files: atomic writes, and one clear error for every unreadable input.

Every file uniap-lightning writes (plans, profiles, caches, reports, exports) goes through a temporary file in the
same folder and a rename, so a concurrent reader or a crash mid-write never leaves half a file under the real
name. The rename replaces the directory entry, never what it points at: a symbolic or hard link under the name is
replaced as a link (a link planted in a cache towards ``/etc/passwd`` leaves that file alone), and a device
(``out=/dev/full``), a FIFO, a socket or a folder under the output name is refused.

Every file it reads by name is opened without blocking (a FIFO with no writer would wait forever), checked to be
a regular file of bounded size (``/dev/zero`` never ends), and its document parsed with bounded nesting and
number sizes (a deeply nested or huge-integer JSON, or a YAML alias bomb, must not hang or crash the reader);
anything else is refused with a :class:`~uniap_lightning.errors.UniAPError` that names the file. Torch-free: the
planner uses it too.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from uniap_lightning import yaml_limits
from uniap_lightning.errors import UniAPError
from uniap_lightning.limits import (  # noqa: F401 - re-exported: the limits have always been files.MAX_*
    MAX_DOCUMENT_BYTES,
    MAX_INTEGER_DIGITS,
    MAX_NESTING_DEPTH,
    MAX_YAML_INTERPOLATED_CHARS,
    MAX_YAML_NODES,
)


# ---------------------------------------------------------------------------------------------- file kinds
def _kind(mode: int) -> str:
    """What a non-regular file is, in words (for the error message)."""
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _named(what: str, path: Path) -> str:
    return f"{what}{str(path)!r}" if what.endswith("=") else f"{what} {str(path)!r}"


# ---------------------------------------------------------------------------------------------- writing
def cache_root() -> Path:
    """The folder the caches live under: ``$UNIAP_CACHE_DIR`` when set to a non-empty value, otherwise
    ``~/.cache/uniap-lightning`` (an empty variable means the default, never the working directory)."""
    base = os.environ.get("UNIAP_CACHE_DIR", "").strip()
    return Path(base) if base else Path.home() / ".cache" / "uniap-lightning"


def _check_entry(path: Path, what: str) -> None:
    """Refuse an output name whose entry cannot be replaced by a rename without destroying something: a folder,
    a device, a FIFO or a socket. A missing name, a regular file and a link of either kind pass: the rename
    replaces the directory entry itself, so a symbolic link is replaced as a link (its target is never opened) and
    a hard link's other names keep their old content."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise UniAPError(f"{_named(what, path)} cannot be written: a folder above it is a file") from None
    except OSError as err:
        raise UniAPError(f"{_named(what, path)} cannot be checked ({err.strerror or err})") from err
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return
    if stat.S_ISDIR(mode):
        raise UniAPError(f"{_named(what, path)} is a folder; give a file name")
    raise UniAPError(f"{_named(what, path)} is not a regular file ({_kind(mode)}); give a file name")


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some file systems refuse ``fsync`` on a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, write: Any, *, what: str = "output file") -> Path:
    """``write(file)`` into a new temporary file in the same folder (created with ``O_CREAT | O_EXCL |
    O_NOFOLLOW``, a binary file object), flushed to disk, then renamed onto ``path``. Returns ``path``.

    The rename replaces the entry ``path`` itself: a symbolic link there is replaced as a link (never written
    through), a hard link leaves its other names untouched, and readers see the old file or the new one, never
    half of one. A folder, device, FIFO or socket under the name is refused with a :class:`UniAPError` and left
    untouched; a folder that cannot take the file (missing, read-only, full) is one :class:`UniAPError` line too.
    The new file gets the mode ``0666`` less the umask, like any file the user creates."""
    path = Path(path)
    _check_entry(path, what)
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as err:
        raise UniAPError(f"{_named(what, path)} cannot be written in the folder {str(folder)!r} "
                         f"({err.strerror or err})") from err
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, IsADirectoryError):  # a folder made under the name meanwhile
            raise UniAPError(f"{_named(what, path)} is a folder; give a file name") from err
        if isinstance(err, OSError):  # a full disk, a folder made read-only meanwhile
            raise UniAPError(f"{_named(what, path)} cannot be written ({err.strerror or err})") from err
        raise
    _fsync_folder(folder)
    return path


def write_text_atomic(path: str | Path, text: str, *, what: str = "output file") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes_atomic(path, lambda f: f.write(text.encode("utf-8")), what=what)


def write_json_atomic(path: str | Path, data: Any, *, what: str = "output file") -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n", what=what)


def check_output_file(path: str | Path, what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written: a folder, a device, a FIFO, a socket, or
    a file in a missing or read-only folder (a link under the name is fine: the write replaces the link)."""
    path = Path(path)
    _check_entry(path, what)
    parent = path.parent
    if not parent.is_dir():
        raise UniAPError(f"{_named(what, path)}: the folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UniAPError(f"{_named(what, path)}: the folder {str(parent)!r} is not writable")
    return path


def check_output_folder(path: str | Path, what: str) -> Path:
    """Refuse, before any work, an output folder that cannot be made: a name that exists and is not a folder
    (a file, a device, a FIFO), or one below a file."""
    path = Path(path)
    probe = path
    while True:
        try:
            mode = os.stat(probe).st_mode
        except (FileNotFoundError, NotADirectoryError):  # the latter: a file above it, found further up
            if probe.parent == probe:
                return path
            probe = probe.parent
            continue
        except OSError as err:
            raise UniAPError(f"{_named(what, path)} cannot be checked ({err.strerror or err})") from err
        if stat.S_ISDIR(mode):
            return path
        if probe == path:
            raise UniAPError(f"{_named(what, path)} exists and is not a folder ({_kind(mode)}); give a folder name")
        raise UniAPError(f"{_named(what, path)}: {str(probe)!r} is not a folder ({_kind(mode)})")


def is_plain_file(path: str | Path) -> bool:
    """Whether ``path`` is a regular file with one name: not a symbolic link, not a hard link to a file that has
    other names (a cache entry of ours never is either: anything else was put there by someone else)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def remove_if_not_regular(path: str | Path) -> bool:
    """Remove the cache entry ``path`` unless it is a folder or a plain file (:func:`is_plain_file`): a FIFO,
    socket or device node, a symbolic link of any kind, or a hard link is unlinked as a name (what it points at is
    never opened or changed), so the atomic write rebuilding the entry creates a file of its own. Returns whether
    it removed."""
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- reading
def read_bytes(path: str | Path, what: str, *, limit_bytes: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The bytes of a file given by the user or found in a cache. Opened without blocking and checked with
    ``fstat`` on the open descriptor (no race with a swap of the name): a FIFO, a device, a socket, a folder or a
    file over ``limit_bytes`` is refused at once instead of hanging or filling memory."""
    return _with_open(Path(path), what, lambda fd, p: _read_regular(fd, p, what, limit_bytes))


def check_regular_file(path: str | Path, what: str) -> Path:
    """Refuse, without blocking, a name that is not a regular file (for readers that open it themselves later, such
    as ``torch.load`` of a large checkpoint that should not be read into memory twice)."""

    def check(fd: int, p: Path) -> Path:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UniAPError(f"{_named(what, p)} is {_kind(mode)}, not a file")
        return p

    return _with_open(Path(path), what, check)


def _with_open(path: Path, what: str, use: Any) -> Any:
    """``use(fd, path)`` on a non-blocking read-only descriptor of ``path``, closed afterwards."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UniAPError(f"{_named(what, path)} does not exist") from None
    except IsADirectoryError:
        raise UniAPError(f"{_named(what, path)} is a folder, not a file") from None
    except OSError as err:
        raise UniAPError(f"{_named(what, path)} cannot be read ({err.strerror or err})") from err
    try:
        return use(fd, path)
    finally:
        os.close(fd)


def _read_regular(fd: int, path: Path, what: str, limit_bytes: int) -> bytes:
    mode, size = (st := os.fstat(fd)).st_mode, st.st_size
    if not stat.S_ISREG(mode):
        raise UniAPError(f"{_named(what, path)} is {_kind(mode)}, not a file")
    if size > limit_bytes:
        raise UniAPError(f"{_named(what, path)} is {size / 2**20:,.1f} MiB; files over "
                         f"{limit_bytes / 2**20:,.0f} MiB are not read")
    chunks, total = [], 0
    try:
        while total <= limit_bytes:  # st_size can lie (procfs says 0, a file may grow): read to the limit
            chunk = os.read(fd, min(1 << 20, limit_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as err:
        raise UniAPError(f"{_named(what, path)} cannot be read ({err.strerror or err})") from err
    if total > limit_bytes:
        raise UniAPError(f"{_named(what, path)} is over {limit_bytes / 2**20:,.0f} MiB; larger files are not read")
    return b"".join(chunks)


def read_text(path: str | Path, what: str, *, limit_bytes: int = MAX_DOCUMENT_BYTES) -> str:
    """The text of a file given by the user; a missing, unreadable, non-regular, oversized or binary file is a
    clear error."""
    path = Path(path)
    data = read_bytes(path, what, limit_bytes=limit_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UniAPError(f"{_named(what, path)} is not a text file (byte {err.start} is not UTF-8)") from err


def read_json(path: str | Path, what: str) -> Any:
    """The JSON document in a file given by the user; anything else is a clear error naming the file."""
    path = Path(path)
    return parse_json(read_text(path, what), _named(what, path))


# ---------------------------------------------------------------------------------------------- JSON
class _DocumentLimit(Exception):
    """A document over one of the limits above (raised inside the parser, turned into a UniAPError)."""


def _bounded_int(digits: str) -> int:
    """The parser's integers, refused past :data:`MAX_INTEGER_DIGITS` digits (no format needs more, and a
    5000-digit number would make ``int`` raise a ValueError of its own)."""
    count = len(digits.lstrip("-"))
    if count > MAX_INTEGER_DIGITS:
        raise _DocumentLimit(f"has an integer of {count} digits; at most {MAX_INTEGER_DIGITS} are read")
    return int(digits)


def parse_json(text: str, named: str) -> Any:
    """``json.loads`` with limits: nesting at most :data:`MAX_NESTING_DEPTH`, integers at most
    :data:`MAX_INTEGER_DIGITS` digits. ``named`` starts the error message (e.g. ``"plan file 'x.json'"``)."""
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except _DocumentLimit as err:
        raise UniAPError(f"{named} {err}") from None
    except RecursionError:
        raise UniAPError(f"{named} nests lists / objects deeper than {MAX_NESTING_DEPTH} levels") from None
    except json.JSONDecodeError as err:
        raise UniAPError(f"{named} is not valid JSON: {err}") from err
    except ValueError as err:  # a number the parser cannot convert
        raise UniAPError(f"{named} is not valid JSON: {err}") from err
    depth = nesting_depth(data)
    if depth > MAX_NESTING_DEPTH:
        raise UniAPError(f"{named} nests lists / objects {depth} levels deep; at most {MAX_NESTING_DEPTH} are read")
    return data


def nesting_depth(data: Any, *, stop_at: int = MAX_NESTING_DEPTH) -> int:
    """How deep ``data`` nests lists / dicts (a scalar: 0), counted without recursion; counting stops once past
    ``stop_at`` (the caller only needs to know it is too deep)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (list, dict)):
            continue
        deepest = max(deepest, depth)
        if depth > stop_at:
            return deepest
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


# ---------------------------------------------------------------------------------------------- cache entries
#: what reading a damaged entry may raise besides UniAPError (the readers turn most into UniAPError; an entry is
#: never worth a failed run, so anything a parser or validator can raise on bad data discards it)
CORRUPT_ENTRY_ERRORS = (UniAPError, OSError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                        OverflowError, RecursionError)


def foreign_entry(path: Path) -> str | None:
    """Why the cache entry at ``path`` is not ours to read (a symbolic link, a hard link, a FIFO, a device...),
    or ``None`` for a plain file. Such an entry is discarded as a name, never read or written through."""
    if is_plain_file(path) or os.path.isdir(path) and not os.path.islink(path):
        return None  # (a folder: refused later, with a message, when the entry is written)
    if os.path.islink(path):
        return "a symbolic link, not a file of ours"
    try:
        st = os.lstat(path)
    except OSError as err:
        return err.strerror or str(err)
    if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
        return "a hard link to a file with other names, not a file of ours"
    return "not a regular file"


def why(err: BaseException) -> str:
    """The first line of an error, for a one-line warning."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


# ---------------------------------------------------------------------------------------------- YAML
def check_yaml_limits(text: str, named: str) -> None:
    """Refuse a YAML document that would take unbounded time or memory to load, before a loader sees it: nesting
    over :data:`MAX_NESTING_DEPTH`, more than :data:`MAX_YAML_NODES` nodes once aliases are expanded (aliases make
    a 1 kB "billion laughs" document expand to 1e9 nodes), a self-referencing alias, or ``${...}`` interpolations
    that resolve to more than :data:`MAX_YAML_INTERPOLATED_CHARS` characters. Syntax errors are left to the
    loader (its messages give the line)."""
    yaml_limits.check(text, named)
