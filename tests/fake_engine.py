"""A fake OpenAI-compatible LLM engine for tests and benchmarks.

A small, fast stdlib-asyncio HTTP/1.1 server (keep-alive, Content-Length or chunked request
bodies) that stands in for `vllm serve` / `llama-cpp-python` so the node and the ingress can be
tested without a model. It serves:

  GET  /health               200 {"status": "ok"} (503 while --startup-delay runs; 404 with --no-health)
  GET  /v1/models            the one model (--model)
  POST /v1/chat/completions  chat completion, non-stream or SSE (stream: true)
  POST /v1/completions       text completion, same
  POST /v1/embeddings        8-dimensional deterministic embeddings
  POST /v1/responses         the Responses API, whole or streamed as its events (response.created,
                             response.output_text.delta per chunk, response.completed with usage
                             as input_tokens/output_tokens), each `event: NAME` + `data: {...}`
  POST /v1/audio/transcriptions  a multipart/form-data upload: {"text": ..., "model": <its form
                             field>, "bytes": <the file's size>, "usage": {input/output_tokens}}
  GET  /v1/files             {"object": "list", "data": []}
  POST /tokenize, /detokenize  vLLM's native routes (no model needed): {"tokens": [...], "count": n},
                             {"prompt": "..."}
  POST /generate             SGLang's native route: {"text": ..., "meta_info": {...}}, or with
                             "stream": true its stream (`data: {"text": ...}` per chunk, then [DONE])
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter  vLLM's LoRA routes ({"lora_name", "lora_path"}):
                             a loaded adapter is in /v1/models as {"id", "parent": --model, "root": path}
  GET  /fake/stats           {"requests": n, "last_body": "<raw request body>", "port": p,
                             "last_headers": {...}, "last_method": "GET", "last_target": "/v1/x?y"}:
                             lets a test check that a request was forwarded verbatim

Token accounting: prompt_tokens = words in the prompt, completion_tokens = --chunks (or, with
--usage-tokens N, a lying engine's: N prompt, N completion and N cached tokens). Streams
send --chunks SSE chunks `data: {...}\\n\\n` then `data: [DONE]\\n\\n`, plus a usage chunk
before [DONE] when `stream_options.include_usage` is true. Every response carries the header
`x-fake-engine: PORT` so a test can see which engine served a request.

Modes (--mode): ok; error500 (completions and embeddings, and the routes above but the GET and
vLLM's native ones, answer 500 while /health passes);
reset (completions and embeddings close the connection without answering); cut (send half of
the chunks, or half of the body, then drop the connection); slow (wait --slow-delay seconds
before the first byte of a completion or embedding, then behave as ok).

Usage: python tests/fake_engine.py --port P [--model NAME] [--mode ok|error500|reset|cut|slow]
       [--chunks N] [--chunk-delay S] [--startup-delay S] [--slow-delay S] [--no-health]
       [--usage-tokens N]
Flags are stable and only ever added to. In-process: `await start_fake_engine(port, **opts)`
returns the FakeEngine (`.server`, `await .close()`); `spawn_fake_engine(port, *flags)` starts a subprocess and waits until
it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

MODES = ("ok", "error500", "reset", "cut", "slow")
MAX_BODY = 16 * 1024 * 1024  # a fake engine needs no more; protects the test box


class FakeEngine:
    def __init__(self, port: int, model: str = "fake-model", mode: str = "ok", chunks: int = 8,
                 chunk_delay: float = 0.0, startup_delay: float = 0.0, slow_delay: float = 2.0,
                 health: bool = True, usage_tokens: Optional[int] = None, max_model_len: Optional[int] = None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.port = port
        self.model = model
        self.mode = mode
        self.chunks = max(0, int(chunks))
        self.chunk_delay = chunk_delay
        self.ready_at = time.monotonic() + startup_delay
        self.slow_delay = slow_delay
        self.health = health
        self.usage_tokens = usage_tokens   # the count every answer claims (None: the true one)
        self.max_model_len = max_model_len   # in /v1/models, as vLLM gives it (None: not said)
        self.adapters: dict = {}       # LoRA adapters loaded: name -> path
        self.requests = 0
        self.hits = {}                 # path -> number of requests, every route
        self.last_body = b""
        self.last_headers: dict = {}   # the last request's headers (lower-case names), every route
        self.last_method, self.last_target = "", ""
        self.server = None
        self.handlers: set = set()     # the tasks serving open connections

    async def close(self) -> None:
        """Stop listening and end the connections in progress (a handler left pending would
        outlive its event loop)."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        handlers = list(self.handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)

    # -- HTTP plumbing ----------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.handlers.add(task)
        try:
            await self._handle(reader, writer)
        finally:
            self.handlers.discard(task)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:   # TCP_NODELAY: asyncio and uvloop set it on every TCP transport
            while True:
                request = await read_request(reader)
                if request is None:
                    break
                method, path, headers, body = request
                keep = await self.respond(method, path, headers, body, writer)
                if not keep or headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        except asyncio.CancelledError:
            pass                                    # shutting down: no traceback for open connections
        finally:
            writer.close()

    def send(self, writer, status: int, body: bytes, ctype: str = "application/json") -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
                  503: "Service Unavailable"}.get(status, "OK")
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                f"x-fake-engine: {self.port}\r\n\r\n")
        writer.write(head.encode() + body)

    def send_json(self, writer, status: int, obj) -> None:
        self.send(writer, status, json.dumps(obj).encode())

    def error(self, writer, status: int, message: str, etype: str = "invalid_request_error") -> None:
        self.send_json(writer, status, {"error": {"message": message, "type": etype, "param": None,
                                                  "code": None}})

    # -- endpoints --------------------------------------------------------------------------
    async def respond(self, method, path, headers, body, writer) -> bool:
        self.last_method, self.last_target = method, path
        path = path.split("?", 1)[0]
        if path != "/fake/stats" and path != "/health":
            self.last_headers = dict(headers)
        self.hits[path] = self.hits.get(path, 0) + 1
        loading = time.monotonic() < self.ready_at
        if method == "GET" and path == "/health":
            if not self.health:
                self.error(writer, 404, "no such route")
            elif loading:
                self.error(writer, 503, "loading model", "server_error")
            else:
                self.send_json(writer, 200, {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            if loading:
                self.error(writer, 503, "loading model", "server_error")
            else:
                self.send_json(writer, 200, {"object": "list", "data": self.model_list()})
        elif method == "POST" and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            self.requests += 1
            self.last_body = body
            self.lora(path, body, writer)
        elif method == "GET" and path == "/fake/stats":
            self.send_json(writer, 200, {"requests": self.requests, "port": self.port,
                                         "last_body": self.last_body.decode("utf-8", "replace"),
                                         "last_headers": self.last_headers, "last_method": self.last_method,
                                         "last_target": self.last_target})
        elif method == "GET" and path == "/v1/files":
            self.send_json(writer, 200, {"object": "list", "data": []})
        elif method == "POST" and path in ("/tokenize", "/detokenize"):
            self.requests += 1
            self.last_body = body
            req = json.loads(body or b"{}")
            if path == "/tokenize":
                tokens = [len(w) for w in str(req.get("prompt", "")).split()]
                self.send_json(writer, 200, {"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
            else:
                self.send_json(writer, 200, {"prompt": " ".join("w" * t for t in req.get("tokens", []))})
        elif method == "POST" and path in ("/v1/responses", "/v1/audio/transcriptions", "/generate"):
            self.requests += 1
            self.last_body = body
            return await self.other_inference(path, headers, body, writer)
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            self.requests += 1
            self.last_body = body
            return await self.inference(path, body, writer)
        else:
            self.error(writer, 404, f"no route {method} {path}")
        await writer.drain()
        return True

    def model_list(self) -> list:
        """/v1/models' data as vLLM answers it: the base model, then each adapter with its base and path."""
        base = {"id": self.model, "object": "model", "created": 0, "owned_by": "fake", "root": self.model}
        if self.max_model_len is not None:
            base["max_model_len"] = self.max_model_len
        return [base] + [{"id": name, "object": "model", "created": 0, "owned_by": "fake", "root": root,
                          "parent": self.model, **({"max_model_len": self.max_model_len} if self.max_model_len else {})}
                         for name, root in self.adapters.items()]

    def lora(self, path, body, writer) -> None:
        """vLLM's answers: plain text on success, 400 for a name loaded twice, 404 to unload one not loaded."""
        req = json.loads(body or b"{}")
        name = str(req.get("lora_name", ""))
        if path.endswith("/load_lora_adapter"):
            if name in self.adapters:
                self.error(writer, 400, f"The lora adapter '{name}' has already been loaded.")
                return
            self.adapters[name] = str(req.get("lora_path", ""))
            self.send(writer, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain")
        elif self.adapters.pop(name, None) is None:
            self.error(writer, 404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        else:
            self.send(writer, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), "text/plain")

    async def inference(self, path, body, writer) -> bool:
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            self.error(writer, 400, f"bad JSON: {exc}")
            await writer.drain()
            return True
        if self.mode == "error500":
            self.error(writer, 500, "fake engine failure (mode error500)", "server_error")
            await writer.drain()
            return True
        if self.mode == "reset":
            sock = writer.get_extra_info("socket")
            if sock is not None:  # RST rather than FIN: the harshest way to fail
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                except OSError:
                    pass
            return False
        if self.mode == "slow":
            await asyncio.sleep(self.slow_delay)
        if path == "/v1/embeddings":
            return await self.embeddings(req, writer)
        chat = path == "/v1/chat/completions"
        prompt_tokens = count_words(req.get("messages") if chat else req.get("prompt"))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self.chunks,
                 "total_tokens": prompt_tokens + self.chunks}
        if self.usage_tokens is not None:
            n = self.usage_tokens
            usage = {"prompt_tokens": n, "completion_tokens": n, "total_tokens": 2 * n,
                     "prompt_tokens_details": {"cached_tokens": n}}
        rid = f"fake-{self.port}-{self.requests}"
        model = req.get("model") or self.model
        created = int(time.time())
        if req.get("stream"):
            return await self.stream(req, writer, chat, rid, model, created, usage)
        text = "".join(f"tok{i} " for i in range(self.chunks))
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            obj = "text_completion"
        payload = json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                              "choices": [choice], "usage": usage,
                              "system_fingerprint": f"fake-{self.port}"}).encode()
        if self.mode == "cut":
            head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}"
                    f"\r\nx-fake-engine: {self.port}\r\n\r\n").encode()
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            return False
        self.send(writer, 200, payload)
        await writer.drain()
        return True

    async def stream(self, req, writer, chat, rid, model, created, usage) -> bool:
        writer.write((f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                      f"transfer-encoding: chunked\r\nx-fake-engine: {self.port}\r\n\r\n").encode())
        obj = "chat.completion.chunk" if chat else "text_completion"
        limit = self.chunks // 2 if self.mode == "cut" else self.chunks
        # the chunks between the first and the last differ only in their token: rendered once, so
        # that the engine side of a streaming benchmark is cheap (one write per chunk, as engines do)
        middle = sse({"id": rid, "object": obj, "created": created, "model": model,
                      "choices": [{"index": 0, "delta": {"content": TOKEN_MARK}, "finish_reason": None} if chat
                                  else {"index": 0, "text": TOKEN_MARK, "finish_reason": None}]})
        before, after = middle.split(TOKEN_MARK.encode())
        for i in range(self.chunks):
            if i >= limit:
                await writer.drain()
                return False  # mode cut: drop the connection mid-stream
            if 0 < i < self.chunks - 1:
                data = b"%s%s%d %s" % (before, b"tok", i, after)
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            else:
                if chat:
                    delta = {"content": f"tok{i} "} if i else {"role": "assistant", "content": f"tok{i} "}
                    choice = {"index": 0, "delta": delta,
                              "finish_reason": "stop" if i == self.chunks - 1 else None}
                else:
                    choice = {"index": 0, "text": f"tok{i} ",
                              "finish_reason": "stop" if i == self.chunks - 1 else None}
                write_chunk(writer, sse({"id": rid, "object": obj, "created": created, "model": model,
                                         "choices": [choice]}))
            if self.chunk_delay:
                await writer.drain()
                await asyncio.sleep(self.chunk_delay)
        if (req.get("stream_options") or {}).get("include_usage"):
            write_chunk(writer, sse({"id": rid, "object": obj, "created": created, "model": model,
                                     "choices": [], "usage": usage}))
        write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def other_inference(self, path, headers, body, writer) -> bool:
        """The Responses API, an audio transcription and SGLang's /generate, under the modes."""
        if self.mode == "error500":
            self.error(writer, 500, "fake engine failure (mode error500)", "server_error")
            await writer.drain()
            return True
        if self.mode == "reset":
            return False
        if self.mode == "slow":
            await asyncio.sleep(self.slow_delay)
        if path == "/v1/audio/transcriptions":
            fields = form_fields(body, headers.get("content-type", ""))
            audio = fields.get("file", b"")
            self.send_json(writer, 200, {"text": f"fake transcription of {len(audio)} bytes",
                                         "model": fields.get("model", b"").decode(), "bytes": len(audio),
                                         "usage": {"type": "tokens", "input_tokens": len(audio) // 100,
                                                   "output_tokens": 4, "total_tokens": len(audio) // 100 + 4}})
            await writer.drain()
            return True
        req = json.loads(body or b"{}")
        model = req.get("model") or self.model
        words = count_words(req.get("input") if path == "/v1/responses" else req.get("text"))
        if path == "/generate":
            events = [{"text": "".join(f"tok{j} " for j in range(i + 1)),
                       "meta_info": {"prompt_tokens": words, "completion_tokens": i + 1}} for i in range(self.chunks)]
            if not (req.get("stream") or False):
                self.send_json(writer, 200, events[-1] if events else {"text": "", "meta_info": {}})
                await writer.drain()
                return True
            return await self.event_stream([(None, e) for e in events] + [(None, "[DONE]")], writer)
        rid = f"resp_fake{self.port}x{self.requests}"
        text = "".join(f"tok{i} " for i in range(self.chunks))
        usage = {"input_tokens": words, "output_tokens": self.chunks, "total_tokens": words + self.chunks}
        done = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "status": "completed", "usage": usage,
                "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": text, "annotations": []}]}]}
        if not req.get("stream"):
            self.send_json(writer, 200, done)
            await writer.drain()
            return True
        started = dict(done, status="in_progress", usage=None, output=[])
        events = [("response.created", {"type": "response.created", "sequence_number": 0, "response": started})]
        events += [("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1",
                                                   "output_index": 0, "content_index": 0, "delta": f"tok{i} ",
                                                   "sequence_number": i + 1}) for i in range(self.chunks)]
        events.append(("response.completed", {"type": "response.completed", "sequence_number": self.chunks + 1,
                                              "response": done}))
        return await self.event_stream(events, writer)

    async def event_stream(self, events, writer) -> bool:
        """SSE events (name or None, data: an object or a string), --chunk-delay apart; mode cut
        drops the connection half-way."""
        writer.write((f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                      f"transfer-encoding: chunked\r\nx-fake-engine: {self.port}\r\n\r\n").encode())
        for i, (name, data) in enumerate(events):
            if self.mode == "cut" and i >= len(events) // 2:
                await writer.drain()
                return False
            line = b"data: " + (data.encode() if isinstance(data, str) else json.dumps(data).encode()) + b"\n\n"
            write_chunk(writer, (b"event: %s\n" % name.encode() if name else b"") + line)
            await writer.drain()
            if self.chunk_delay and i < len(events) - 1:
                await asyncio.sleep(self.chunk_delay)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def embeddings(self, req, writer) -> bool:
        inputs = req.get("input")
        items = inputs if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else [inputs]
        data = []
        for i, item in enumerate(items):
            seed = sum(str(item).encode()) or 1
            data.append({"object": "embedding", "index": i,
                         "embedding": [((seed * (k + 7)) % 97) / 97.0 for k in range(8)]})
        tokens = count_words(items) if self.usage_tokens is None else self.usage_tokens
        payload = {"object": "list", "data": data, "model": req.get("model") or self.model,
                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        if self.mode == "cut":
            raw = json.dumps(payload).encode()
            writer.write((f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}"
                          f"\r\n\r\n").encode() + raw[: len(raw) // 2])
            await writer.drain()
            return False
        self.send_json(writer, 200, payload)
        await writer.drain()
        return True


TOKEN_MARK = "@@token@@"


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def write_chunk(writer, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def form_fields(body: bytes, ctype: str) -> dict:
    """The fields of a multipart/form-data body: name -> bytes."""
    marker = "boundary="
    if marker not in ctype:
        return {}
    boundary = b"--" + ctype.split(marker, 1)[1].split(";")[0].strip().strip('"').encode()
    fields = {}
    for part in body.split(boundary)[1:]:
        head, _, value = part.partition(b"\r\n\r\n")
        name = head.split(b'name="', 1)[1].split(b'"', 1)[0].decode() if b'name="' in head else ""
        if name:
            fields[name] = value[:-2] if value.endswith(b"\r\n") else value
    return fields


def count_words(prompt) -> int:
    """Words in a prompt: a string, a list of strings, or chat messages (string or part lists)."""
    if prompt is None:
        return 0
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, list):
        return sum(count_words(p) for p in prompt)
    if isinstance(prompt, dict):
        if "content" in prompt:
            return count_words(prompt["content"])
        if prompt.get("type") == "text":
            return count_words(prompt.get("text"))
    return 0


async def read_request(reader: asyncio.StreamReader):
    """One HTTP/1.1 request: (method, path, headers lower-cased, body) or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise ValueError("truncated request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise ValueError("request head too large") from None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise ValueError("bad request line")
    method, path, _version = parts
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            body += await reader.readexactly(size)
            await reader.readexactly(2)
            if len(body) > MAX_BODY:
                raise ValueError("body too large")
    else:
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        body = await reader.readexactly(length) if length else b""
    return method, path, headers, body


async def start_fake_engine(port: int, host: str = "127.0.0.1", **opts) -> FakeEngine:
    """Start a fake engine in the running loop; opts are FakeEngine's keyword arguments.
    Returns the FakeEngine; `engine.server` is the asyncio server, `await engine.close()` stops it."""
    engine = FakeEngine(port, **opts)
    engine.server = await asyncio.start_server(engine.handle, host, port, reuse_address=True)
    return engine


_handed_out: set = set()            # the ports free_port gave this process


def free_port(kind: int = socket.SOCK_STREAM, both: bool = False) -> int:
    """A loopback port free now for `kind` (TCP and UDP with `both`: gossip binds both), for a
    process the test starts later: otela_node.free_port's (below the ephemeral range, where no
    outgoing connection takes it first), never one this process was given before."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    import otela_node  # here, not at the top: the engine process never needs it
    return otela_node.free_port((socket.SOCK_STREAM, socket.SOCK_DGRAM) if both else (kind,), _handed_out)


def free_port_pair() -> int:
    """A loopback port free for both TCP and UDP (gossip binds both)."""
    return free_port(both=True)


def spawn_fake_engine(port: int, *flags: str, wait: float = 10.0) -> subprocess.Popen:
    """Start `python tests/fake_engine.py --port PORT FLAGS…` and wait until it accepts TCP."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--port", str(port), *flags])
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"fake engine exited with {proc.returncode}") from None
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"fake engine on port {port} did not start within {wait} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Fake OpenAI-compatible engine for otela tests.")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--mode", choices=MODES, default="ok")
    p.add_argument("--chunks", type=int, default=8, help="SSE chunks per stream = completion tokens")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between SSE chunks")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds /health and /v1/models answer 503")
    p.add_argument("--slow-delay", type=float, default=2.0, help="mode slow: seconds before the first byte")
    p.add_argument("--no-health", action="store_true", help="no /health route (readiness via /v1/models)")
    p.add_argument("--max-model-len", type=int, default=None, help="the context window /v1/models gives")
    p.add_argument("--usage-tokens", type=int, default=None,
                   help="claim this many prompt, completion and cached tokens in every answer's usage")
    a = p.parse_args(argv)
    try:
        import uvloop  # optional accelerator
        uvloop.install()
    except ImportError:
        pass

    async def serve():
        engine = await start_fake_engine(a.port, host=a.host, model=a.model, mode=a.mode, chunks=a.chunks,
                                         chunk_delay=a.chunk_delay, startup_delay=a.startup_delay,
                                         slow_delay=a.slow_delay, health=not a.no_health,
                                         usage_tokens=a.usage_tokens, max_model_len=a.max_model_len)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await engine.close()

    try:
        asyncio.run(serve())
    except OSError as exc:
        print(f"fake_engine: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
