"""``python run.py mode=serve`` as a process on a tiny offloaded model, called by the official ``openai`` client
(streaming and not) and by plain HTTP: greedy answers equal transformers' in memory, concurrent requests share passes,
a client that goes away frees its slot, malformed requests get one 400/404 line, a wrong key 401."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
import transformers

from tests.serve.server import call, metric, start_server, stop_server, wait_until
from tests.serve.tiny import save_tiny_chat_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """A server of the tiny model (every weight on disk), two requests at once, behind an API key."""
    proc, url = start_server(
        model_dir,
        tmp_path_factory.mktemp("serve_run"),
        "serve.max_batch=2",
        "serve.context=96",
        f"serve.api_key={KEY}",
        "serve.model_name=tiny",
    )
    yield url
    code, out, err = stop_server(proc)
    assert code == 0, err[-2000:]
    assert "served " in out


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def in_memory_text(model_dir, messages, tokens: int) -> tuple[str, int]:
    """The text transformers' in-memory model generates greedily for ``messages``, and its token count."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


def test_greedy_chat_equals_transformers_in_memory_streamed_or_not(client, model_dir):
    expected, count = in_memory_text(model_dir, QUESTION, 20)
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens == count
    assert whole.choices[0].finish_reason == ("length" if count == 20 else "stop")
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=QUESTION,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == count


def test_logprobs_as_the_openai_client_reads_them(client, model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answer = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    new = [t for t in out[0, ids.shape[1] :].tolist() if t != tok.eos_token_id]
    with torch.inference_mode():
        expected = torch.log_softmax(model(out).logits[0, ids.shape[1] - 1 : -1].float(), dim=-1)
    assert [c.token for c in content] == [tok.decode([t]) for t in new]
    for row, (item, token) in enumerate(zip(content, new)):
        assert item.logprob == pytest.approx(float(expected[row, token]), abs=1e-4)
        assert item.bytes == list(item.token.encode())
        assert [t.token for t in item.top_logprobs] == [tok.decode([i]) for i in expected[row].topk(2).indices]
    streamed = client.completions.create(model="tiny", prompt="Paris is", max_tokens=5, logprobs=1, stream=True)
    tokens = [
        t for chunk in streamed if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens
    ]
    whole = client.completions.create(model="tiny", prompt="Paris is", max_tokens=5, logprobs=1, temperature=0)
    assert len(whole.choices[0].logprobs.token_logprobs) == len(whole.choices[0].logprobs.top_logprobs)
    assert whole.choices[0].logprobs.text_offset[0] == 0
    plain = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    assert tokens  # a stream carries each token's log-probability in the chunk that made it


def test_completions_models_and_health(client, server):
    done = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.prompt_tokens > 0
    streamed = client.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert call(server, "GET", "/health") == (200, {"status": "ok", "model": "tiny"})


def test_concurrent_requests_share_passes(client, server):
    before_passes = metric(server, "offload_core_serve_forward_passes_total", KEY)
    before_tokens = metric(server, "offload_core_serve_generated_tokens_total", KEY)
    answers: list = []

    def ask(i: int) -> None:
        question = [{"role": "user", "content": f"Question {i}: what is the capital of France?"}]
        answers.append(client.chat.completions.create(model="tiny", messages=question, max_tokens=30, temperature=0))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(answers) == 4 and all(a.choices[0].finish_reason in ("length", "stop") for a in answers)
    tokens = metric(server, "offload_core_serve_generated_tokens_total", KEY) - before_tokens
    passes = metric(server, "offload_core_serve_forward_passes_total", KEY) - before_passes
    assert tokens == sum(a.usage.completion_tokens for a in answers)
    assert passes < tokens  # with two slots, most passes made two tokens


def test_a_client_that_goes_away_frees_its_slot(client, server):
    host, port = server.split("//")[1].split(":")
    before = metric(server, "offload_core_serve_generated_tokens_total", KEY)
    body = (
        '{"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 80, "temperature": 0, "stream": true}'
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        for _ in range(100):  # the headers, then the first event
            received += sock.recv(4096)
            if b"data: " in received:
                break
        assert b"data: " in received
    assert wait_until(lambda: metric(server, "offload_core_serve_requests_active", KEY) == 0, timeout=30)
    generated = metric(server, "offload_core_serve_generated_tokens_total", KEY) - before
    print(f"generated {generated} of 80 tokens before the disconnect was seen")
    assert generated < 80
    again = client.completions.create(model="tiny", prompt="The quick", max_tokens=3, temperature=0)
    assert again.choices[0].text is not None


@pytest.mark.parametrize(
    "body, status, says",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "not an object"),
        ({"model": "tiny", "messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny", "messages": "hello"}, 400, "messages"),
        ({"model": "tiny", "messages": QUESTION, "n": 2}, 400, "n=2"),
        ({"model": "tiny", "messages": QUESTION, "max_tokens": 400}, 400, "max_tokens=400"),
        ({"model": "tiny", "messages": QUESTION, "top_logprobs": 2}, 400, "needs logprobs=true"),
        ({"model": "tiny", "messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"model": "tiny", "prompt": "Paris is", "logprobs": 6}, 400, "logprobs"),
        ({"model": "gpt-4", "messages": QUESTION}, 404, "'gpt-4' does not exist"),
    ],
)
def test_malformed_requests_get_one_clear_error(server, body, status, says):
    got, answer = call(server, "POST", "/v1/chat/completions", body, key=KEY)
    assert got == status
    assert says in answer["error"]["message"] and "\n" not in answer["error"]["message"]
    assert answer["error"]["type"]


def test_the_api_key_is_checked_on_every_route_but_health(server, client):
    assert call(server, "GET", "/v1/models")[0] == 401
    assert call(server, "GET", "/metrics", key="wrong")[0] == 401
    assert call(server, "GET", "/health")[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=QUESTION)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_prompt_that_fills_the_context_names_the_field_it_came_in(server):
    long = "Paris is " * 80  # past serve.context=96
    for route, body, field in (
        ("/v1/completions", {"model": "tiny", "prompt": long}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": long}]}, "messages"),
    ):
        got, answer = call(server, "POST", route, body, key=KEY)
        assert got == 400 and "fills the context of 96 tokens" in answer["error"]["message"]
        assert answer["error"]["param"] == field, route
    got, answer = call(server, "POST", "/v1/completions", {"model": "tiny", "prompt": [1, 2, 99999]}, key=KEY)
    assert got == 400 and answer["error"]["param"] == "prompt"  # it was prompt.str, a member of the union
    assert "give the prompt as text (a string); token ids are not read here" in answer["error"]["message"]
