"""Files the package writes for other processes to read (tactic caches, GPU profiles)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json_atomic(path: str | os.PathLike, doc, prefix: str = ".stof-") -> Path:
    """Write ``doc`` as JSON to ``path`` through a temporary file in the same directory, fsynced and renamed over
    it, so a reader sees the old file or the new one, never a part."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".json", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p
