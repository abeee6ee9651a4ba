"""Accounting: what a run cost and used (prices, usage sampling, the Ray daemons' CPU), the run records and the
ledger built from them, the run log, what a run ran (code version, hosts), and OpenLineage events. It may import
`strata.errors`, `strata.data`, `strata.cluster` and itself; never the commands."""
