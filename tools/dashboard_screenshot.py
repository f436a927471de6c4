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

With ``--fever`` it pictures a real FEVER run instead of the stand-ins: it starts
``dask_pcm.local_cluster(n_workers=2)`` (worker processes), runs ``dask_pcm.run_fever`` on the
embedded SmolLM2-135M model in a background thread (four claims per task), waits until at
least eight units have finished and at least sixteen are still waiting or running, and then
saves two screenshots in ``--output-dir`` (default ``docs/images/``):

- ``fever-dask-status.png``: Dask's own ``/status`` page (task stream, progress, memory).
- ``fever-pcm-status.png``: dask_pcm's ``/pcm/status`` page.

The claims come from ``--data``, by default ``../shared/data/fever/paper_dev.jsonl`` beside
the repository when it exists, else the package's demo set of 30 claims. ``--limit`` (default
200) and ``--num-templates`` (default 3; every built-in template on the demo set) set the size
of the run: on two CPU cores the default is 150 units and takes about a minute and a half, so
the screenshots are taken while most units are still queued. The run is left to finish before
the cluster closes.

Dask's dashboard needs Bokeh. Its ``/status`` page draws its plots from a websocket after it
has loaded, so Chromium's ``--screenshot`` would catch it empty; that page is taken over
Chromium's DevTools protocol (``--remote-debugging-pipe``) a few seconds after its Bokeh
document has arrived. From the repository root::

    python tools/dashboard_screenshot.py --fever               # -> docs/images/fever-*.png
    python tools/dashboard_screenshot.py --fever --limit 400 --output-dir /tmp/shots

It prints both pages' URLs and output paths, and exits non-zero when Chromium is missing,
the run ended or failed before the screenshots, or a screenshot is missing or of one colour.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import json
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import dask
from distributed import Client, LocalCluster

import dask_pcm

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "docs" / "images" / "pcm-status.png"
DEFAULT_OUTPUT_DIR = REPO / "docs" / "images"
FEVER_DATA = REPO.parent / "shared" / "data" / "fever" / "paper_dev.jsonl"
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


def _chromium_base(
    chromium: str, profile: str, window_size: str, virtual_time: bool = True
) -> list[str]:
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",  # needed when running as root, e.g. in a container
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        f"--window-size={window_size}",
    ]
    if virtual_time:
        # Let the page's script fetch /pcm/status.json and fill its tables first.
        cmd.append("--virtual-time-budget=5000")
    return cmd


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


class DevTools:
    """A headless Chromium driven over its DevTools protocol on a pipe.

    The browser reads commands, JSON objects each ended by a NUL byte, on its file descriptor
    3 and writes the replies and events on 4 (``--remote-debugging-pipe``).
    """

    def __init__(self, command: list[str], log: IO[bytes]) -> None:
        commands, self._commands = os.pipe()
        self._replies, replies = os.pipe()
        # The pipes come in as stdin and stdout, and a shell moves them to 3 and 4: a
        # preexec_fn would be unsafe while the Client's threads run, and the pipes' own
        # numbers may have two digits, which dash cannot redirect.
        shell = 'exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>&2'
        try:
            self.process = subprocess.Popen(
                ["/bin/sh", "-c", shell, *command, "--remote-debugging-pipe"],
                stdin=commands,
                stdout=replies,
                stderr=log,
            )
        finally:
            os.close(commands)
            os.close(replies)
        self._buffer = b""
        self._last_id = 0

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float = 30,
    ) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are dropped."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._commands, data) :]
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._last_id:
                    if "error" in reply:
                        raise RuntimeError(f"Chromium: {method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Chromium did not answer {method} in {timeout} s")
            if select.select([self._replies], [], [], left)[0]:
                chunk = os.read(self._replies, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (code {self.process.poll()})")
                self._buffer += chunk

    def close(self) -> None:
        # It may have exited already; if it does not now, it is killed below.
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.call("Browser.close", timeout=10)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)


# True once the page's Bokeh document has come over the websocket with its plots.
BOKEH_READY = "Boolean(window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].roots().length)"


