"""``run.py model=local model.path=<folder>`` for every kind of model: a T5 generates, a BERT fills in tokens, a Mixtral
(per-expert tensors as transformers saves them) generates, MiniLM embeds several texts; each offloads to disk and
matches the in-memory model, a T5 also over a prompts file in batches; a task that does not fit, an unknown
architecture and prompts given to a task that reads texts end in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.end_to_end.helpers import assert_one_line, cli
from tests.checkpoints import TINY, minilm_folder

#: a budget below the tiny models' blocks (units in flight run over it, warned): most of each on disk
BUDGET = ["max_memory.cpu=60KiB", "headroom=1KiB", "over_budget=warn", "compare_in_memory=true", "max_new_tokens=4"]


def run_metrics(tmp_path) -> dict:
    return json.loads((tmp_path / "hydra" / "metrics.json").read_text())


@pytest.mark.parametrize("name,task", [("t5", "seq2seq_lm"), ("bert", "masked_lm"), ("mixtral", "causal_lm")])
def test_local_folder_of_each_kind_runs_offloaded_and_matches_in_memory(saved, name, task, tmp_path, capsys):
    code, err = cli(
        ["model=local", f"model.path={saved(name).path}", "model.tokenizer=bytes", *BUDGET], tmp_path, capsys
    )
    assert code == 0, err
    metrics = run_metrics(tmp_path)
    assert metrics["matches_in_memory"] is True
    assert metrics["devices"]["disk"]["bytes"] > 0
    if task == "masked_lm":
        assert metrics["task"] == "masked_lm" and len(metrics["predicted_token_ids"]) == 1
        assert load_file(str(tmp_path / "hydra" / "logits.safetensors"))["logits"].shape[0] == 1
    else:
        assert len(metrics["token_ids"]) == 4


def test_sequence_classification_labels_each_text_as_in_memory(tmp_path, capsys):
    config = transformers.BertConfig(
        **TINY,
        max_position_embeddings=64,
        num_labels=3,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
        label2id={"negative": 0, "neutral": 1, "positive": 2},
    )
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "cls", max_shard_size="20KB")
    code, err = cli(
        ["model=local", f"model.path={tmp_path / 'cls'}", "model.tokenizer=bytes", *BUDGET, "texts=[good,bad,so so]"],
        tmp_path,
        capsys,
    )
    assert code == 0, err
    metrics = run_metrics(tmp_path)
    assert metrics["task"] == "sequence_classification" and metrics["matches_in_memory"] is True
    assert len(metrics["labels"]) == 3 and set(metrics["labels"]) <= {"negative", "neutral", "positive"}
    assert metrics["devices"]["disk"]["bytes"] > 0


def test_embeddings_of_several_texts_print_and_write_cosines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = "texts=[the cat sits on the mat,a cat is sitting on a mat,stock markets fell sharply]"
    code, err = cli(
        [
            "model=local",
            f"model.path={minilm_folder()}",
            "max_memory.cpu=40MiB",
            "headroom=1KiB",
            "compare_in_memory=true",
            texts,
        ],
        tmp_path,
        capsys,
    )
    assert code == 0, err
    metrics = run_metrics(tmp_path)
    assert metrics["matches_in_memory"] is True and metrics["embedding_shape"] == [3, 384]
    cosine = metrics["cosine_similarities"]
    assert cosine[0][1] > 0.8 > 0.3 > cosine[0][2]  # the two sentences about a cat are close, the third is not
    assert load_file(str(tmp_path / "hydra" / "embeddings.safetensors"))["embeddings"].shape == (3, 384)


def test_task_that_does_not_fit_is_one_line_naming_it(saved, tmp_path, capsys):
    code, err = cli(
        ["model=local", f"model.path={saved('bert').path}", "model.task=sequence_classification"], tmp_path, capsys
    )
    assert code == 2
    assert_one_line(err, "model.task='sequence_classification' does not fit", "model.task=masked_lm")
    code, err = cli(["model=local", f"model.path={saved('bert').path}", "model.task=seq2seq_lm"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "model.task='seq2seq_lm' does not fit", "AutoModelForSeq2SeqLM")


def test_unknown_architecture_is_one_line_naming_model_type(tmp_path, capsys):
    folder = tmp_path / "new"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "brand_new_arch"}))
    code, err = cli(["model=local", f"model.path={folder}"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "model_type 'brand_new_arch'", "upgrade transformers")


def test_texts_on_a_generating_run_is_one_line(saved, tmp_path, capsys):
    code, err = cli(["model=local", f"model.path={saved('t5').path}", "texts=[a,b]"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "texts is read by", "set prompt=")


def test_prompts_on_a_run_that_reads_texts_is_one_line(saved, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    code, err = cli(["model=local", f"model.path={saved('bert').path}", f"prompts={prompts}"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "prompts is read by", "set texts=")


def test_a_seq2seq_model_generates_a_prompts_file_in_batches_as_in_memory(saved, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a short one\nthe longest prompt of the three\nmid length\n")
    code, err = cli(
        [
            "model=local",
            "model.tokenizer=bytes",
            f"model.path={saved('t5').path}",
            f"prompts={prompts}",
            "batch_size=2",
            "max_memory.cpu=300KiB",
            "compare_in_memory=true",
            "max_new_tokens=4",
        ],
        tmp_path,
        capsys,
    )
    assert code == 0, err
    metrics = run_metrics(tmp_path)
    assert metrics["matches_in_memory"] is True and metrics["devices"]["disk"]["bytes"] > 0
    rows = [json.loads(line) for line in (tmp_path / "hydra" / "generations.jsonl").read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [4, 4, 4]
