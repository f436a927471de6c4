"""Preemption (the paper's RQ3 at this machine's scale): inferences done in a fixed window
while a worker is killed every T seconds, at context levels full and partial.

For each level, a fresh ``dask_pcm.local_cluster`` (2 workers x 1 thread by default, worker
processes under a nanny) gets a continuous stream of FEVER scoring tasks (8 claims per task,
one forward pass of the embedded SmolLM2-135M-Instruct each) for a window of ``--window``
seconds (120; ``--quick`` 20). Every ``--period`` seconds (20; ``--quick`` 7) one worker
process is killed with SIGKILL, the workers taking turns, as a batch system or a cloud
provider would preempt it. Its nanny starts a fresh process, which joins with nothing: it
copies the model's template again (peer to peer, from the surviving worker), and then at level
``full`` loads the model once and keeps it, while at level ``partial`` every task it runs
builds the model from that worker-local copy. The task that was running on the killed worker
is run again elsewhere (``distributed.scheduler.allowed-failures`` is raised so that a task
killed repeatedly is not declared lost).

Measured, per level, within the window only:

- ``tasks``, ``claims``: tasks whose results reached the client before the window closed, and
  the claims they scored; ``claims/s`` is claims / window. Tasks still queued or running at
  the close are cancelled and not counted, nor is the work the killed workers lost.
- ``preemptions``: workers killed in the window (one at every multiple of the period).
- ``errors``: tasks that ended in an error (they should be none); listed if any.
- ``loads``, ``load_s``: model builds in the window and the seconds they took, summed over
  every worker process that ran, from ``dask_pcm.status`` (read just before each kill, since
  a killed worker's row leaves the table, and at the close).
- for each preemption, printed below its level: seconds from the kill until the replacement
  process had its context ready (at ``partial``: its template copied; read once a second) and
  until it delivered its first result.

The ratio printed last is claims(full) / claims(partial): how much more inference the resident
context delivers under the same preemptions.

What is outside the window: cluster start-up, a first model load in each of the first two
workers before ``register`` (then released; it imports torch, transformers and their lazily
imported model code, about 3 s here, as in ``levels.py``), and ``register`` itself. What is
inside: everything a preemption costs, including the restarted process's start, its imports
(those land in its first load at ``full`` and in its first task at ``partial``) and its
template copy. Every task's predictions must be the same at both levels; the run stops
otherwise.

Honesty note: the template is copied between two processes of one host and read from a warm
page cache, so a rebuild at ``partial`` is cheaper than from a shared filesystem, and the
restarted worker's start-up competes for the same two cores as the surviving worker. The
machine is shared with other work: compare the two rows of one run, not digits across runs.

Examples::

    python benchmarks/preemption.py --quick
    python benchmarks/preemption.py --json /tmp/preemption.json
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import _harness as h
import dask
from distributed import Client, Future

import dask_pcm

LEVELS = ("full", "partial")
FINISHED = ("finished", "error")
COLUMNS = [
    ("level", "level", ""),
    ("preemptions", "preemptions", "d"),
    ("tasks_done", "tasks", "d"),
    ("claims_done", "claims", "d"),
    ("claims_per_s", "claims/s", ".2f"),
    ("errors", "errors", "d"),
    ("loads", "loads", "d"),
    ("load_seconds", "load_s", ".2f"),
]


def _identity(dask_worker=None) -> tuple[str, int]:
    return str(dask_worker.name), os.getpid()


class _Watch:
    """What happened to every worker process, read from ``dask_pcm.status`` now and then.

    A killed worker's row leaves the status table and its replacement comes back under a new
    address, so the last row seen for every address is kept: its name, model builds and load
    seconds, and when (seconds into the window) it was first seen and its context first ready.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.name: dict[str, str] = {}
        self.loads: dict[str, tuple[int, float]] = {}
        self.seen: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.read(0.0)
        self.base = self.totals()

    def read(self, t: float) -> None:
        table = dask_pcm.status(self.client, [h.CONTEXT])
        if not set(table["worker"]) <= self.name.keys():
            workers = self.client.scheduler_info()["workers"]
            self.name.update({a: str(w["name"]) for a, w in workers.items()})
        for row in table.itertuples():
            self.loads[row.worker] = (int(row.loads), float(row.load_seconds))
            self.seen.setdefault(row.worker, t)
            if row.state == "ready":
                self.ready.setdefault(row.worker, t)

    def totals(self) -> tuple[int, float]:
        return (
            sum(n for n, _ in self.loads.values()),
            sum(s for _, s in self.loads.values()),
        )

    def since_start(self) -> tuple[int, float]:
        loads, seconds = self.totals()
        return loads - self.base[0], seconds - self.base[1]

    def replacement(self, kill: dict) -> str | None:
        """The address of the process that replaced the one ``kill`` killed, if it joined."""
        later = [
            (t, a)
            for a, t in self.seen.items()
            if self.name.get(a) == kill["worker"] and t > kill["t"]
        ]
        return min(later)[1] if later else None


def preempt(client: Client, victim: str) -> dict | None:
    """SIGKILL the process of worker ``victim`` (another one if it is not connected)."""
    alive = dict(client.run(_identity, on_error="ignore").values())
    if not alive:
        return None
    name = victim if victim in alive else sorted(alive)[0]
    os.kill(alive[name], signal.SIGKILL)
    return {"worker": name, "pid": alive[name]}


