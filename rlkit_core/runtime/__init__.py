# pyright: standard
"""The training runtime: the trainer and its loop, distributed processes, checkpoints, faults and
health checks, evaluation, outputs (metrics, report, plot, export) and the command line. Imports the
recipe layer and the plugin API."""
