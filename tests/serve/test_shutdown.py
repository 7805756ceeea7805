"""``offload-core serve`` with ``serve.exact=true``: concurrent greedy requests each get the tokens transformers gives
them alone; SIGTERM stops admitting, lets the request in flight finish, writes metrics.json and exits 0."""

from __future__ import annotations

import json
import threading

import pytest

from tests.serve.server import OFFLOAD_CORE_SERVE, call, start_server, stop_server
from tests.serve.test_server import in_memory_text
from tests.serve.tiny import save_tiny_chat_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_exact_requests_equal_alone_and_sigterm_lets_them_finish(tmp_path):
    model_dir = save_tiny_chat_model(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    proc, url = start_server(
        model_dir,
        run_dir,
        "serve.exact=true",
        "serve.max_batch=3",
        "serve.context=96",
        "serve.shutdown_timeout=60",
        door=OFFLOAD_CORE_SERVE,
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        questions = [[{"role": "user", "content": f"Say {word}."}] for word in ("Paris", "fox", "dog")]
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            stream = client.chat.completions.create(
                model="tiny", messages=questions[i], max_tokens=24, temperature=0, stream=True
            )
            answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert answers == {i: in_memory_text(model_dir, q, 24)[0] for i, q in enumerate(questions)}

        long = client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=80, temperature=0, stream=True
        )
        first = next(iter(long))
        proc.terminate()  # SIGTERM while it generates
        rest = list(long)
        assert (rest or [first])[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        code, out, err = stop_server(proc)
    assert code == 0, err[-2000:]
    assert "stopping: no new requests; 1 generating finish" in out and "served " in out
    assert "Traceback" not in err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["mode"] == "serve" and metrics["generated_tokens"] > 0
    with pytest.raises(OSError):
        call(url, "GET", "/health")


def test_ctrl_c_stops_an_idle_server_with_exit_code_0(tmp_path):
    import signal

    proc, url = start_server(save_tiny_chat_model(tmp_path / "tiny"), tmp_path / "run", "serve.context=64")
    assert call(url, "GET", "/health")[0] == 200
    proc.send_signal(signal.SIGINT)
    code, out, err = stop_server(proc)
    assert code == 0, err[-2000:]
    assert "stopping: no new requests; 0 generating" in out and "served 0 requests" in out
    assert "Traceback" not in err and "interrupted" not in err
