"""Small task functions for tests, importable by worker processes and batch jobs (which
cannot import a test module)."""

from __future__ import annotations

import time


def noted_square(path: str, x: int, seconds: float = 0.5) -> int:
    """Append ``x`` to the file ``path`` (so a test sees which tasks started), take
    ``seconds``, return ``x * x``."""
    with open(path, "a") as f:
        f.write(f"{x}\n")
    time.sleep(seconds)
    return x * x
