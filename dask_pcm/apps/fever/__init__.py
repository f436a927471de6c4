"""The FEVER application: verify FEVER claims with LLM contexts resident on Dask workers.

:mod:`~dask_pcm.apps.fever.data` reads and samples claims; :mod:`~dask_pcm.apps.fever.prompts` holds the
prompt templates that ask a model for a verdict.
"""

from __future__ import annotations

from dask_pcm.apps.fever.data import (
    LABELS,
    Claim,
    ClaimSet,
    demo_claims,
    load_claims,
    sample_claims,
    write_demo,
)
from dask_pcm.apps.fever.errors import FeverFormatError
from dask_pcm.apps.fever.prompts import (
    BUILTIN_TEMPLATES,
    VERBALISATIONS,
    PromptTemplate,
    get_templates,
    read_templates,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "LABELS",
    "VERBALISATIONS",
    "Claim",
    "ClaimSet",
    "FeverFormatError",
    "PromptTemplate",
    "demo_claims",
    "get_templates",
    "load_claims",
    "read_templates",
    "sample_claims",
    "write_demo",
]
