"""Contract checks for plugin authors: a placement's map is complete and within budget, a store round-trips, a policy
keeps outputs and sizes what it keeps in flight.

Call them from your plugin's tests (our built-in plugins are checked with the same functions)::

    from offload_core.testing import check_placement, check_store_round_trip, check_policy_preserves_outputs
    from offload_core.testing import check_policy_reservation

Each raises ``AssertionError`` saying what broke the contract, and returns what it checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from offload_core.planning import PlacementRequest
from offload_core.values import budget_key


def _resolve(kind: str, strategy: Any) -> Any:
    """A strategy by registered name, or a built one as an instance of its kind's contract."""
    from offload_core.registry.manager import as_strategy, get_registry

    if isinstance(strategy, str):
        return get_registry().create(kind, strategy)
    return as_strategy(kind, strategy)


def check_placement(placement: Any, request: PlacementRequest) -> dict[str, int | str]:
    """``placement.make_device_map(request)`` covers every tensor exactly once, names only known devices, and keeps
    every device's bytes within its budget minus the reservation ``request.reserve`` holds back there.

    ``placement`` is a built placement (or a registered name). Returns the normalised device map.
    """
    from offload_core.planning import check_device_map, get_max_memory, normalize_device_map, summarize_device_map
    from offload_core.values import device_key
    from offload_core.values import parse_size

    placement = _resolve("placement", placement)
    device_map = normalize_device_map(placement.make_device_map(request))
    check_device_map(request.model, device_map, strict=True)
    budgets = get_max_memory(request.max_memory, check_devices=False)
    reserve = {device_key(k): parse_size(v) for k, v in (request.reserve or {}).items()}
    summary = summarize_device_map(request.model, device_map, budgets, dtype=request.dtype)
    for device, info in summary["devices"].items():
        if device == "disk":
            continue
        assert device in budgets, f"the placement used device {device!r}, which has no budget in {budgets}"
        limit = budgets[device] - reserve.get(device, 0)
        assert info["bytes"] <= limit, (
            f"device {device!r} holds {info['bytes']} bytes, over its budget {budgets[device]} minus the "
            f"{reserve.get(device, 0)} bytes reserved there"
        )
    return device_map


