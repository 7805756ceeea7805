"""Diffusers pipelines as one model: one plan over every component, every policy and store giving the in-memory
images bit for bit, and chained at whole-component granularity (each component stays until the next is called)."""

from __future__ import annotations


import pytest
import torch

import offload_core
from offload_core.loading.pipeline import component_no_split
from offload_core.loading.pipeline_checkpoint import PipelineCheckpoint

from tests.pipelines.conftest import images

POLICIES = ["align_per_call", "chained", "experts", "functional_call", "prefetch"]
#: memmap writes its folder (369 small files, each synced) once per worker: seconds, so it runs with the slow tests
STORES = [pytest.param("memmap", marks=pytest.mark.slow), "pinned_cpu", "safetensors"]
#: every component offloaded whole: the text encoder, the UNet and the VAE all come from the store
ALL_ON_DISK = {"text_encoder": "disk", "unet": "disk", "vae": "disk"}


@pytest.mark.parametrize("storage", STORES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_and_store_gives_the_in_memory_images(
    pipeline_dir, reference, third_on_cpu, offload_folder, policy, storage
):
    # one map for every case, so the memmap store's folder is written once and reused
    pipeline = offload_core.from_pretrained(
        pipeline_dir,
        offload={"device_map": third_on_cpu, "policy": policy, "storage": storage, "offload_folder": offload_folder},
    )
    with pipeline.offload_state as state:
        out = images(pipeline)
        assert state.stats.bytes > 0
    assert {key.split(".")[0] for key in pipeline.hf_device_map} == {"text_encoder", "unet", "vae"}
    assert "disk" in pipeline.hf_device_map.values() and "cpu" in pipeline.hf_device_map.values()
    assert torch.equal(out, reference)


@pytest.fixture(scope="module")
def third_on_cpu(pipeline_dir) -> dict:
    """The sequential placement's map with a cpu budget of about a third of the pipeline, all of it for weights:
    every component is split between the cpu and the disk."""
    pipeline = offload_core.from_pretrained(
        pipeline_dir,
        offload={"storage": "safetensors", "policy": "align_per_call", "headroom": 0},
        max_memory={"cpu": 150_000},
    )
    return dict(pipeline.hf_device_map)


@pytest.fixture(scope="module")
def offload_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("offload")


@pytest.mark.parametrize("placement", ["sequential", "balanced", "balanced_low_0"])
def test_one_plan_over_every_component_within_one_budget(pipeline_dir, placement):
    from offload_core.loading.pipeline_load import open_pipeline
    from offload_core.planning import PlacementRequest, compute_module_sizes, normalize_device_map
    from offload_core.registry.manager import get_registry

    empty, checkpoint, no_split = open_pipeline(pipeline_dir, None, 60_000)
    with checkpoint:
        assert checkpoint.get("unet.conv_in.weight").shape == empty.modules.unet.conv_in.weight.shape
        assert set(checkpoint.keys()) >= {k for k in empty.modules.state_dict() if not k.endswith("position_ids")}
    # the text encoder (65 kB) fits the whole-component limit only at 70 kB; the others split at their blocks
    assert "CLIPTextModel" not in no_split and "ResnetBlock2D" in no_split
    assert "CLIPTextModel" in component_no_split(empty, 70_000, torch.float32)
    request = PlacementRequest(
        model=empty.modules, max_memory={"cpu": 150_000}, no_split_module_classes=no_split, dtype=torch.float32
    )
    device_map = normalize_device_map(get_registry().create("placement", placement).make_device_map(request))
    sizes = compute_module_sizes(empty.modules, dtype=torch.float32)
    on_cpu = sum(sizes[key] for key, device in device_map.items() if device == "cpu")
    assert 0 < on_cpu <= 150_000 and "disk" in device_map.values()
    assert {key.split(".")[0] for key in device_map} == {"text_encoder", "unet", "vae"}


def _loaded(pipeline) -> dict[str, bool]:
    return {unit.name: unit.loaded for unit in pipeline.offload_state.handle.units}


def test_chained_moves_each_component_whole_once_and_keeps_it_until_the_next(pipeline_dir, reference):
    pipeline = offload_core.from_pretrained(
        pipeline_dir, offload={"device_map": ALL_ON_DISK, "policy": "chained", "storage": "safetensors"}
    )
    seen: list[tuple[str, dict[str, bool]]] = []
    # inside each component, once its module hooks ran: which components are loaded then
    for name, inner in (
        ("text_encoder", pipeline.text_encoder.embeddings),
        ("unet", pipeline.unet.conv_in),
        ("vae", pipeline.vae.post_quant_conv),
    ):
        inner.register_forward_pre_hook(lambda module, args, name=name: seen.append((name, _loaded(pipeline))))
    out = images(pipeline)
    assert torch.equal(out, reference)
    names = [name for name, _ in seen]
    assert names == sorted(names, key=["text_encoder", "unet", "vae"].index) and names.count("unet") == 2
    for name, loaded in seen:
        assert loaded == {unit: unit == name for unit in ("text_encoder", "unet", "vae")}, (name, loaded)
    # the UNet runs at every step, yet each component was read from the store once
    assert pipeline.offload_state.stats.bytes == _stored_bytes(pipeline_dir)
    assert _loaded(pipeline) == {
        "text_encoder": False,
        "unet": False,
        "vae": True,
    }  # the last needs an explicit offload
    pipeline.offload_state.release()
    assert not any(_loaded(pipeline).values())


def _stored_bytes(path) -> int:
    with PipelineCheckpoint.open_components(path, ["text_encoder", "unet", "vae"]) as checkpoint:
        return checkpoint.total_bytes()


def test_remove_gives_back_the_in_memory_pipeline(pipeline_dir, reference):
    pipeline = offload_core.from_pretrained(pipeline_dir, offload={"device_map": ALL_ON_DISK, "storage": "pinned_cpu"})
    decode = type(pipeline.vae).decode
    pipeline.offload_state.remove()
    assert type(pipeline).__name__ == "StableDiffusionPipeline" and "decode" not in vars(pipeline.vae)
    assert type(pipeline.vae).decode is decode and pipeline.unet.conv_in.weight.device.type == "cpu"
    assert torch.equal(images(pipeline), reference)
