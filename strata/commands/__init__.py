"""The commands: the shell every command runs in (`Command`, and `Job`: a run's lease, connection, usage and
record), the shared flags, and the `strata` subcommands (submit, head, keys, demo, report). The top layer: it may
import every other part of strata."""
