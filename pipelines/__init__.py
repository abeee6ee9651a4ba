"""Tier 1: Ray Data preprocessing, raw text to a versioned parquet dataset."""
