"""OpenAI-compatible HTTP server over one Engine (stdlib http.server, no extra dependencies).

Endpoints: POST /v1/completions, POST /v1/chat/completions (non-streaming JSON, or server-sent
events `data: {...}\\n\\n` ending with `data: [DONE]`), GET /v1/models, /health, /metrics
(Prometheus text). One engine worker thread takes requests from a FIFO queue, so concurrent
clients are served in arrival order; HTTP threads only parse, wait and write. A client that
disconnects (a failed stream write, or its socket closing while the request is queued or
generating) cancels its generation. Bad requests get OpenAI-style error JSON
{"error": {"message", "type", "param", "code"}} with status 400 (401 for a wrong API key).
"""

from __future__ import annotations

import hmac
import json
import queue
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from qfd.engine import Cancelled, Engine, GenerationConfig
from qfd.errors import QfdError
from qfd.metrics import ServerMetrics

MAX_BODY = 16 << 20
DEFAULT_MAX_TOKENS = 256
ROLES = ("system", "user", "assistant", "developer", "tool")


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Job:
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool
    created: float = field(default_factory=time.perf_counter)
    chunks: "queue.Queue[tuple[str, Any]]" = field(default_factory=queue.Queue)  # ("text", s) | ("done", result) | ("error", msg)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float | None = None


