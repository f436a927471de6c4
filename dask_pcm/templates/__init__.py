"""Templates: the files a context is built from, and how they reach a worker's disk.

:mod:`.tree` says which files of a template travel (any tree of files, or one file) and
under which names; :mod:`.sources` resolves what a user names as a model into local files
and selects a model's files; :mod:`.embedded` makes the embedded default model one such
source; :mod:`.manifest` cuts a template into verifiable chunks; :mod:`.fetch` copies one
chunk by chunk from peers or the source; :mod:`.serve` serves what a worker holds to its
peers; :mod:`.local` keeps one copy per host and template; :mod:`.reader` reads the source.
"""
