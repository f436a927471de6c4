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


def slow_loader(location: object, seconds: float = 3.0) -> dict[str, object]:
    """A context loader that takes ``seconds`` (a model loading), for tests that do
    something to a worker while it loads; ``functools.partial`` sets the time."""
    time.sleep(seconds)
    return {"location": location}
