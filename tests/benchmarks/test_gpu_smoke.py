"""tools/gpu_smoke.py runs end to end without a GPU (``--allow-cpu``): the GPU checks skip,
the others pass, and the figures land in the JSON file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_smoke.py"
CHECKS = {"weights", "logits", "peak-memory", "release", "fever", "oversized-batch"}


@pytest.mark.soak  # a whole tool run (every check, the FEVER one included): CI runs it after
# the README's command
def test_the_gpu_smoke_script_runs_on_a_cpu(tmp_path: Path) -> None:
    report = tmp_path / "smoke.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--allow-cpu", "--limit", "20", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(report.read_text())
    checks = figures["checks"]
    assert set(checks) == CHECKS
    assert figures["passed"] is True
    assert all(c["status"] in ("PASS", "SKIP") for c in checks.values())
    assert checks["logits"]["status"] == "PASS"
    fever = checks["fever"]
    assert fever["status"] == "PASS", fever["notes"]
    assert fever["compared"] == fever["tasks"] == 20
    assert fever["agree"] == 20
    for name in CHECKS:  # one printed line per check
        assert re.search(rf"^(PASS|SKIP) {name}: ", run.stdout, re.MULTILINE), run.stdout
