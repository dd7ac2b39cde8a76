"""`qfd serve` end to end: a real subprocess on loopback, talked to with the official `openai`
client (completion, chat, streaming, 16 concurrent clients, a disconnect, bad requests, key)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

KEY = "sk-test-qfd"
MAX_LEN = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw(port, method, path, body=None, key=KEY, timeout=30):
    """(status, parsed JSON or text) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, text


@pytest.fixture(scope="module")
def served(tiny_chat_checkpoints):
    path = tiny_chat_checkpoints["llama"]
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "qfd", "serve", "--target", str(path), "--port", str(port), "--device", "cpu", "--max-len", str(MAX_LEN), "--api-key", KEY, "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail("qfd serve exited: " + proc.stdout.read().decode()[-2000:])
        try:
            if raw(port, "GET", "/health", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("qfd serve did not come up in 120 s")
        time.sleep(0.25)
    yield {"port": port, "path": path}
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local_engine(served):
    """The same model in-process: what the server must answer, token for token (greedy)."""
    import torch

    from qfd.engine import Engine
    from qfd.models.loading import load_target, stop_token_ids
    from qfd.checkpoint import resolve_model

    torch.set_num_threads(1)
    target, tokenizer = load_target(served["path"])
    return Engine(target, tokenizer, max_len=MAX_LEN, eos_ids=stop_token_ids(resolve_model(served["path"]), tokenizer))


def expected_text(engine, prompt, n):
    from qfd.engine import GenerationConfig

    return engine.generate_text(prompt, GenerationConfig(max_new_tokens=n)).text


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert raw(served["port"], "GET", "/health")[1]["status"] == "ok"


def test_completion_equals_the_engine_and_streams_the_same_text(client, local_engine):
    prompt = "The capital of France is"
    want = expected_text(local_engine, prompt, 12)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens == len(local_engine.encode(prompt))
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == want and len(pieces) >= 2


def test_chat_and_chat_streaming(client, local_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    want = expected_text(local_engine, messages, 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_stop_string_is_honoured(client, local_engine):
    prompt = "Once upon a time"
    full = expected_text(local_engine, prompt, 24)
    stop = full[8:11]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)] and out.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_none_lost(served, local_engine):
    from openai import OpenAI

    prompts = [f"Story number {i}: the" for i in range(16)]
    results, errors = {}, []

    def ask(i):
        try:
            c = OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key=KEY, max_retries=0, timeout=120)
            if i % 2:
                results[i] = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0, stream=True) if ch.choices)
            else:
                results[i] = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0).choices[0].text
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and sorted(results) == list(range(16))
    for i in range(16):  # each client got the answer to ITS prompt
        assert results[i] == expected_text(local_engine, prompts[i], 8)


def _cancelled(port) -> float:
    text = raw(port, "GET", "/metrics")[1]
    line = next(l for l in text.splitlines() if l.startswith("qfd_requests_cancelled_total"))
    return float(line.split()[-1])


def test_client_disconnect_cancels_and_the_server_stays_healthy(served, client):
    port = served["port"]
    before = _cancelled(port)
    sock = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"model": "tiny", "prompt": "A long story:", "max_tokens": MAX_LEN - 10, "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    assert b"200" in sock.recv(200)  # the stream started
    sock.close()  # hang up mid-stream
    deadline = time.time() + 60
    while _cancelled(port) <= before:
        assert time.time() < deadline, "the disconnect was never counted as a cancellation"
        time.sleep(0.1)
    # a non-streaming request whose client vanishes while it waits is cancelled too
    sock = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"model": "tiny", "prompt": "Another long one:", "max_tokens": MAX_LEN - 10, "temperature": 0, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.3)
    sock.close()
    while _cancelled(port) <= before + 1:
        assert time.time() < deadline, "a closed non-streaming client was never cancelled"
        time.sleep(0.1)
    assert client.completions.create(model="tiny", prompt="Still alive?", max_tokens=3, temperature=0).choices[0].text is not None


@pytest.mark.parametrize(
    "path,body,code",
    [
        ("/v1/completions", b"{not json", "invalid_json"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, "model_not_found"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_LEN}, "context_length_exceeded"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, "invalid_type"),
        ("/v1/completions", {"model": "tiny", "prompt": 42}, "invalid_type"),
        ("/v1/completions", {"model": "tiny"}, "missing_required_parameter"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "invalid_value"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, "invalid_value"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "invalid_type"),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, "invalid_value"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "invalid_type"),
        ("/v1/completions", [1, 2], "invalid_json"),
    ],
)
def test_bad_requests_get_openai_errors(served, path, body, code):
    status, payload = raw(served["port"], "POST", path, body)
    assert status == 400, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["code"] == code
    assert raw(served["port"], "GET", "/health")[0] == 200  # and the server is still up


def test_openai_client_sees_bad_request_and_auth_errors(served, client):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert raw(served["port"], "GET", "/v1/models", key=None)[0] == 401


def test_metrics_are_prometheus_text(served, client):
    client.completions.create(model="tiny", prompt="count", max_tokens=4, temperature=0)
    status, text = raw(served["port"], "GET", "/metrics")
    assert status == 200
    for name in ("qfd_requests_total", "qfd_generation_tokens_total", "qfd_request_latency_seconds_bucket", "qfd_time_to_first_token_seconds_count", "qfd_tau_bucket"):
        assert name in text
    generated = next(float(l.split()[-1]) for l in text.splitlines() if l.startswith("qfd_generation_tokens_total"))
    assert generated >= 4
    assert 'qfd_requests_total{endpoint="/v1/completions",code="400"}' in text or "code=\"200\"" in text


def test_serve_refuses_a_drafter_pinned_to_another_target(tiny_chat_checkpoints, tmp_path):
    import torch

    from qfd.checkpoint import read_json
    from qfd.errors import QfdError
    from qfd.manifest import write_manifest
    from qfd.models.drafter import DFlashDrafter, config_for_target, save_drafter
    from qfd.stages.serve import ServeConfig, build

    target, other = tiny_chat_checkpoints["llama"], tiny_chat_checkpoints["qwen3"]
    drafter_dir = tmp_path / "drafter"
    save_drafter(DFlashDrafter(config_for_target(read_json(target / "config.json"), num_layers=1, block_size=4, intermediate_size=64)), drafter_dir, torch.float32)
    write_manifest(drafter_dir, stage="test", parents={"target": other})  # pinned to ANOTHER target
    with pytest.raises(QfdError, match="trained against target"):
        build(ServeConfig(target=str(target), drafter=str(drafter_dir), port=0, device="cpu"))
    with pytest.warns(UserWarning, match="trained against target"):
        server = build(ServeConfig(target=str(target), drafter=str(drafter_dir), port=0, device="cpu", allow_target_mismatch=True, max_len=64))
    try:
        assert server.app.engine.drafter is not None and server.server_address[0] == "127.0.0.1"
    finally:
        server.app.worker.stop()
        server.server_close()