class EngineWorker:
    """The single thread that runs the engine, FIFO over all clients."""

    def __init__(self, engine: Engine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics
        self.jobs: "queue.Queue[Job | None]" = queue.Queue()
        self.thread = threading.Thread(target=self.loop, name="qfd-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)
        self.metrics.queue.set(self.jobs.qsize())

    def loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.metrics.queue.set(self.jobs.qsize())
            if job.cancelled.is_set():
                self.metrics.cancelled.inc()
                job.chunks.put(("cancelled", None))
                continue
            job.started = time.perf_counter()
            self.metrics.running.set(1)
            try:
                on_tokens = (lambda ids, text: job.chunks.put(("text", text)) if text else None) if job.stream else None
                result = self.engine.generate(job.prompt_ids, job.config, on_tokens=on_tokens, cancel=job.cancelled.is_set)
                if result.stats.finish_reason == "cancelled":
                    self.metrics.cancelled.inc()
                self.metrics.record_generation(result.stats, job.started - job.created)
                job.chunks.put(("done", result))
            except (QfdError, Cancelled) as exc:
                job.chunks.put(("error", ApiError(str(exc))))
            except Exception as exc:  # never kill the worker: report and serve the next request
                job.chunks.put(("error", ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")))
            finally:
                self.metrics.running.set(0)

    def stop(self) -> None:
        self.jobs.put(None)


class App:
    """What the handlers share: engine worker, tokenizer, model name, key, metrics."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None):
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, engine.tokenizer, model_name, api_key
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(engine, self.metrics)
        self.created = int(time.time())

    # --- request validation -------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError("'model' must be a string", "model", "invalid_type")
        if model not in (None, "", self.model_name):
            raise ApiError(f"The model '{model}' does not exist; this server serves '{self.model_name}'", "model", "model_not_found")

    def generation_config(self, body: dict, prompt_len: int, chat: bool) -> GenerationConfig:
        def number(name, default, lo=None, hi=None, integer=False):
            value = body.get(name, default)
            if value is None:
                return default
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok:
                raise ApiError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}", name, "invalid_type")
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise ApiError(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", name, "invalid_value")
            return value

        room = self.engine.max_len - prompt_len
        if room < 1:
            raise ApiError(f"This model's maximum context length is {self.engine.max_len} tokens; the prompt has {prompt_len} tokens", "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = number(name, min(DEFAULT_MAX_TOKENS, room), lo=1, integer=True)
        if prompt_len + max_tokens > self.engine.max_len:
            raise ApiError(f"This model's maximum context length is {self.engine.max_len} tokens; you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)", name, "context_length_exceeded")
        n = number("n", 1, lo=1, integer=True)
        if n != 1:
            raise ApiError("only n = 1 is supported", "n", "invalid_value")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ApiError("'stop' must be a string or a list of strings", "stop", "invalid_type")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("'stream' must be a boolean", "stream", "invalid_type")
        top_k = number("top_k", 0, lo=-1, integer=True)
        return GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=float(number("temperature", 1.0, lo=0, hi=2)),
            top_p=float(number("top_p", 1.0, lo=1e-9, hi=1)),
            top_k=max(0, top_k),  # -1 (vLLM's "off") == 0
            stop=stop,
            seed=number("seed", None, integer=True),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError("'prompt' is empty", "prompt", "invalid_value")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.target.config.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ApiError(f"token ids must be in [0, {vocab})", "prompt", "invalid_value")
            return list(prompt)
        if prompt is None:
            raise ApiError("'prompt' is required", "prompt", "missing_required_parameter")
        raise ApiError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt", "invalid_type")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if messages is None:
            raise ApiError("'messages' is required", "messages", "missing_required_parameter")
        if not isinstance(messages, list) or not messages:
            raise ApiError("'messages' must be a non-empty list", "messages", "invalid_value")
        clean = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ApiError(f"messages[{i}] must be an object with a role in {list(ROLES)}", f"messages[{i}]", "invalid_value")
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise ApiError(f"messages[{i}].content parts must be text parts", f"messages[{i}].content", "invalid_value")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(f"messages[{i}].content must be a string", f"messages[{i}].content", "invalid_type")
            clean.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
        try:
            return self.engine.encode(clean, chat=True, chat_template_kwargs=kwargs)
        except QfdError as exc:
            raise ApiError(str(exc), "messages") from None
        except Exception as exc:  # a template that raises on these messages (e.g. role order)
            raise ApiError(f"the chat template rejected these messages: {exc}", "messages", "invalid_value") from None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "qfd"
    app: App  # set on the subclass by make_server

    def log_message(self, format, *args):  # quiet: metrics count requests
        pass

    # --- plumbing ----------------------------------------------------------------------------
    def send_json(self, status: int, payload: dict, endpoint: str) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.app.metrics.requests.inc(1, endpoint, str(status))

    def send_error_json(self, error: ApiError, endpoint: str) -> None:
        self.send_json(error.status, error.body(), endpoint)

    def authorized(self) -> bool:
        key = self.app.api_key
        if not key:
            return True
        header = self.headers.get("Authorization", "")
        return hmac.compare_digest(header.encode(), f"Bearer {key}".encode())

    def client_gone(self) -> bool:
        """True when the client closed its socket (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # --- routes ------------------------------------------------------------------------------
    def do_GET(self):
        path = self.path.split("?")[0]
        if not self.authorized():
            return self.send_error_json(ApiError("Incorrect API key provided", None, "invalid_api_key", 401), path)
        if path == "/health":
            return self.send_json(200, {"status": "ok", "model": self.app.model_name}, path)
        if path == "/v1/models":
            model = {"id": self.app.model_name, "object": "model", "created": self.app.created, "owned_by": "qfd", "max_model_len": self.app.engine.max_len}
            return self.send_json(200, {"object": "list", "data": [model]}, path)
        if path == "/metrics":
            self.app.metrics.requests.inc(1, path, "200")
            data = self.app.metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_error_json(ApiError(f"no route GET {path}", None, "not_found", 404), "other")

    def do_POST(self):
        path = self.path.split("?")[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self.read_body_or_error(path)
            return self.send_error_json(ApiError(f"no route POST {path}", None, "not_found", 404), "other")
        try:
            body = self.read_body_or_error(path)
            if not self.authorized():
                raise ApiError("Incorrect API key provided", None, "invalid_api_key", 401)
            chat = path == "/v1/chat/completions"
            self.app.check_model(body)
            ids = self.app.chat_prompt(body) if chat else self.app.completion_prompt(body)
            config = self.app.generation_config(body, len(ids), chat)
        except ApiError as error:
            return self.send_error_json(error, path)
        job = Job(ids, config, stream=bool(body.get("stream")))
        self._request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if isinstance(body.get("stream_options"), dict) else False
        self.app.worker.submit(job)
        try:
            if job.stream:
                self.stream_response(job, chat, path, include_usage)
            else:
                self.plain_response(job, chat, path)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, socket.timeout):
            job.cancelled.set()
            self.close_connection = True

    def read_body_or_error(self, path: str) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError("the request needs a Content-Length header and a JSON body", None, "invalid_request")
        if int(length) > MAX_BODY:
            self.close_connection = True
            raise ApiError(f"request body over {MAX_BODY} bytes", None, "invalid_request")
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"We could not parse the JSON body of your request ({exc})", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError("the JSON body must be an object", None, "invalid_json")
        return body

    def wait(self, job: Job):
        """Next (kind, value) from the job, cancelling it if the client goes away meanwhile."""
        while True:
            try:
                return job.chunks.get(timeout=0.05)
            except queue.Empty:
                if self.client_gone():
                    job.cancelled.set()
                    raise ConnectionResetError("client closed the connection")

    def plain_response(self, job: Job, chat: bool, path: str) -> None:
        kind, value = self.wait(job)
        if kind == "error":
            return self.send_error_json(value, path)
        if kind == "cancelled" or value.stats.finish_reason == "cancelled":
            raise ConnectionResetError
        result = value
        finish = "length" if result.stats.finish_reason == "length" else "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        payload = self.envelope(chat, stream=False)
        payload.update(choices=[choice], usage=usage(result), qfd=stats_json(result))
        self.send_json(200, payload, path)

    def envelope(self, chat: bool, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        return {"id": self._request_id, "object": kind, "created": int(time.time()), "model": self.app.model_name}

    def stream_response(self, job: Job, chat: bool, path: str, include_usage: bool) -> None:
        kind, value = self.wait(job)
        if kind == "error":  # failed before the first token: a plain error response
            return self.send_error_json(value, path)
        if kind == "cancelled":
            raise ConnectionResetError
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.app.metrics.requests.inc(1, path, "200")
        if chat:
            self.send_event(self.chunk(chat, {"role": "assistant", "content": ""}, None))
        while True:
            if kind == "text":
                self.send_event(self.chunk(chat, value, None))
            elif kind == "done":
                if value.stats.finish_reason == "cancelled":
                    raise ConnectionResetError
                finish = "length" if value.stats.finish_reason == "length" else "stop"
                self.send_event(self.chunk(chat, {} if chat else "", finish))
                if include_usage:
                    final = self.envelope(chat, stream=True)
                    final.update(choices=[], usage=usage(value), qfd=stats_json(value))
                    self.send_event(final)
                break
            elif kind == "error":
                self.send_event(value.body())
                break
            kind, value = self.wait(job)
        self.write_chunk(b"data: [DONE]\n\n")
        self.write_chunk(b"")

    def chunk(self, chat: bool, delta, finish) -> dict:
        payload = self.envelope(chat, stream=True)
        if chat:
            if isinstance(delta, str):
                delta = {"content": delta}
            payload["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            payload["choices"] = [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}]
        return payload

    def send_event(self, payload: dict) -> None:
        self.write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def usage(result) -> dict:
    prompt, completion = result.stats.prompt_tokens, result.stats.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stats_json(result) -> dict:
    s = result.stats
    tau = s.tau if s.tau == s.tau else None
    return {"tau": tau, "steps": s.steps, "accept_per_position": s.accept_per_position, "ttft_s": s.ttft_s, "total_s": s.total_s, "tokens_per_s": s.tokens_per_s}


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> Server:
    """A bound (not yet serving) server; call serve_forever() on it."""
    app = App(engine, model_name, api_key)
    handler = type("QfdHandler", (Handler,), {"app": app})
    server = Server((host, port), handler)
    server.app = app
    return server
