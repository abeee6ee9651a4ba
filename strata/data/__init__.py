"""Storage and datasets: what strata keeps and how it is read and written. The storage layer (local, NFS, S3,
GCS; atomic writes, conditional creates, the containment check), integrity (a file trusted only when a commit
names its digest) and signing, leases, the Delta Lake dataset contract (reading in `dataset`, writing in
`commit`, rows for training in `rows`), lineage, the input readers (files, JSON, parquet, web crawls) and the
tokenizer. It may import only `strata.errors` and itself: no cluster, no accounting, no command."""
