"""Tests of offload_core.storage: the stores and the offload folder's file-to-file copy."""
