"""A tiny Stable Diffusion pipeline saved once per worker, and its in-memory images (diffusers' own pipeline)."""

from __future__ import annotations

import pytest
import torch

from offload_core.testing import tiny_pipeline

#: two denoising steps of a 16x16 image: every component runs, the denoiser more than once
CALL = {
    "prompt": "a photo of a red cat",
    "num_inference_steps": 2,
    "height": 16,
    "width": 16,
    "output_type": "pt",
    "guidance_scale": 7.5,
}


def images(pipeline) -> torch.Tensor:
    pipeline.set_progress_bar_config(disable=True)
    return pipeline(**CALL, generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="session")
def pipeline_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd")
    tiny_pipeline(path)
    return path


@pytest.fixture(scope="session")
def reference(pipeline_dir) -> torch.Tensor:
    from diffusers import DiffusionPipeline

    return images(DiffusionPipeline.from_pretrained(pipeline_dir, torch_dtype=torch.float32))
