"""A pipeline offloaded to an accelerator gives diffusers' in-memory image on that device, pixel for pixel, within
its budget: on the fake accelerator (the tiny pipeline) and on a real GPU (a 0.38 GB one, skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import offload_core
from tests.pipelines.conftest import images

POLICIES = ["prefetch", "chained"]


@pytest.mark.parametrize("policy", POLICIES)
def test_fake_gpu_pipeline_matches_in_memory_within_budget(fake_gpu, pipeline_dir, reference, policy):
    accelerator = fake_gpu(memory="64MiB")
    budget = 600 * 1024
    pipeline = offload_core.from_pretrained(
        pipeline_dir,
        offload={"storage": "pinned_cpu", "policy": policy, "execution_device": "fakegpu:0"},
        max_memory=budget,
    )
    state = pipeline.offload_state
    try:
        assert state.offloaded_bytes() > 0 and state.store.pinned
        out = images(pipeline)
        assert out.device.type == "fakegpu"
        assert torch.equal(out.elem, reference)
        assert state.stats.bytes > 0
        assert 0 < accelerator.peak[0] <= budget
    finally:
        state.remove()


def test_fake_gpu_plan_keeps_the_denoiser_before_what_runs_once_per_image(fake_gpu, pipeline_dir, reference):
    """The denoiser runs once per denoising step, the text encoder and the VAE once per image: each byte of the
    denoiser the GPU keeps saves a move per step, so none of theirs is kept while some of the denoiser is not."""
    fake_gpu(memory="64MiB")
    pipeline = offload_core.from_pretrained(
        pipeline_dir,
        offload={"storage": "pinned_cpu", "policy": "chained", "execution_device": "fakegpu:0"},
        max_memory=600 * 1024,
    )
    state = pipeline.offload_state
    try:
        placed: dict[str, set[str]] = {}
        for key, device in pipeline.hf_device_map.items():
            placed.setdefault(key.split(".")[0], set()).add(str(device))
        assert placed["unet"] == {"0", "cpu"}, placed  # the budget keeps part of the denoiser
        assert placed["text_encoder"] == placed["vae"] == {"cpu"}, placed
        assert torch.equal(images(pipeline).elem, reference)
    finally:
        state.remove()


def save_pipeline(folder, width: int) -> int:
    """A seeded Stable-Diffusion-shaped pipeline whose UNet has channels (width, 2 width) saved to ``folder``; its
    bytes."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from offload_core.testing import _tiny_clip_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(width, 2 * width),
        layers_per_block=2,
        sample_size=16,
        cross_attention_dim=2 * width,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    vae = AutoencoderKL(
        block_out_channels=(width // 2, width),
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    tokenizer = _tiny_clip_tokenizer(folder / "_tokenizer")
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=2 * width,
            intermediate_size=4 * width,
            num_hidden_layers=4,
            num_attention_heads=8,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))


CALL = {"prompt": "a photo of a red cat", "num_inference_steps": 3, "height": 64, "width": 64, "output_type": "pt"}


@pytest.fixture(scope="module")
def gpu_pipeline(tmp_path_factory):
    """A 0.38 GB float32 pipeline and its in-memory image on cuda:0."""
    from diffusers import DiffusionPipeline

    folder = tmp_path_factory.mktemp("gpu-sd")
    total = save_pipeline(folder, 192)
    pipeline = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32).to("cuda")
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        image = pipeline(**CALL, generator=torch.Generator().manual_seed(0)).images.cpu()
    del pipeline
    torch.cuda.empty_cache()
    return folder, total, image


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_pipeline_matches_in_memory_within_budget(gpu_pipeline, policy, tmp_path):
    folder, total, reference = gpu_pipeline
    budget = 256 * 2**20  # about two thirds of the weights; the plan holds back the 64x64 call's activations
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    pipeline = offload_core.from_pretrained(
        folder,
        offload={
            "storage": "pinned_cpu",
            "policy": policy,
            "offload_folder": tmp_path / "off",
            "execution_device": "cuda:0",
        },
        max_memory=budget,
        plan_call={"height": 64, "width": 64},
    )
    state = pipeline.offload_state
    try:
        assert state.offloaded_bytes() > total // 4 and state.store.pinned
        pipeline.set_progress_bar_config(disable=True)
        for _ in range(2):  # the second image runs on what the first one left (prefetch's recorded order)
            out = pipeline(**CALL, generator=torch.Generator().manual_seed(0)).images
            assert out.device.type == "cuda"
            assert torch.equal(out.cpu(), reference)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(0) - base
        assert peak <= budget, f"{policy}: GPU peak {peak / 2**20:.1f} MiB over the {budget / 2**20:.0f} MiB budget"
    finally:
        state.remove()
    torch.cuda.empty_cache()
