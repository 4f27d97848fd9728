"""Files the package writes for other processes to read (tactic caches, GPU profiles)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path

from .errors import StofError


def output_target(path: str | os.PathLike) -> Path:
    """The file a write to ``path`` replaces: a symlink's target (the link is written through, not replaced); a
    StofError when that exists and is not a regular file (a directory, device or pipe, which a rename over it
    would destroy).  A path the file system cannot look up (a name too long) is returned for the write to report."""
    p = Path(path)
    try:
        if p.is_symlink():
            p = Path(os.path.realpath(p))
        mode = p.stat().st_mode
    except FileNotFoundError:
        return p
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ENOTDIR):
            return p
        raise StofError(f"cannot check the output path {path} ({e.strerror or type(e).__name__})") from None
    if stat.S_ISDIR(mode):
        raise StofError(f"output path {path} is a directory: give a file name")
    if not stat.S_ISREG(mode):
        raise StofError(f"output path {path} exists and is not a regular file (a device or pipe): give a file name")
    return p


def file_mode() -> int:
    """The mode a new file gets under the process's umask (mkstemp creates 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def terminate_unwinds():
    """While a file is written: a SIGTERM raises SystemExit, so the writer's cleanup removes its temporary file
    (the default action would leave it).  One-shot (a second SIGTERM kills), main thread only, and only where
    SIGTERM has its default action."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def unwind(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_file_atomic(path: str | os.PathLike, write, suffix: str = "", prefix: str = ".stof-",
                      mode: int | None = None) -> Path:
    """``write(tmp)`` into a temporary file beside ``path`` (a symlink's target), renamed over it: a failed write
    (a full disk, an unwritable directory) leaves no part behind and raises a one-line StofError.  ``suffix``: the
    temporary file's, for writers that go by the name (np.save adds .npy, savefig picks the format); ``mode``: the
    file's (default: the umask's)."""
    p = output_target(path)
    with terminate_unwinds():
        try:
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=p.parent)
            os.close(fd)
        except OSError as e:
            raise StofError(f"cannot write to {p.parent} ({e.strerror or type(e).__name__})") from None
        try:
            write(tmp)
            os.chmod(tmp, file_mode() if mode is None else mode)
            os.replace(tmp, p)
        except OSError as e:
            raise StofError(f"cannot write {path} ({e.strerror or type(e).__name__})") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return p


def is_version(v, want: int) -> bool:
    """A file's "version" field is ``want`` (an int: JSON's true == 1 is not a version)."""
    return type(v) is int and v == want


def read_json_doc(p: Path, what: str):
    """The JSON document in file ``p``, or a one-line StofError naming it as ``what``."""
    try:
        return json.loads(p.read_text())
    except OSError as e:
        raise StofError(f"{what} {p} cannot be read ({e.strerror or type(e).__name__})") from None
    except (ValueError, RecursionError) as e:  # (RecursionError: nesting deeper than the parser's stack)
        raise StofError(f"{what} {p} is not JSON ({str(e)[:120] or type(e).__name__})") from None


def write_json_atomic(path: str | os.PathLike, doc, prefix: str = ".stof-") -> Path:
    """Write ``doc`` as JSON to ``path`` (a symlink's target) through a temporary file in the same directory,
    fsynced and renamed over it, so a reader sees the old file or the new one, never a part; readable by other
    processes (0644: tactic caches and profiles are shared)."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    return write_file_atomic(path, write, suffix=".json", prefix=prefix, mode=0o644)
