"""Tier 2: GPT training with Ray Train on gpu-tier nodes, reading tier-1 datasets."""
