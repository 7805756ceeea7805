"""Tasks and the one-call API: the task a checkpoint's config names, ``from_pretrained`` returning the right class with
``hf_device_map`` and logits equal to transformers' own load, its reservation leaving room on the cpu tier, and the
one-line errors for an unknown architecture or a task that does not fit."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from offload_core import OffloadError, from_pretrained, init_empty_weights, load_checkpoint_and_dispatch
from offload_core.loading.tasks import TASKS, auto_class, infer_task
from offload_core.planning import compute_module_sizes

from tests.checkpoints import minilm_folder


@pytest.mark.parametrize(
    "model_type,architecture,task",
    [
        ("llama", "LlamaForCausalLM", "causal_lm"),
        ("gpt2", "GPT2LMHeadModel", "causal_lm"),
        ("mixtral", "MixtralForCausalLM", "causal_lm"),
        ("t5", "T5ForConditionalGeneration", "seq2seq_lm"),
        ("bert", "BertForMaskedLM", "masked_lm"),
        ("bert", "BertForSequenceClassification", "sequence_classification"),
        ("bert", "BertModel", "embeddings"),
    ],
)
def test_task_follows_config_architectures(model_type, architecture, task):
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture])
    assert infer_task(config) == task
    assert auto_class(task).__name__ == TASKS[task][0]


def test_task_without_architectures_follows_model_type():
    assert infer_task(transformers.LlamaConfig()) == "causal_lm"
    assert infer_task(transformers.T5Config()) == "seq2seq_lm"


# Mixtral's per-expert tensors are assembled in place (copies where they would start misaligned): the budget (of its
# 0.35 MiB) holds the blocks' copies in flight too.
@pytest.mark.parametrize(
    "name,cls,budget",
    [
        ("t5", "T5ForConditionalGeneration", "60KiB"),
        ("bert", "BertForMaskedLM", "60KiB"),
        ("mixtral", "MixtralForCausalLM", "340KiB"),
    ],
)
def test_from_pretrained_returns_the_checkpoints_class_with_equal_logits(saved, name, cls, budget, tmp_path):
    model_saved = saved(name)
    model = from_pretrained(
        model_saved.path,
        offload={
            "offload_folder": tmp_path / "off",
            "execution_device": "cpu",
            "storage": "safetensors",
            "policy": "prefetch",
            "headroom": 0,
        },
        max_memory={"cpu": budget},
    )
    assert type(model).__name__ == cls
    assert {"cpu", "disk"} <= set(model.hf_device_map.values()), model.hf_device_map
    with torch.no_grad():
        got = model(**model_saved.inputs).logits
    model.offload_state.remove()
    assert torch.equal(got, model_saved.expected), (got - model_saved.expected).abs().max()


def test_from_pretrained_seq2seq_generates_as_in_memory(saved, tmp_path):
    t5 = saved("t5")
    model = from_pretrained(
        t5.path,
        offload={"offload_folder": tmp_path / "off", "execution_device": "cpu", "headroom": 0},
        max_memory={"cpu": "60KiB"},
    )
    reference = t5.auto.from_pretrained(t5.path).eval()
    ids = t5.inputs["input_ids"][:1]
    kwargs = dict(max_new_tokens=4, do_sample=False, decoder_start_token_id=0)
    with torch.no_grad():
        assert model.generate(ids, **kwargs).tolist() == reference.generate(ids, **kwargs).tolist()
    model.offload_state.remove()


def test_from_pretrained_reserves_as_the_runner_so_an_embedding_leaves_room_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = minilm_folder()
    with init_empty_weights():
        empty = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(folder))
    half = {"cpu": compute_module_sizes(empty)[""] // 2}
    # the placement's own rule would hold back the largest unit (the word embedding) on cpu, leaving nothing else
    # room there; a placement name given to load_checkpoint_and_dispatch holds back what the policy keeps in flight
    load_checkpoint_and_dispatch(
        empty,
        folder,
        device_map="sequential",
        max_memory=half,
        offload_folder=tmp_path / "a",
        execution_device="cpu",
        progress=False,
        headroom=0,
    )
    assert {"cpu", "disk"} <= set(empty.hf_device_map.values()), empty.hf_device_map
    empty.offload_state.remove()
    model = from_pretrained(
        folder, offload={"offload_folder": tmp_path / "b", "execution_device": "cpu", "headroom": 0}, max_memory=half
    )
    assert type(model).__name__ == "BertModel"
    assert model.hf_device_map == empty.hf_device_map
    model.offload_state.remove()


def test_unknown_architecture_is_one_line_naming_model_type(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "brand_new_arch", "architectures": ["BrandNewForCausalLM"]})
    )
    with pytest.raises(OffloadError) as caught:
        from_pretrained(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "'brand_new_arch'" in message and "upgrade transformers" in message


def test_task_without_a_model_for_the_checkpoint_is_one_line_naming_it(saved, tmp_path):
    with pytest.raises(OffloadError) as caught:
        from_pretrained(saved("bert").path, offload={"offload_folder": tmp_path}, task="seq2seq_lm")
    message = str(caught.value)
    assert "\n" not in message and "task='seq2seq_lm'" in message and "task=masked_lm" in message


def test_task_whose_head_the_checkpoint_lacks_is_one_line_naming_it(saved, tmp_path):
    with pytest.raises(OffloadError) as caught:
        from_pretrained(saved("bert").path, offload={"offload_folder": tmp_path}, task="sequence_classification")
    message = str(caught.value)
    assert "\n" not in message and "task='sequence_classification'" in message and "lacks" in message


def test_unknown_task_lists_the_tasks(saved):
    with pytest.raises(OffloadError, match="is not a task: use one of causal_lm"):
        from_pretrained(saved("bert").path, task="translation")
