"""The third workload: a trained model run over data on cheap nodes (batch scoring)."""
