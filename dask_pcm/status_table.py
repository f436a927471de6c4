"""The table :func:`dask_pcm.status` returns: a DataFrame that Jupyter shows with its states
coloured as on the ``/pcm/status`` page."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dask_pcm.protocol import STATE_COLOURS


def _state_style(state: Any) -> str:
    colour = STATE_COLOURS.get(str(state))
    return f"background-color: {colour}; color: white" if colour else ""


class StatusTable(pd.DataFrame):
    """A :class:`pandas.DataFrame` of status rows; in Jupyter the ``state`` column is coloured
    (green ready, amber fetching or loading, red failed, grey evicted) and the ``error``
    and ``warning`` texts are red. Everything else is an ordinary DataFrame."""

    @property
    def _constructor(self) -> type[StatusTable]:
        return StatusTable

    def _repr_html_(self) -> str | None:
        if "state" not in self.columns or len(self) > int(pd.get_option("display.max_rows")):
            return super()._repr_html_()
        style = self.style.map(_state_style, subset=["state"]).format(precision=2, na_rep="")
        texts = [c for c in ("warning", "error") if c in self.columns]
        if texts:
            style = style.map(lambda v: "color: #c8372d" if v else "", subset=texts)
        return str(style.to_html())
