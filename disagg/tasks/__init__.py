"""Tasks: data sources and reward functions."""
