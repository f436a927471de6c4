"""Dask's dashboard and dask_pcm's pages, as a user reaches them after the README's install:
Dask's own pages (Bokeh), the contexts page beside them and inside them, the link a run
prints, the table Jupyter shows, and a template copy's progress."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

import dask_pcm
from dask_pcm.apps.fever.data import demo_claims
from dask_pcm.testing.models import build_tiny_llama
from tests.conftest import cluster_client


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as response:
        assert response.status == 200, url
        return response.read().decode()


def test_a_local_cluster_serves_dasks_dashboard_and_the_contexts_pages():
    with cluster_client(processes=True) as client:
        base = client.dashboard_link.rsplit("/", 1)[0]
        status = _get(f"{base}/status")
        assert "needs bokeh" not in status.lower()  # what it said without Bokeh installed
        assert "individual-pcm-contexts" in status  # the page sits in Dask's "More..." menu
        page = _get(f"{base}/individual-pcm-contexts")
        assert "Dask: PCM contexts" in page
        ours = _get(dask_pcm.status_page(client))
        assert 'href="../status"' in ours and 'href="../individual-pcm-contexts"' in ours


class SlowCopyLoader:
    """Builds nothing from a template whose copy is throttled (the simulated shared FS)."""

    def __call__(self, location: str) -> dict[str, str]:
        return {"location": location}


def test_a_worker_copying_a_template_shows_the_bytes_so_far(tmp_path):
    template = tmp_path / "model"
    template.mkdir()
    (template / "config.json").write_text("{}")
    (template / "model.safetensors").write_bytes(b"\0" * (2 * 2**20))
    settings = {
        "pcm.template.chunk-size": "128 KiB",
        "pcm.template.source-bandwidth": 2**20,  # 2 MiB in about 2 s
    }
    seen: list[tuple[str, int, int]] = []
    with cluster_client(config=settings) as client:
        context = dask_pcm.Context("copied", SlowCopyLoader(), template=str(template))
        registering = threading.Thread(target=dask_pcm.register, args=(client, context))
        registering.start()
        while registering.is_alive():
            for row in dask_pcm.status(client).itertuples():
                seen.append((row.state, row.bytes_from_source, row.template_bytes))
            time.sleep(0.1)
        registering.join()
    partial = [s for s in seen if s[0] == "fetching" and 0 < s[1] < s[2]]
    assert partial, f"no progress seen while fetching: {seen[:5]} ... {seen[-3:]}"
    assert seen[-1][1] <= seen[-1][2]


def test_status_shows_its_states_coloured_in_jupyter(inproc_cluster):
    _, client = inproc_cluster
    dask_pcm.register(client, dask_pcm.Context("shown", SlowCopyLoader(), template="here"))
    table = dask_pcm.status(client)
    html = table._repr_html_()
    assert re.search(r"background-color: #2e9d4e;\s*color: white", html)  # ready, green
    assert ">ready<" in html
    subset = table[["worker", "state"]]  # still a table that Jupyter shows coloured
    assert "#2e9d4e" in subset._repr_html_()
    assert "#2e9d4e" not in table[["worker"]]._repr_html_()


@pytest.mark.slow
def test_run_fever_prints_a_dashboard_link_that_answers_while_it_runs(tmp_path, capfd):
    model = build_tiny_llama(tmp_path / "tiny")
    answered: list[str] = []
    run = threading.Thread(
        target=dask_pcm.run_fever,
        kwargs={"model": str(model), "limit": len(demo_claims().claims), "workers": 1},
    )
    run.start()
    deadline = time.monotonic() + 120
    while run.is_alive() and time.monotonic() < deadline:
        printed = capfd.readouterr().err
        found = re.search(r"Dask dashboard: (\S+)\s+Contexts:\s+(\S+)", printed)
        if found:
            for url in found.groups():
                answered.append(url)
                _get(url)  # answers while the run is going
            break
        time.sleep(0.05)
    alive = run.is_alive()
    run.join(120)
    assert answered and alive, "no dashboard link printed while the run was going"
    assert answered[1].endswith("/pcm/status")


def test_importing_dask_pcm_leaves_the_dashboard_and_the_model_libraries_unloaded():
    # A worker imports dask_pcm on its first context or task; Bokeh (the dashboard page,
    # ~0.7 s of CPU), torch and transformers must wait until a scheduler or a model needs
    # them, or every worker that joins pays them in the middle of a template broadcast.
    code = (
        "import sys, distributed, dask_pcm; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'bokeh', 'torch', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_scheduler_started_with_the_preload_has_both_pages_from_its_start():
    # `dask scheduler --preload dask_pcm.scheduler.preload`, as in a fresh scheduler process:
    # the module adds the page on import, before the scheduler builds its dashboard.
    from distributed.dashboard import scheduler as dashboard

    from dask_pcm.deploy import SCHEDULER_PRELOAD
    from dask_pcm.scheduler import bokeh_page

    dashboard.applications.pop(bokeh_page.ROUTE, None)
    sys.modules.pop(SCHEDULER_PRELOAD, None)
    with cluster_client(n_workers=0, scheduler_kwargs={"preload": [SCHEDULER_PRELOAD]}) as client:
        base = client.dashboard_link.rsplit("/", 1)[0]
        assert "Dask: PCM contexts" in _get(base + bokeh_page.ROUTE)
        assert json.loads(_get(base + "/pcm/status.json"))["contexts"] == {}  # no register yet
