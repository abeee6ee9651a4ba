"""strata: the small shared package of the platform.

Tiers (node labels), the storage layout, the Ray connection, the dataset
contract between tier 1 and tier 2, and run records. It imports none of
`pipelines`, `train` or `tune`.
"""

__version__ = "0.1.0"
