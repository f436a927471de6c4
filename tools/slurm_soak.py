"""A FEVER run on SLURM worker jobs while jobs are cancelled or killed at random.

Starts ``--jobs`` worker jobs on the SLURM that ``ci/slurm/setup.sh`` runs, scores at least
2,000 units (``--claims`` x ``--templates``, one claim per unit), and every 8-20 s (seeded)
either ``scancel``s a worker job or SIGKILLs its nanny and worker (a vanished node), any
worker but the last one with the context ready. Prints what it did and checks what a user
relies on: every (claim, template) row exactly once, as many replacement jobs as jobs lost
(none extra), and every replacement's template copied from a peer.

    sudo bash ci/slurm/setup.sh && python tools/slurm_soak.py --jobs 3 --claims 500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import dask
from distributed import Client

import dask_pcm
from dask_pcm.apps.fever import demo_claims

DEV = Path(__file__).parents[2] / "shared" / "data" / "fever" / "paper_dev.jsonl"


def claims_file(folder: Path, n: int) -> Path:
    if DEV.exists():
        lines = DEV.read_text().splitlines()[:n]
    else:  # the demo claims, repeated under new ids
        pool = demo_claims().claims
        lines = [json.dumps({"id": i, "label": pool[i % 30].label, "claim": pool[i % 30].claim})
                 for i in range(n)]  # fmt: skip
    path = folder / "claims.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


class Preemptor(threading.Thread):
    def __init__(self, cluster, client: Client, seed: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.client = cluster, client
        self.rng = random.Random(seed)
        self.done: list[tuple[float, str, str]] = []
        self.stop = threading.Event()
        self.rows: dict[str, dict] = {}  # the last status row seen of every worker
        self.error: BaseException | None = None

    def _watch(self, seconds: float) -> bool:
        """Record every worker's status row each second for ``seconds``; True once stopped."""
        deadline = time.monotonic() + seconds
        while not self.stop.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            present = dask_pcm.status(self.client).to_dict("records")
            for row in present:
                self.rows[row["worker"]] = row
            for worker in set(self.rows) - {row["worker"] for row in present}:
                self.rows[worker] = {**self.rows[worker], "state": "gone"}
            if time.monotonic() >= deadline:
                return False
        return True

    def run(self) -> None:
        try:
            self._preempt()
        except BaseException as exc:  # reported by main
            self.error = exc

    def _preempt(self) -> None:
        start = time.monotonic()
        while not self._watch(self.rng.uniform(8, 20)):
            workers = self.client.scheduler_info()["workers"]
            ready = {w for w, row in self.rows.items() if row["state"] == "ready"}
            # Any worker may go, as long as another one with the context ready stays: the
            # run goes on and a peer holds the template for the joiners.
            victims = sorted(w for w in workers if ready - {w})
            if not victims:
                continue
            address = self.rng.choice(victims)
            job = self.cluster.workers[workers[address]["name"]].job_id
            if self.rng.random() < 0.5:
                subprocess.run(["scancel", job], check=False)
                how = "scancel"
            else:
                pid = self.client.run(os.getpid, workers=[address])[address]
                nanny = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
                for p in (pid, nanny):
                    os.kill(p, signal.SIGKILL)
                how = "kill -9"
            self.done.append((time.monotonic() - start, how, job))
            print(f"  {time.monotonic() - start:6.1f} s  {how:8s} job {job}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--templates", type=int, default=4)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="slurm-soak-"))
    data = claims_file(folder, args.claims)
    cache = dask_pcm.config.cache_directory()
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "2s"}):
        cluster = dask_pcm.batch_cluster(
            "slurm", workers=args.jobs, cores=1, memory="3GB", processes=1, interface="lo",
            walltime="01:00:00", log_directory=str(folder / "logs"), watch_interval="1s",
            local_directory=str(folder / "scratch"),
            scheduler_options={"dashboard_address": ":0"},
            job_script_prologue=[f"export DASK_PCM__CACHE_DIRECTORY={cache}"],
        )  # fmt: skip
        with cluster, Client(cluster) as client:
            client.wait_for_workers(args.jobs, timeout=300)
            first = set(client.scheduler_info()["workers"])
            preemptor = Preemptor(cluster, client, args.seed)
            start = time.monotonic()
            preemptor.start()
            try:
                result = dask_pcm.run_fever(
                    data, model=args.model, cluster=client, num_templates=args.templates,
                    claims_per_task=1, output=folder / "preds", progress=False,
                )  # fmt: skip
            finally:
                preemptor.stop.set()
                preemptor.join(60)
            seconds = time.monotonic() - start
            time.sleep(5)  # the watchdog's last round
            replaced = cluster.replaced_jobs
    rows = result.predictions
    units = result.report["units"]["total"]
    once = not rows.duplicated(["claim_id", "template"]).any()
    lost = len(preemptor.done)
    kinds = {k: sum(1 for _, how, _ in preemptor.done if how == k) for k in ("scancel", "kill -9")}
    print(
        f"{units} units, {len(rows)} rows in {seconds:.0f} s on {args.jobs} jobs; every row "
        f"once: {once}; jobs lost: {lost} ({kinds['scancel']} scancel, {kinds['kill -9']} "
        f"kill -9); replacements submitted: {replaced}; row errors: "
        f"{result.report['row_errors']}"
    )
    submitted = len(list((folder / "logs").glob("*.err")))  # one per job that started
    print(f"jobs started in all: {submitted} ({args.jobs} at first, {submitted - args.jobs} after)")
    joiners = [r for w, r in preemptor.rows.items() if w not in first and r["template_held"]]
    from_source = sum(r["bytes_from_source"] for r in joiners)
    print(f"replacements holding the template: {len(joiners)}, bytes read from the source: "
          f"{from_source} (a peer always held it)")  # fmt: skip
    ok = once and len(rows) == units and replaced == lost == submitted - args.jobs
    ok = ok and preemptor.error is None and bool(joiners) and from_source == 0
    print("OK" if ok else "FAILED")
    if preemptor.error is not None:
        print(f"the preemptor failed: {preemptor.error!r}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
