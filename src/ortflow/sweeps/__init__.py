"""Sweeps: a config's `sweep` section made into points, each a run of its own
(points.py, which the Snakefile reads), and their comparison (comparison.py)."""
