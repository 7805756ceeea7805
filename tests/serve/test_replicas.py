"""``serve.replicas``: copies of the server behind Ray Serve's proxy on a local Ray cluster, each loading its own
offloaded model, started by one command; concurrent requests get the in-memory model's tokens whichever replica
answers, SIGTERM stops every replica and the command exits 0 with their figures summed. Bad values are one line."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest
import torch
import transformers

from offload_core.errors import ConfigError
from tests.serve.server import call, start_server, stop_server
from tests.serve.tiny import save_tiny_chat_model

pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.mark.slow  # a local Ray cluster and two replicas: about a minute on two cores
def test_two_replicas_answer_as_the_in_memory_model_and_stop_on_sigterm(tiny, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompts = [f"request {i}: tell me" for i in range(6)]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        expected.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    token = Path.home() / ".ray" / "auth_token"  # Ray writes one for a new local cluster unless told otherwise
    before = token.stat().st_mtime_ns if token.exists() else None
    proc, url = start_server(tiny, tmp_path, "serve.replicas=2", "serve.model_name=tiny", "serve.exact=true")
    try:
        assert "2 replicas behind Ray Serve" in proc.printed.wait_for("serving ", 1)

        def complete(prompt: str) -> str:
            status, answer = call(
                url, "POST", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
            )
            assert status == 200, answer
            return answer["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(complete, prompts)) == expected
        status, models = call(url, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    finally:
        code, printed, err = stop_server(proc, timeout=120)
    assert code == 0, err[-3000:]
    # six completions and the list of models, answered by the two replicas between them
    assert "served 7 requests over 2 replicas" in printed, printed[-2000:]
    figures = json.loads((tmp_path / "metrics.json").read_text())
    assert figures["replicas"] == 2 and figures["requests"] == 7 and figures["generated_tokens"] == 48
    replicas = [json.loads(p.read_text()) for p in tmp_path.glob("replica-*/metrics.json")]
    assert len(replicas) == 2 and sum(r["requests"] for r in replicas) == 7
    assert (token.stat().st_mtime_ns if token.exists() else None) == before  # the user's Ray token left as it was


@pytest.mark.parametrize(
    "key,value,message",
    [("replicas", 0, "serve.replicas=0 must be at least 1"), ("replica_cpus", -1, "serve.replica_cpus=-1")],
)
def test_bad_replica_settings_are_one_line(key, value, message):
    from offload_core.serve.options import read_options

    with pytest.raises(ConfigError, match=message):
        read_options({key: value})


def test_one_replica_without_a_cluster_serves_in_process():
    from offload_core.serve.options import read_options

    assert not read_options({}).replicated and not read_options({"replicas": 1}).replicated
    assert read_options({"replicas": 2}).replicated and read_options({"ray_address": "auto"}).replicated


def test_the_command_sums_the_figures_of_this_runs_replicas_only(tmp_path):
    import os
    import time

    from offload_core.serve.replicas import replica_figures

    for name, requests in [("old", 5), ("a", 2), ("b", 3)]:
        (tmp_path / f"replica-{name}").mkdir()
        (tmp_path / f"replica-{name}" / "metrics.json").write_text(json.dumps({"requests": requests}))
    (tmp_path / "replica-broken").mkdir()
    (tmp_path / "replica-broken" / "metrics.json").write_text("{")
    started = time.time() - 1
    os.utime(tmp_path / "replica-old" / "metrics.json", (started - 60, started - 60))  # an earlier run's
    figures = replica_figures(tmp_path, since=started)
    assert figures["replicas"] == 2 and figures["requests"] == 5 and figures["per_replica_requests"] == 2.5
