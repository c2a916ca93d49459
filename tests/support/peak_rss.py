"""The RSS figures of the memory tests' child processes (Linux ``/proc/self``): run as
scripts, ``restore_rss.py`` and ``download_rss.py`` import this from their own directory."""

from __future__ import annotations


def status_mib(field: str) -> float:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Peak RSS from now on (Linux: writing 5 to clear_refs resets VmHWM to VmRSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
