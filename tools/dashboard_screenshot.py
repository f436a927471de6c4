"""Screenshot of dask_pcm's status page (``/pcm/status`` on the Dask dashboard's port).

Starts an in-process ``LocalCluster`` (three workers, one thread each), registers four small
demo contexts and drives them into the states the page shows, then opens the page in headless
Chromium and saves a PNG of it:

- ``index`` and ``embedder`` (1 MiB each): registering ``embedder`` under a
  ``pcm.worker.context-memory-limit`` of 1.5 MiB evicts ``index``, the least recently used
  context, on every worker; one task then rebuilds ``index`` on the first worker.
- ``smollm2``: ready on the three workers, ``failed`` (with its loader's message) on a fourth
  worker added afterwards.
- ``reranker``: ready on the three workers, still ``loading`` on the fourth.

Some no-op tasks run against each context first, so the page has tasks served. The loaders
are stand-ins that build small objects at once: nothing here loads a model or needs a GPU.

Chromium must be installed; on Debian or Ubuntu::

    apt-get install -y --no-install-recommends chromium

Run it from the repository root::

    python tools/dashboard_screenshot.py                      # -> docs/images/pcm-status.png
    python tools/dashboard_screenshot.py --output /tmp/pcm.png --chromium /usr/bin/chromium

It prints the page's URL and the output path, and exits non-zero when Chromium is missing,
the page did not fill its tables, or no screenshot was written.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import dask
from distributed import Client, LocalCluster

import dask_pcm

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "docs" / "images" / "pcm-status.png"
INSTALL_HINT = "apt-get install -y --no-install-recommends chromium"
MIB = 2**20

# The loaders run in worker threads of this process. Classes defined in ``__main__`` are
# pickled by value when registered, so they would not see a module-level flag set later;
# the environment of the process is shared by every thread, so they read these instead.
FAIL_VAR = "DASK_PCM_SCREENSHOT_FAIL"  # set: SmolLM2Loader raises
HOLD_VAR = "DASK_PCM_SCREENSHOT_HOLD"  # set: RerankerLoader waits until it is unset


class Model:
    """A stand-in for a model: the size, device and batch size that status rows report."""

    def __init__(self, nbytes: int, device: str | None = None, batch_size: int | None = None):
        self.nbytes = nbytes
        self.device = device
        self.batch_size = batch_size


class BlobLoader:
    """Builds a :class:`Model` of ``nbytes`` bytes at once."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, location: str) -> Model:
        time.sleep(0.1)
        return Model(self.nbytes)


class SmolLM2Loader:
    """A small "model" on the CPU; fails like an out-of-memory load while FAIL_VAR is set."""

    def __call__(self, location: str) -> Model:
        if os.environ.get(FAIL_VAR):
            raise RuntimeError("CUDA out of memory. Tried to allocate 270.00 MiB (simulated)")
        time.sleep(0.4)
        return Model(64 * 1024, device="cpu", batch_size=8)


class RerankerLoader:
    """A small "model" that keeps loading while HOLD_VAR is set."""

    def __call__(self, location: str) -> Model:
        deadline = time.monotonic() + 600
        while os.environ.get(HOLD_VAR) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        return Model(32 * 1024, device="cpu", batch_size=32)


def noop(i: int, delay: float = 0.02) -> int:
    """A context task that does nothing but wait a little (spreads tasks over workers)."""
    time.sleep(delay)
    return i


def _workers(client: Client) -> list[str]:
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


def _add_worker(cluster: LocalCluster, client: Client) -> str:
    before = set(_workers(client))
    cluster.scale(len(before) + 1)
    client.wait_for_workers(len(before) + 1, timeout=60)
    (added,) = set(_workers(client)) - before
    return added


def _wait_for(
    client: Client, what: str, done: Callable[[dict[tuple[str, str], str]], bool]
) -> None:
    """Poll ``dask_pcm.status`` until ``done({(context, worker): state})`` holds."""
    deadline = time.monotonic() + 60
    while True:
        table = dask_pcm.status(client)
        states = {(r.context, r.worker): r.state for r in table.itertuples()}
        if done(states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}; states: {states}")
        time.sleep(0.05)


