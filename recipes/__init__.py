"""Training recipes, baselines and reproduction scripts."""
