"""Example rlkit plugins: KL controller `pid`, reward `weighted-sum`, and environment `unit-converter`
with its prompt source `conversion-tasks`.

rlkit loads each module through its own entry point (see pyproject.toml); nothing here needs importing.
"""
