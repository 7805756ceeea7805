"""Models offloaded in one process and used in turn (a target and its draft) share no state: each generates, round
after round, the scores its in-memory twin generates, bit for bit."""

from __future__ import annotations

import torch

import offload_core

NAMES = ["llama", "qwen2", "gpt2"]


def _generate(model, ids):
    out = model.generate(
        ids, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0
    )
    return out.sequences, torch.stack(out.scores)


def test_three_prefetch_models_used_in_turn_generate_as_in_memory(saved, tmp_path):
    sources = {name: saved(name) for name in NAMES}
    ids = sources["llama"].inputs["input_ids"][:1]
    expected = {name: _generate(s.auto.from_pretrained(s.path).eval(), ids) for name, s in sources.items()}
    models = {
        name: offload_core.from_pretrained(
            s.path,
            offload={"policy": "prefetch", "storage": storage, "offload_folder": tmp_path / name, "headroom": 0},
            max_memory={"cpu": "60KiB"},
        )
        for (name, s), storage in zip(sources.items(), ["safetensors", "memmap", "safetensors"])
    }
    try:
        for name, model in models.items():
            assert {"cpu", "disk"} <= set(model.hf_device_map.values()), (name, model.hf_device_map)
        for round_ in range(2):
            for name, model in models.items():
                tokens, scores = _generate(model, ids)
                assert torch.equal(tokens, expected[name][0]), (round_, name)
                assert torch.equal(scores, expected[name][1]), (round_, name, (scores - expected[name][1]).abs().max())
    finally:
        for model in models.values():
            model.offload_state.remove()
