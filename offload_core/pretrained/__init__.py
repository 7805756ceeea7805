"""The Python door: :func:`from_pretrained`, from a checkpoint folder, GGUF file, Hub repo id or diffusers pipeline
folder to a ready, offloaded model, planned by the plan's one request as ``run.py`` plans."""

from offload_core.pretrained.model import from_pretrained

__all__ = ["from_pretrained"]