def round_trip_tensors() -> dict[str, torch.Tensor]:
    """Tensors a store must give back exactly: every common dtype, a 0-d, an empty and a non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": base.clone(),
        "f16": base.to(torch.float16),
        "bf16": base.to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (5, 3), dtype=torch.int8, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (7,), dtype=torch.int64, generator=g),
        "bool": torch.rand(4, 4, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "noncontig": base.t(),
    }


def _assert_same(store: Any, tensors: dict[str, torch.Tensor], how: str) -> None:
    assert set(store) == set(tensors), f"{how}: the store holds {sorted(store)}, expected {sorted(tensors)}"
    assert len(store) == len(tensors), f"{how}: len(store) is {len(store)}, expected {len(tensors)}"
    for name, expected in tensors.items():
        got = store[name]
        assert got.device.type == "cpu", f"{how}: {name!r} came back on {got.device}, expected cpu"
        assert got.dtype == expected.dtype, f"{how}: {name!r} came back as {got.dtype}, expected {expected.dtype}"
        assert got.shape == expected.shape, (
            f"{how}: {name!r} came back with shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        )
        assert torch.equal(got, expected), f"{how}: {name!r} came back with other values"


def check_store_round_trip(storage_factory: Any, tmp_path: str | Path) -> None:
    """A store gives back exactly what it was given: fp32, fp16, bf16, int8, int64, bool, 0-d, empty, non-contiguous.

    ``storage_factory`` is a built storage (with ``open(context)``), a registered name, or a callable
    ``context -> Store``. Checked twice: filled from a safetensors checkpoint through
    ``add_from_checkpoint`` (what loading does; stores that read in place are covered here), and
    through ``put`` (skipped for stores that refuse ``put`` with an ``OffloadError``).
    """
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.writer import write_sharded_safetensors
    from offload_core.errors import OffloadError
    from offload_core.storage import StoreContext

    # a callable (a Store class, a function) opens the store itself; a name or a built storage through its open()
    opener: Callable[[StoreContext], Any] = (
        storage_factory if callable(storage_factory) else _resolve("storage", storage_factory).open
    )
    tmp_path = Path(tmp_path)
    tensors = round_trip_tensors()
    ckpt_dir = tmp_path / "round_trip_checkpoint"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_sharded_safetensors({k: v.contiguous() for k, v in tensors.items()}, ckpt_dir, max_shard_size=512)
    with Checkpoint.open(ckpt_dir) as checkpoint:
        context = StoreContext(
            names=list(tensors),
            offload_folder=tmp_path / "from_checkpoint",
            checkpoint=checkpoint,
            fingerprint={"check": "from_checkpoint"},
        )
        store = opener(context)
        try:
            for name in tensors:
                store.add_from_checkpoint(name, checkpoint, name, None)
            store.finalize()
            _assert_same(store, tensors, "filled from a checkpoint")
        finally:
            store.close()

        context = StoreContext(
            names=list(tensors), offload_folder=tmp_path / "put", checkpoint=checkpoint, fingerprint={"check": "put"}
        )
        store = opener(context)
        try:
            try:
                store.put("f32", tensors["f32"])
            except OffloadError:
                return  # a store that only references checkpoint tensors
            for name, tensor in tensors.items():
                if name != "f32":
                    store.put(name, tensor)
            store.finalize()
            _assert_same(store, tensors, "filled with put")
        finally:
            store.close()


def tiny_tied_llama(directory: str | Path):
    """A seeded 4-layer Llama with tied embeddings saved to ``directory`` in small shards; returns
    ``(config, model)``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from offload_core.loading.writer import write_sharded_safetensors

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_sharded_safetensors(model.state_dict(), directory, max_shard_size=200_000)
    config.save_pretrained(directory)
    return config, model


def paged_mixtral_config(layers: int = 4, **extra: Any):
    """A Mixtral config whose per-expert tensors span whole pages (16 KiB and more in float32: 4 experts, top-2), so
    that stores can map them; ``extra``: more config keys."""
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        **extra,
    )