def screenshot_bokeh(
    chromium: str, url: str, output: Path, window_size: str, settle: float = 4
) -> None:
    """Render the Bokeh page at ``url`` and write ``output``, ``settle`` seconds after the
    document arrived (Dask's plots update once a second or so)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.exists():
        output.unlink()
    width, height = (int(n) for n in window_size.split(","))
    with (
        tempfile.TemporaryDirectory(prefix="pcm-chromium-") as profile,
        tempfile.TemporaryFile() as log,
    ):
        browser = DevTools(_chromium_base(chromium, profile, window_size, False), log)
        try:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            attached = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})
            session = attached["sessionId"]
            viewport = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
            browser.call("Emulation.setDeviceMetricsOverride", viewport, session)
            browser.call("Page.navigate", {"url": url}, session)
            deadline = time.monotonic() + 60
            while True:
                ready = browser.call(
                    "Runtime.evaluate", {"expression": BOKEH_READY, "returnByValue": True}, session
                )
                if ready.get("result", {}).get("value") is True:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: the Bokeh page at {url} drew nothing in 60 s")
                time.sleep(0.5)
            time.sleep(settle)
            shot = browser.call("Page.captureScreenshot", {"format": "png"}, session, timeout=60)
            output.write_bytes(base64.b64decode(shot["data"]))
        except (OSError, RuntimeError, TimeoutError) as error:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise SystemExit(f"error: no screenshot of {url}: {error}") from None
        finally:
            browser.close()


def _check_picture(path: Path, top: int = 0) -> None:
    """Exit unless ``path`` is a PNG with more than one colour below its first ``top`` rows."""
    if not path.exists() or path.stat().st_size == 0:
        raise SystemExit(f"error: no screenshot at {path}")
    try:
        from PIL import Image
    except ImportError:
        return  # without Pillow the size is all there is to check
    with Image.open(path) as image:
        body = image.convert("RGB").crop((0, top, image.width, image.height))
        if all(low == high for low, high in body.getextrema()):
            raise SystemExit(f"error: the screenshot {path} is blank (one colour)")


PENDING = ("released", "waiting", "no-worker", "queued", "processing")


def _pending_tasks(dask_scheduler: Any) -> int:
    """Runs on the scheduler: the tasks not finished yet (the run's units are all there is)."""
    return sum(ts.state in PENDING for ts in dask_scheduler.tasks.values())


def _wait_mid_run(client: Client, run: threading.Thread, some: int = 8) -> tuple[int, int] | None:
    """Wait until ``some`` units have finished and twice as many are still to do; return
    (finished, to do), or None if the run ended first."""
    deadline = time.monotonic() + 900  # the model's first load included
    while True:
        if not run.is_alive():
            return None
        table = dask_pcm.status(client)
        done = int(table["tasks"].sum()) if len(table) else 0
        if done >= some:
            todo = client.run_on_scheduler(_pending_tasks)
            if todo < 2 * some:
                raise SystemExit(
                    f"error: only {todo} units left after {done}: too short a run to picture "
                    "mid-way; raise --limit or --num-templates"
                )
            return done, todo
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {done} units finished in 15 minutes")
        time.sleep(0.5)


def fever_main(args: argparse.Namespace, chromium: str) -> int:
    """The ``--fever`` mode: screenshots of Dask's /status and of /pcm/status mid-run."""
    if importlib.util.find_spec("bokeh") is None:
        print("error: Dask's dashboard needs Bokeh: pip install bokeh", file=sys.stderr)
        return 2
    data: Path | None = args.data
    if data is None and FEVER_DATA.exists():
        data = FEVER_DATA
    num_templates = args.num_templates
    if num_templates is None:
        # 30 demo claims make 8 units per template: take them all for a run long enough.
        num_templates = 3 if data is not None else None
    output_dir: Path = args.output_dir.resolve()
    outputs = output_dir / "fever-dask-status.png", output_dir / "fever-pcm-status.png"
    print(
        f"data:   {data or 'the demo set'} (limit {args.limit}, templates {num_templates or 'all'})"
    )

    logging.getLogger("distributed").setLevel(logging.ERROR)
    start = time.perf_counter()
    outcome: dict[str, Any] = {}

    def run(client: Client) -> None:
        try:
            outcome["result"] = dask_pcm.run_fever(
                data=data,
                limit=args.limit,
                num_templates=num_templates,
                cluster=client,
                claims_per_task=4,
                progress=False,
            )
        except BaseException as error:  # reported by the main thread
            outcome["error"] = error

    with (
        dask_pcm.local_cluster(n_workers=2, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        base = client.dashboard_link.rsplit("/", 1)[0]
        urls = f"{base}/status", f"{base}/pcm/status"
        print(f"pages:  {urls[0]}\n        {urls[1]}")
        rows = 0
        runner = threading.Thread(target=run, args=(client,), name="run_fever")
        runner.start()
        try:
            mid_run = _wait_mid_run(client, runner)
            if mid_run is not None:
                done, todo = mid_run
                elapsed = time.perf_counter() - start
                print(f"shots:  after {done} units, {todo} to do ({elapsed:.0f} s)")
                screenshot_bokeh(chromium, urls[0], outputs[0], args.dask_window_size)
                rows = screenshot(chromium, urls[1], outputs[1], args.window_size)
        finally:
            # Cancelling would leave run_fever to fail on its cancelled futures; the rest of
            # a default run takes about a minute.
            runner.join()
            dask_pcm.unregister(client, *dask_pcm.registered_contexts(client))
    if "error" in outcome:
        raise outcome["error"]
    if mid_run is None:
        raise SystemExit("error: the FEVER run ended before the screenshots")
    result = outcome["result"]
    _check_picture(outputs[0], top=60)  # below the dashboard's menu bar
    _check_picture(outputs[1])
    for output in outputs:
        print(f"output: {output} ({output.stat().st_size // 1024} KiB)")
    best = result.summary.iloc[0]
    print(
        f"run:    {result.report['units']['total']} units in {result.report['wall_seconds']:.0f} s; "
        f"best template {best['template']} (accuracy {best['accuracy']:.3f}); "
        f"{rows} worker rows on the contexts page; {time.perf_counter() - start:.0f} s in all"
    )
    return 0


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
        default="2200,760",
        help="browser viewport WIDTH,HEIGHT in pixels (default: 2200,760)",
    )
    fever = parser.add_argument_group("--fever: Dask's and dask_pcm's pages during a FEVER run")
    fever.add_argument("--fever", action="store_true", help="picture a real FEVER run instead")
    fever.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        help="folder of fever-dask-status.png and fever-pcm-status.png (default: docs/images)",
    )
    fever.add_argument(
        "--data",
        type=Path,
        default=None,
        help="FEVER JSON lines (default: ../shared/data/fever/paper_dev.jsonl beside the "
        "repository if it exists, else the demo set)",
    )
    fever.add_argument("--limit", type=int, default=200, help="claims to score (default: 200)")
    fever.add_argument(
        "--num-templates",
        type=int,
        default=None,
        help="templates to score them with (default: 3; all on the demo set)",
    )
    fever.add_argument(
        "--dask-window-size",
        default="1800,1000",
        help="viewport WIDTH,HEIGHT for Dask's /status page (default: 1800,1000)",
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
    if args.fever:
        return fever_main(args, chromium)
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
