"""The NVIDIA GPUs of this host, read without torch: what the driver lists and what
``CUDA_VISIBLE_DEVICES`` lets a process see.

Cheap enough for the client process (no CUDA initialisation, no ``import torch``), so that
:func:`dask_pcm.local_cluster` can start one worker per GPU and a worker whose torch cannot
use a GPU that is plainly there can say so.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

VISIBLE = "CUDA_VISIBLE_DEVICES"
_PROC = Path("/proc/driver/nvidia")


@functools.cache
def installed_gpus(proc: Path = _PROC) -> int:
    """NVIDIA GPUs the driver lists on this host (0 without a driver); asked once per
    process (a load per task at levels partial and agnostic asks again)."""
    gpus = proc / "gpus"
    try:
        listed = len([p for p in gpus.iterdir() if p.is_dir()])
    except OSError:
        listed = 0
    if listed or not shutil.which("nvidia-smi"):
        return listed
    # No procfs entries (a container without them): ask the driver's tool.
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def visible_gpus(environ: dict[str, str] | None = None, proc: Path = _PROC) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``CUDA_VISIBLE_DEVICES`` when set (``""`` or ``-1``: none), else ``0 .. n-1`` for the
    GPUs the driver lists.

    Example
    -------
    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
    ['2', '3']
    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": ""})
    []
    """
    env = os.environ if environ is None else environ
    listed = env.get(VISIBLE)
    if listed is not None:
        entries = [e.strip() for e in listed.split(",") if e.strip()]
        # CUDA stops at the first invalid entry; -1 is the usual way to hide every GPU.
        out = []
        for entry in entries:
            if entry.startswith("-"):
                break
            out.append(entry)
        return out
    return [str(i) for i in range(installed_gpus(proc))]


def driver_version(proc: Path = _PROC) -> str | None:
    """The NVIDIA kernel driver's version (``"550.54.15"``), or ``None`` without one."""
    try:
        text = (proc / "version").read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None
