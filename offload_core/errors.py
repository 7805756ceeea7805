"""The one error type users can cause, and its subclasses: each message says what was wrong and what to do."""

from __future__ import annotations


class OffloadError(Exception):
    """A mistake in what the user gave us (config, checkpoint, device map, folder).

    The runner prints ``str(error)`` as a single line and exits non-zero; no traceback.
    """


class ConfigError(OffloadError, ValueError):
    """A config value that cannot be used (unknown name, bad size, impossible budget); a ``ValueError`` too, as in
    accelerate."""


class DeviceMapError(OffloadError, ValueError):
    """A device map that does not cover the model exactly once or names unknown devices; a ``ValueError`` too, as in
    accelerate."""


class CheckpointError(OffloadError):
    """A checkpoint that is missing, truncated, inconsistent or unsafe to read."""


class StorageError(OffloadError):
    """An offload folder or store that cannot be used as asked."""


class PluginError(OffloadError):
    """A plugin that is unknown, duplicated or failed to load."""


class GraphsError(OffloadError):
    """``graphs=true`` asked of a run whose decoding step cannot be captured (no CUDA, a store that is not pinned,
    a policy other than prefetch, speculative decoding)."""
