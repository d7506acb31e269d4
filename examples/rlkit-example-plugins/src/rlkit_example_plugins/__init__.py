"""Example rlkit plugins: KL controller `pid` and reward `weighted-sum`.

rlkit loads each module through its own entry point (see pyproject.toml); nothing here needs importing.
"""