def tiny_mixtral(directory: str | Path, layers: int = 4):
    """A seeded Mixtral (4 experts, top-2, per-expert tensors of 32 KiB: whole pages, as a store maps them) with a
    small word tokenizer, saved to ``directory`` by transformers' ``save_pretrained``; returns ``(config, model)``."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    tokenizer = _tiny_clip_tokenizer(directory)
    config = paged_mixtral_config(layers, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return config, model


def check_policy_preserves_outputs(policy: Any, tmp_path: str | Path, storage: Any = "memmap") -> None:
    """A module-hook policy leaves outputs unchanged: a tiny tied Llama with half its bytes on disk gives logits
    bit-identical to the in-memory model (twice, so state kept between forwards is covered), moves bytes,
    and ``remove()`` gives back the original weights with the tie kept.

    ``policy`` is a built policy (with ``attach``) or a registered name; ``storage`` likewise.
    """
    from transformers import AutoModelForCausalLM

    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.empty import init_empty_weights
    from offload_core.plan.request import PlanRequest, dispatch, model_dtype, plan_request, read_request_generation
    from offload_core.planning import compute_module_sizes, no_split_classes

    tmp_path = Path(tmp_path)
    config, reference = tiny_tied_llama(tmp_path / "tiny_tied_llama")
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config).eval()
    total = compute_module_sizes(model)[""]
    request = PlanRequest(
        torch.device("cpu"),
        no_split_classes(model, None),
        model_dtype(model),
        max_memory={"cpu": total // 2},
        placement="sequential",
        storage=_resolve("storage", storage),
        policy=_resolve("policy", policy),
        headroom=0,  # forwards only: nothing held beside the weights, half of which go to disk
        generation=read_request_generation(model, None),
    )
    checkpoint = Checkpoint.open(tmp_path / "tiny_tied_llama")  # planned and dispatched through the one door
    try:
        dispatch(plan_request(model, checkpoint, request), model, checkpoint, tmp_path / "offload")
    except BaseException:
        checkpoint.close()
        raise
    state = model.offload_state
    assert "disk" in set(model.hf_device_map.values()), f"nothing was offloaded: {model.hf_device_map}"
    try:
        with torch.no_grad():
            for attempt in ("first", "second"):
                got = model(ids).logits
                assert torch.equal(got, expected), f"{attempt} forward: logits differ from the in-memory model's"
        assert state.stats.bytes > 0, "the policy moved no bytes although half the model is on disk"
    finally:
        state.remove()
    assert model.lm_head.weight is model.model.embed_tokens.weight, "remove() broke the tied embeddings"
    restored = model.state_dict()
    for name, value in reference.state_dict().items():
        assert restored[name].device.type != "meta", f"remove() left {name!r} on the meta device"
        assert torch.equal(restored[name], value), f"remove() gave back other values for {name!r}"


def check_policy_reservation(policy: Any) -> list[dict]:
    """What a policy holds back for its units in flight (its ``reserve``, or the default without one) is,
    for CPU and GPU runs and every store property, bytes (non-negative integers) per device, with an
    entry for the execution device; a GPU run keeps at least one block there. Returns the answers."""
    from offload_core.planning.reservation import InFlight

    # a name, or a policy as the registry takes it: a class written without the contract gets its default reserve
    reserve_of = _resolve("policy", policy).reserve
    answers = []
    for device in (torch.device("cpu"), torch.device("cuda", 1)):
        for converts in (False, True):
            for pinned in (False, True):
                need = InFlight(
                    device, block_bytes=3000, module_bytes=700, store_converts=converts, store_pinned=pinned
                )
                reserve = dict(reserve_of(need))
                where = f"{device} run, store_converts={converts}, store_pinned={pinned}"
                assert isinstance(reserve, dict), (
                    f"reserve() gave {type(reserve).__name__} for a {where}: return a dict"
                )
                for key, size in reserve.items():
                    assert key == "cpu" or (isinstance(key, int) and key >= 0), (
                        f"reserve() gave device {key!r} for a {where}"
                    )
                    assert isinstance(size, int) and size >= 0, (
                        f"reserve() gave {size!r} bytes on {key!r} for a {where}"
                    )
                main = budget_key(device)
                assert main in reserve, f"reserve() says nothing about the execution device {main!r} for a {where}"
                if device.type == "cuda":
                    assert reserve[main] >= min(need.block_bytes, need.module_bytes), (
                        f"reserve() holds {reserve[main]} bytes on the GPU for a {where}: "
                        "the unit that runs must fit there"
                    )
                answers.append(reserve)
    return answers


def _tiny_clip_tokenizer(directory: Path) -> Any:
    """A CLIP tokenizer over a 60-word vocabulary (its ``vocab.json`` and ``merges.txt`` written here)."""
    import json

    from transformers import CLIPTokenizer

    words = ["a", "photo", "of", "cat", "dog", "red", "blue", "the", "on", "in"]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for char in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    for word in words:
        vocab.setdefault(word + "</w>", len(vocab))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=16)


def tiny_pipeline(directory: str | Path, scheduler: str = "ddim") -> Any:
    """A seeded Stable Diffusion pipeline small enough for a test (UNet of 2 blocks of 8/16 channels, a 2-layer CLIP
    text encoder of width 32, an AutoencoderKL of 8/16 channels) saved to ``directory`` with diffusers'
    ``save_pretrained``; returns the in-memory pipeline. Needs the ``diffusion`` extra."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    directory = Path(directory)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        norm_num_groups=4,
        sample_size=16,
    )
    tokenizer = _tiny_clip_tokenizer(directory / "_tokenizer_source")
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=32,
    )
    text_encoder = CLIPTextModel(text_config)
    kinds = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}
    sched = (
        kinds[scheduler](beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False)
        if scheduler == "ddim"
        else kinds[scheduler](beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=sched,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(directory, safe_serialization=True)
    import shutil

    shutil.rmtree(directory / "_tokenizer_source")
    return pipe
