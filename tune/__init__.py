"""Sweeps: Ray Tune over train's loop, trials on spot-tier CPU nodes."""
