"""Imported once, by the fork server of :mod:`dask_pcm.deploy.forkserver`: the modules of
``pcm.worker.preimport-modules``, so that every worker forked from it starts with them.

Nothing else imports this module. A module that fails to import is logged and skipped
(an exception here would end the server, and with it every worker start): the worker's
own preimport and the load that needs it report the error, as in a spawned worker.
"""

from __future__ import annotations

import importlib
import logging
import time

from dask_pcm import config

logger = logging.getLogger(__name__)


def _import_all() -> None:
    for name in list(config.get("worker.preimport-modules") or []):
        began = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:
            logger.info("Fork server: import of %s failed: %s: %s", name, type(exc).__name__, exc)
            continue
        logger.debug("Fork server imported %s in %.2f s", name, time.perf_counter() - began)


_import_all()
