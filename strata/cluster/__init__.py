"""The cluster: connecting to Ray or starting an embedded one on loopback (`connect`), the tiers a stage asks
for (node labels), and the processes on this machine (`procs`). It may import `strata.errors`, `strata.data`
and itself; never accounting or the commands."""