def build_scene(cluster: LocalCluster, client: Client) -> None:
    """Register the demo contexts and drive them into ready, evicted, failed and loading."""
    first = _workers(client)[0]
    dask_pcm.register(client, dask_pcm.Context("index", BlobLoader(MIB), template="index.faiss"))
    dask_pcm.register(
        client, dask_pcm.Context("smollm2", SmolLM2Loader(), template="SmolLM2-135M-Instruct")
    )
    dask_pcm.register(
        client, dask_pcm.Context("reranker", RerankerLoader(), template="ms-marco-MiniLM")
    )
    # Room for one 1 MiB context per worker: loading "embedder" evicts "index", the least
    # recently used. The limit is read at load time, so later loads are not limited.
    with dask.config.set({"pcm.worker.context-memory-limit": "1.5 MiB"}):
        dask_pcm.register(
            client, dask_pcm.Context("embedder", BlobLoader(MIB), template="bge-small-en")
        )
        _wait_for(
            client,
            "index evicted on every worker",
            lambda s: all(v == "evicted" for (c, _), v in s.items() if c == "index"),
        )

    for name, n in (("smollm2", 48), ("embedder", 30), ("reranker", 18)):
        client.gather(dask_pcm.map(client, noop, range(n), context=name, pure=False))
    # Rebuilt on demand on the first worker only (loads 2, evictions 1, ready again).
    client.gather(dask_pcm.map(client, noop, range(3), context="index", workers=[first]))

    # A fourth worker: smollm2's loader fails there, reranker's keeps loading.
    os.environ[FAIL_VAR] = "1"
    os.environ[HOLD_VAR] = "1"
    try:
        fourth = _add_worker(cluster, client)
        _wait_for(
            client,
            "smollm2 failed and reranker loading on the added worker",
            lambda s: (
                s.get(("smollm2", fourth)) == "failed"
                and s.get(("reranker", fourth)) == "loading"
                and s.get(("index", fourth)) == "ready"
                and s.get(("embedder", fourth)) == "ready"
            ),
        )
    finally:
        os.environ.pop(FAIL_VAR, None)


def _chromium_base(chromium: str, profile: str, window_size: str) -> list[str]:
    return [
        chromium,
        "--headless",
        "--no-sandbox",  # needed when running as root, e.g. in a container
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        f"--window-size={window_size}",
        # Let the page's script fetch /pcm/status.json and fill its tables first.
        "--virtual-time-budget=5000",
    ]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def screenshot(chromium: str, url: str, output: Path, window_size: str) -> int:
    """Render ``url`` and write ``output``; return the number of worker rows on the page."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pcm-chromium-") as profile:
        base = _chromium_base(chromium, profile, window_size)
        dom = _run([*base, "--dump-dom", url], timeout=120)
        table = re.search(r'<table id="rows">.*?</table>', dom.stdout, re.DOTALL)
        rows = table.group(0).count("<tr><td>") if table else 0
        if dom.returncode != 0 or rows == 0:
            sys.stderr.write(dom.stderr[-4000:])
            raise SystemExit(f"error: the page at {url} showed no worker rows in Chromium")
        if output.exists():
            output.unlink()
        shot = _run([*base, f"--screenshot={output}", url], timeout=120)
        if shot.returncode != 0 or not output.exists() or output.stat().st_size == 0:
            sys.stderr.write(shot.stderr[-4000:])
            raise SystemExit(f"error: Chromium wrote no screenshot to {output}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"PNG to write (default: {DEFAULT_OUTPUT.relative_to(REPO)} in the repository)",
    )
    parser.add_argument(
        "--chromium",
        default=None,
        help="Chromium executable (default: chromium, chromium-browser or google-chrome on PATH)",
    )
    parser.add_argument(
        "--window-size",
        default="1800,720",
        help="browser viewport WIDTH,HEIGHT in pixels (default: 1800,720)",
    )
    args = parser.parse_args(argv)

    chromium = args.chromium or next(
        (
            found
            for name in ("chromium", "chromium-browser", "google-chrome")
            if (found := shutil.which(name))
        ),
        None,
    )
    if chromium is None or shutil.which(chromium) is None:
        print(
            f"error: Chromium not found ({args.chromium or 'chromium'}); install it with\n"
            f"    {INSTALL_HINT}\n"
            "or pass its path with --chromium",
            file=sys.stderr,
        )
        return 2
    output: Path = args.output.resolve()

    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("dask_pcm").setLevel(logging.CRITICAL)  # the failure is on purpose
    start = time.perf_counter()
    with (
        dask.config.set({"pcm.worker.load-concurrency": 4}),  # a held load blocks no other
        LocalCluster(
            n_workers=3,
            threads_per_worker=1,
            processes=False,
            protocol="tcp://",  # worker addresses as in a real deployment, not inproc://
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        try:
            build_scene(cluster, client)
            url = client.dashboard_link.rsplit("/", 1)[0] + "/pcm/status"
            print(f"page:   {url}")
            rows = screenshot(chromium, url, output, args.window_size)
        finally:
            os.environ.pop(HOLD_VAR, None)  # let the held load finish
            # Free the contexts while the scheduler is up: left to the cluster's close, the
            # workers' teardowns race its shutdown and their heartbeats log errors.
            dask_pcm.unregister(client, *dask_pcm.registered_contexts(client))
    print(f"output: {output} ({rows} worker rows, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
