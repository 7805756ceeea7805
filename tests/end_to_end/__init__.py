"""End-to-end tests: run.py in subprocesses, whole models through every strategy, faults, sweeps; all marked slow."""
