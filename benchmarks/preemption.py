"""Preemption (the paper's RQ3 at this machine's scale): inferences done in a fixed window
while workers are killed at random, at context levels full and partial, each against a
no-kill control.

Each run is a fresh ``dask_pcm.local_cluster`` (4 workers x 1 thread by default, ``--quick``
2; worker
processes under a nanny) fed a continuous stream of FEVER scoring tasks (8 claims per task,
one forward pass of the embedded SmolLM2-135M-Instruct each) for ``--window`` seconds (90;
``--quick`` 8). In a run with kills, worker processes are killed with SIGKILL at the times of
a seeded random schedule: a Poisson process with one kill every ``--period`` seconds on
average (20; ``--quick`` 3), each victim drawn at random from the workers, as a batch system
or a cloud provider would preempt them. Its nanny starts a fresh process, which joins with
nothing: it copies the model's template again (peer to peer, from a surviving worker), and
then at level ``full`` loads the model once and keeps it, while at level ``partial`` every
task it runs builds the model from that worker-local copy. The task that was running on the
killed worker is run again elsewhere (``distributed.scheduler.allowed-failures`` is raised so
that a task killed repeatedly is not declared lost).

The protocol (``_protocol``): ``--repetitions`` rounds (3; ``--quick`` 1). Round ``r`` draws
one kill schedule from seed ``--seed + r`` and runs four variants in a random order: full and
partial with that same schedule, and full and partial with no kills (the control). So each
level's **loss to preemption** (1 - claims with kills / claims without, paired by round) and
**full / partial** (with kills and without) come with a median and 95 % interval over the
rounds, i.e. over at least 3 kill schedules.

Measured, per level, within the window only:

- ``tasks``, ``claims``: tasks whose results reached the client before the window closed, and
  the claims they scored; ``claims/s`` is claims / window. Tasks still queued or running at
  the close are cancelled and not counted, nor is the work the killed workers lost.
- ``preemptions``: workers killed in the window (the schedule's kills before its close).
- ``errors``: tasks that ended in an error (they should be none); listed if any.
- ``loads``, ``load_s``: model builds in the window and the seconds they took, summed over
  every worker process that ran, from ``dask_pcm.status`` (read just before each kill, since
  a killed worker's row leaves the table, and at the close).
- for each preemption, printed below its level: seconds from the kill until the replacement
  process had its context ready (at ``partial``: its template copied; read once a second) and
  until it delivered its first result.

What is outside the window: cluster start-up, a first model load in each of the first
workers before ``register`` (then released; it imports torch, transformers and their lazily
imported model code, about 3 s here, as in ``levels.py``), and ``register`` itself. What is
inside: everything a preemption costs, including the restarted process's start, its imports
(those land in its first load at ``full`` and in its first task at ``partial``) and its
template copy. Every task's predictions must be the same at both levels; the run stops
otherwise.

Honesty note: the template is copied between two processes of one host and read from a warm
page cache, so a rebuild at ``partial`` is cheaper than from a shared filesystem, and the
restarted worker's start-up competes for the same two cores as the surviving workers (4
workers on 2 cores: each worker gets half a core, at every level and in the control alike).

Examples::

    python benchmarks/preemption.py --quick
    python benchmarks/preemption.py --json /tmp/preemption.json
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import _harness as h
import _protocol as P
import dask
from distributed import Client, Future

import dask_pcm

LEVELS = ("full", "partial")
FINISHED = ("finished", "error")
COLUMNS = [
    ("round", "round", "d"),
    ("level", "level", ""),
    ("preemption", "kills", ""),
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


def kill_schedule(seed: int, window: float, period: float, workers: int) -> list[tuple[float, int]]:
    """``(seconds into the window, index of the victim among the workers)`` of every kill: a
    Poisson process of rate 1 / ``period`` over ``window``, victims drawn uniformly; the same
    ``seed`` gives the same schedule (both levels of a round share it)."""
    rng = random.Random(seed)
    kills, t = [], rng.expovariate(1.0 / period)
    while t < window:
        kills.append((round(t, 2), rng.randrange(workers)))
        t += rng.expovariate(1.0 / period)
    return kills


def run_level(
    level: str,
    model: str,
    work: list[list[str]],
    workers: int,
    window: float,
    schedule: list[tuple[float, int]],
) -> dict:
    """Stream ``work`` (cycled) at ``level`` for ``window`` s, killing workers as ``schedule``
    says (none: the control)."""
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
        planned = list(schedule)
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
            due = bool(planned) and now - start >= planned[0][0]
            if now >= next_read or due:
                watch.read(now - start)  # just before a kill too: the victim's row goes
                next_read = now + 1.0
            if due:
                _, victim = planned.pop(0)
                kill = preempt(client, names[victim % len(names)])
                if kill is not None:
                    kills.append({"t": round(time.perf_counter() - start, 2), **kill})
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


def summarise(rows: list[dict]) -> list[dict]:
    """Per level, the loss to preemption; per kill setting, full / partial: median and 95 %
    interval over rounds (each round one kill schedule, shared by both levels)."""
    claims = P.by_variant(
        [{**r, "variant": f"{r['level']}@{r['preemption']}"} for r in rows],
        "variant",
        "claims_done",
    )
    out = []
    for level in LEVELS:
        kept = P.ratio_interval(claims[f"{level}@seeded"], claims[f"{level}@none"])
        loss = {**kept, "median": 1 - kept["median"], "low": 1 - kept["high"],
                "high": 1 - kept["low"], "mean": 1 - kept["mean"]}  # fmt: skip
        out.append({"metric": "loss_to_preemption", "level": level, **loss})
        out.append({"metric": "kept_under_preemption", "level": level, **kept})
    for kills in ("seeded", "none"):
        ratio = P.ratio_interval(claims[f"full@{kills}"], claims[f"partial@{kills}"])
        out.append(
            {
                "metric": "full_over_partial",
                "kills": kills,
                **ratio,
                "clears_noise": P.clears(ratio),
            }
        )
    return out


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.set_defaults(workers=None)
    p.add_argument("--window", type=float, help="seconds of streaming per run (90; --quick 8)")
    p.add_argument("--period", type=float, help="mean seconds between preemptions (20; --quick 3)")
    p.add_argument("--claims", type=int, default=1024, help="claims in the stream, cycled (1024)")
    p.add_argument("--batch-size", type=int, default=8, help="claims per task (default 8)")
    args = p.parse_args()
    reps = P.repetitions(args.quick, args.repetitions)
    args.workers = args.workers or (2 if args.quick else 4)
    window = args.window or (8.0 if args.quick else 90.0)
    period = args.period or (3.0 if args.quick else 20.0)

    model = h.model_path(args)
    claims = h.load_claims(args.data, args.claims)
    work = h.batches([c.claim for c in claims], args.batch_size)
    order = P.schedule([f"{lv}@{k}" for lv in LEVELS for k in ("seeded", "none")], reps, args.seed)
    print(
        f"{window:g} s per run, {args.workers} workers x 1 thread, a worker killed every "
        f"{period:g} s on average (seeded, shared by both levels of a round) or never; "
        f"{len(order)} runs in {reps} rounds; tasks of {args.batch_size} claims from "
        f"{len(claims)}; model {model}; load average {os.getloadavg()[0]:.2f}"
    )
    rows = []
    reference: dict[int, list[int]] = {}
    with h._worker_environ():
        for rnd, variant in order:
            level, _, kills = variant.partition("@")
            seed = args.seed + rnd
            plan = kill_schedule(seed, window, period, args.workers) if kills == "seeded" else []
            row = run_level(level, model, work, args.workers, window, plan)
            row.update(round=rnd, preemption=kills, schedule_seed=seed if plan else None)
            row["schedule"] = plan
            # A benchmark of wrong answers is worthless: a batch must get the same
            # predictions in every run, however often its task was killed and run again.
            for i, predicted in row.pop("predictions").items():
                if reference.setdefault(i, predicted) != predicted:
                    raise AssertionError(f"batch {i} scored differently in {variant}, round {rnd}")
            rows.append(row)
            print(
                f"  round {rnd} {level}, kills {kills}: {row['claims_done']} claims in "
                f"{row['tasks_done']} tasks, {row['preemptions']} killed, "
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
    rows.sort(key=lambda r: (r["round"], r["level"], r["preemption"]))
    print()
    h.print_table(rows, COLUMNS)
    print()
    for row in rows:
        for message in row["error_messages"]:
            print(f"error at level {row['level']}: {message}")
    summary = summarise(rows)
    for s in summary:
        what = s.get("level") or f"kills {s['kills']}"
        print(f"  {s['metric'].replace('_', ' '):<22} {what:<14} {P.format_interval(s)}")
    print(f"{len(reference)} batches scored, identically in every run")
    h.write_json(
        args.json,
        rows,
        reps=reps,
        summary=summary,
        seed=args.seed,
        window_s=window,
        period_s=period,
        workers=args.workers,
    )
    plot(args.json, rows, reps)


def plot(path: Path | None, rows: list[dict], reps: int) -> None:
    """Median claims scored in the window per level, with and without kills (beside ``path``)."""
    medians = [
        {"level": level, "kills": kills, "claims": P.interval(
            [r["claims_done"] for r in rows if r["level"] == level and r["preemption"] == kills]
        )["median"]}
        for level in LEVELS for kills in ("none", "seeded")
    ]  # fmt: skip
    h.plot_bars(
        path,
        medians,
        "level",
        "claims",
        group="kills",
        title=f"{rows[0]['window_s']:g} s per run, median of {reps} rounds",
        ylabel="claims scored in the window",
    )


if __name__ == "__main__":
    main()
