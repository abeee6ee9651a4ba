"""strata: the small shared package of the platform, in four layers, each allowed to import only those before it
(tests/test_layout.py holds it to that):

- `strata.errors`: exit codes, StrataError, log; imports nothing of strata's;
- `strata.data`: storage, integrity and signing, leases, the dataset contract between tier 1 and tier 2, lineage,
  the input readers, the tokenizer;
- `strata.cluster`: the Ray connection, tiers (node labels), this machine's processes;
- `strata.accounting`: costs, run records, the ledger, OpenLineage events;
- `strata.commands`: the command shell and the `strata` subcommands.

It imports none of `pipelines`, `train`, `tune` or `infer`.
"""

__version__ = "0.1.0"
