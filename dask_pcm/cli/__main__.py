"""``python -m dask_pcm.cli``: the ``dask-pcm`` command."""

import sys

from dask_pcm.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
