"""The CPU's feature flags as Linux reports them, for tests of which native paths a CPU runs."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    """The first processor's ``flags`` in /proc/cpuinfo (empty where there is none)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()
