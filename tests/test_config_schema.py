"""The ``pcm`` settings: ``pcm-schema.yaml`` describes every key of ``pcm.yaml``, and a key
that is no setting (a typo in a config file or an environment variable) is reported with the
closest one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from dask_pcm import config

PACKAGE = Path(config.__file__).parent
DEFAULTS = yaml.safe_load((PACKAGE / "pcm.yaml").read_text())
SCHEMA = yaml.safe_load((PACKAGE / "pcm-schema.yaml").read_text())


def _default_keys(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _default_keys(value, f"{path}.")
        else:
            yield path


def _schema_keys(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, entry in node["properties"].items():
        path = f"{prefix}{key}"
        if entry.get("type") == "object":
            yield from _schema_keys(entry, f"{path}.")
        else:
            yield path, entry


def test_the_schema_and_pcm_yaml_name_the_same_keys() -> None:
    defaults = set(_default_keys(DEFAULTS))
    described = dict(_schema_keys(SCHEMA))
    assert sorted(defaults - described.keys()) == [], "keys of pcm.yaml missing from the schema"
    assert sorted(described.keys() - defaults) == [], "keys of the schema missing from pcm.yaml"
    assert {"pcm.default-level", "pcm.batch.flush-interval", "pcm.worker.prefix-cache"} <= defaults
    for key, entry in described.items():
        assert "type" in entry, key
        assert len(entry.get("description", "").split()) >= 5, f"{key} has no description"


def test_the_defaults_validate_against_the_schema() -> None:
    jsonschema.validate(DEFAULTS, SCHEMA)
    wrong = {"pcm": {**DEFAULTS["pcm"], "default-level": "resident"}}
    with pytest.raises(jsonschema.ValidationError, match="resident"):
        jsonschema.validate(wrong, SCHEMA)


def test_a_mistyped_key_is_reported_with_the_closest_setting() -> None:
    user = {
        "pcm": {
            "batch": {"flush_intervl": "10s", "flush_interval": "5s"},  # `_` reads as `-`
            "btach": {"segment-rows": 10},  # an unknown section: each key under it
            "fever": {"segment-rows": 10, "truncate": True},  # a deprecated alias, a setting
            "worker": {"preemption-signals": ["SIGTERM"], "zzzzzzzzzz": 1},
        }
    }
    assert config.unknown_keys(user) == [
        ("pcm.batch.flush_intervl", "pcm.batch.flush-interval"),
        ("pcm.btach.segment-rows", "pcm.batch.segment-rows"),
        ("pcm.worker.zzzzzzzzzz", None),
    ]
    with pytest.warns(UserWarning) as caught:
        config.warn_unknown_keys(user)
    assert [str(w.message) for w in caught] == [
        "pcm.batch.flush_intervl is not a dask_pcm setting and is ignored: "
        "did you mean pcm.batch.flush-interval?",
        "pcm.btach.segment-rows is not a dask_pcm setting and is ignored: "
        "did you mean pcm.batch.segment-rows?",
        f"pcm.worker.zzzzzzzzzz is not a dask_pcm setting and is ignored: "
        f"the settings are in {PACKAGE / 'pcm.yaml'}",
    ]
    assert config.unknown_keys({"pcm": DEFAULTS["pcm"]}) == []


def _warnings_at_import(environment: dict[str, str], tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(environment, DASK_CONFIG=str(tmp_path))  # no user config files
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import dask_pcm.config\n"
        "    import dask_pcm  # a second import warns no more\n"
        "for w in caught:\n"
        "    if 'dask_pcm setting' in str(w.message): print(w.category.__name__, w.message)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_a_mistyped_environment_variable_warns_once_when_dask_pcm_loads(tmp_path: Path) -> None:
    (tmp_path / "site.yaml").write_text("pcm:\n  worker:\n    load-concurency: 2\n")
    lines = _warnings_at_import(
        {
            "DASK_PCM__BATCH__FLUSH_INTERVL": "10s",
            "DASK_PCM__BATCH__TASK_SECONDS": "2s",  # a setting
            "DASK_PCM__FEVER__FLUSH_INTERVAL": "10s",  # a deprecated alias: no typo
        },
        tmp_path,
    )
    assert lines == [
        "UserWarning pcm.batch.flush_intervl (environment variable "
        "DASK_PCM__BATCH__FLUSH_INTERVL) is not a dask_pcm setting and is ignored: "
        "did you mean pcm.batch.flush-interval?",
        "UserWarning pcm.worker.load-concurency is not a dask_pcm setting and is ignored: "
        "did you mean pcm.worker.load-concurrency?",
    ]
