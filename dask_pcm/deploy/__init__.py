"""Where workers come from: local clusters, Grid Engine and HTCondor jobs (through
dask-jobqueue), and how a worker leaves when its job is preempted."""
