"""Tests of the benchmark scripts (benchmarks/) and the tools (tools/)."""
