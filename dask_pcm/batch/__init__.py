"""The batch layer: any task function over any dataset, against contexts resident on the
workers, resumable and keyed by what determines the results (work in progress)."""

from __future__ import annotations
