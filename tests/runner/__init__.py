"""Tests of offload_core.runner: settings, reports, the CLI's error lines and run(cfg) on small models."""
