"""What status says about a built context: its size and the device it lives on."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from dask.sizeof import sizeof


def size_of(value: Any) -> int:
    """Bytes a built context holds: its ``nbytes`` if it says, else Dask's estimate."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return int(sizeof(value))


def describe_device(value: Any) -> str | None:
    """Where a context lives, for status: ``cpu (8 threads, <CPU model>)`` or the GPU."""
    device = getattr(value, "device", None)
    if device is None:
        return None
    text = str(device)
    torch = sys.modules.get("torch")  # only if the loader imported it: never import it here
    if text.startswith("cuda") and torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(text))
        return f"{text} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    if text == "cpu":
        threads = torch.get_num_threads() if torch is not None else os.cpu_count()
        return f"cpu ({threads} thread{'' if threads == 1 else 's'}, {cpu_model()})"
    return text


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