def run_level(
    level: str, model: str, work: list[list[str]], workers: int, window: float, period: float
) -> dict:
    """Stream ``work`` (cycled) at ``level`` for ``window`` s, killing a worker every ``period``."""
    depth = 3 * workers  # one running and at least two waiting per worker
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 1000}),
        h.warm_cluster(model, workers) as client,
    ):
        names = sorted(name for name, _ in client.run(_identity).values())
        dask_pcm.register(
            client, dask_pcm.causal_lm(model, name=h.CONTEXT, device="cpu"), level=level
        )
        watch = _Watch(client)
        pending: dict[Future, int] = {}
        predictions: dict[int, list[int]] = {}
        done_at: list[tuple[float, str | None]] = []  # (seconds into the window, worker)
        errors: list[str] = []
        kills: list[dict] = []
        submitted = tasks = claims = 0
        start = time.perf_counter()
        deadline = start + window
        next_kill = start + period
        next_read = start + 1.0
        while True:
            for future in [f for f in pending if f.status in FINISHED]:
                t = time.perf_counter() - start
                i = pending.pop(future)
                if future.status == "error":
                    errors.append(repr(future.exception()))
                    continue
                where = client.who_has([future]).get(future.key) or [None]
                predictions[i] = future.result()
                done_at.append((round(t, 2), where[0]))
                tasks += 1
                claims += len(work[i])
            now = time.perf_counter()
            if now >= deadline:
                break
            if now >= next_read or now >= next_kill:
                watch.read(now - start)  # just before a kill too: the victim's row goes
                next_read = now + 1.0
            if now >= next_kill:
                kill = preempt(client, names[len(kills) % len(names)])
                if kill is not None:
                    kills.append({"t": round(time.perf_counter() - start, 2), **kill})
                next_kill += period
            while len(pending) < depth:
                i = submitted % len(work)
                submitted += 1
                future = dask_pcm.submit(
                    client, h.score_batch, work[i], context=h.CONTEXT, pure=False
                )
                pending[future] = i
            time.sleep(0.05)
        client.cancel(list(pending))
        watch.read(window)
    n_loads, load_seconds = watch.since_start()
    for kill in kills:
        # How long the preemption kept that worker out: until its replacement's context was
        # ready (at partial: its template copied) and until it delivered its first result.
        new = watch.replacement(kill)
        first = min((t for t, w in done_at if w is not None and w == new), default=None)
        kill["ready_after_s"] = (
            round(watch.ready[new] - kill["t"], 2) if new in watch.ready else None
        )
        kill["result_after_s"] = round(first - kill["t"], 2) if first is not None else None
    return {
        "level": level,
        "window_s": window,
        "period_s": period,
        "preemptions": len(kills),
        "tasks_done": tasks,
        "claims_done": claims,
        "claims_per_s": claims / window,
        "errors": len(errors),
        "error_messages": errors[:5],
        "loads": n_loads,
        "load_seconds": load_seconds,
        "tasks_submitted": submitted,
        "kills": kills,
        "done_at": [t for t, _ in done_at],
        "load_average": os.getloadavg()[0],
        "predictions": predictions,
    }


def _seconds(value: float | None) -> str:
    return "-- (not in the window)" if value is None else f"{value:.1f} s"


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, help="seconds of streaming per level (120; --quick 20)")
    p.add_argument("--period", type=float, help="seconds between preemptions (20; --quick 7)")
    p.add_argument("--claims", type=int, default=1024, help="claims in the stream, cycled (1024)")
    p.add_argument("--batch-size", type=int, default=8, help="claims per task (default 8)")
    args = p.parse_args()
    window = args.window or (20.0 if args.quick else 120.0)
    period = args.period or (7.0 if args.quick else 20.0)

    model = h.model_path(args)
    claims = h.load_claims(args.data, args.claims)
    work = h.batches([c.claim for c in claims], args.batch_size)
    print(
        f"{window:g} s per level, one of {args.workers} workers x 1 thread killed every "
        f"{period:g} s; tasks of {args.batch_size} claims from {len(claims)}; model {model}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )

    rows = []
    run = uuid.uuid4().hex[:8]
    with h._worker_environ():
        for level in LEVELS:
            rows.append(run_level(level, model, work, args.workers, window, period))
            row = rows[-1]
            print(
                f"  {level}: {row['claims_done']} claims in {row['tasks_done']} tasks, "
                f"load average {row['load_average']:.2f}",
                flush=True,
            )
            for k in row["kills"]:
                print(
                    f"    worker {k['worker']} killed at {k['t']:.1f} s; its replacement ready "
                    f"after {_seconds(k['ready_after_s'])}, first result after "
                    f"{_seconds(k['result_after_s'])}",
                    flush=True,
                )
    # A benchmark of wrong answers is worthless: a batch must get the same predictions at both
    # levels, however often its task was killed and run again.
    full, partial = (row.pop("predictions") for row in rows)
    wrong = sum(full[i] != partial[i] for i in full.keys() & partial.keys())
    if wrong:
        raise AssertionError(f"{wrong} batches scored differently at levels full and partial")
    for row in rows:
        row["run"] = run
    print()
    h.print_table(rows, COLUMNS)

    by_level = {row["level"]: row for row in rows}
    print()
    for row in rows:
        for message in row["error_messages"]:
            print(f"error at level {row['level']}: {message}")
    done = {level: by_level[level]["claims_done"] for level in LEVELS}
    ratio = done["full"] / done["partial"] if done["partial"] else float("inf")
    print(f"claims in the window, full / partial: {ratio:.2f}")
    print(f"{len(full.keys() & partial.keys())} batches scored at both levels, identically")
    h.write_json(args.json, rows)
    plot(args.json, rows)


def plot(path: Path | None, rows: list[dict]) -> None:
    """Claims scored in the window per level (the PNG beside ``path``)."""
    h.plot_bars(
        path,
        rows,
        "level",
        "claims_done",
        title=f"{rows[0]['window_s']:g} s, a worker killed every {rows[0]['period_s']:g} s",
        ylabel="claims scored in the window",
    )


if __name__ == "__main__":
    main()
