"""The host machine's resources, for checks made before large allocations."""

from __future__ import annotations

import os

__all__ = ["available_memory"]


def available_memory() -> int | None:
    """Bytes this process can still allocate without swapping (Linux's MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
