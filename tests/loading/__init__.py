"""Tests of offload_core.loading: safetensors files, checkpoints, empty init, model sources and the loader."""
