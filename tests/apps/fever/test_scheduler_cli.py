"""``dask-pcm fever --scheduler/--scheduler-file``: a running cluster, its model kept."""

from __future__ import annotations

from click.testing import CliRunner

from dask_pcm import client as pcm
from dask_pcm.cli import main
from tests.conftest import cluster_client


def test_fever_runs_on_a_running_scheduler_that_keeps_the_model(tiny_model_dir, tmp_path):
    args = ["fever", "--model", str(tiny_model_dir), "--num-templates", "1", "--limit", "6"]
    with cluster_client(processes=True) as client:
        scheduler_file = tmp_path / "scheduler.json"
        client.write_scheduler_file(str(scheduler_file))
        for option in (["--scheduler", client.scheduler.address],
                       ["--scheduler-file", str(scheduler_file)]):  # fmt: skip
            result = CliRunner().invoke(main, [*args, *option])
            assert result.exit_code == 0, result.output
            assert "6 claims x 1 templates" in result.output
        (row,) = pcm.status(client).itertuples()
        assert (row.context, row.loads) == ("fever-llm", 1)  # two runs, one load
        clash = CliRunner().invoke(main, [*args, *option, "--cluster", "sge"])
        assert clash.exit_code == 2 and "drop --cluster sge" in clash.output
