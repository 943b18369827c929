"""TLS on the ingress's public listener (--tls-cert, --tls-key): the openai SDK and curl over
https with a self-signed certificate, the same limits as plain HTTP, a handshake that never
comes cut at the head's deadline while it holds its place among the connections."""
from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import time

import openai
import pytest
from test_ingress_support import Stack, read_to_close

import otela_ingress

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def tls_stack(tmp_path, certificate, uvloop: bool = False, **limits) -> Stack:
    return Stack(str(tmp_path / "tls.sqlite"), uvloop=uvloop, tls=otela_ingress.public_tls(*certificate),
                 limits=otela_ingress.Limits(**limits))


@pytest.mark.parametrize("uvloop", [False, True])
def test_the_openai_sdk_streams_and_answers_over_tls_with_a_self_signed_certificate(tmp_path, certificate, uvloop):
    if uvloop:
        pytest.importorskip("uvloop")
    stack = tls_stack(tmp_path, certificate, uvloop)
    try:
        stack.engine("m1", chunks=3)
        with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=certificate[0])) as http:
            client = openai.OpenAI(base_url=f"https://127.0.0.1:{stack.port}/v1", api_key=stack.key(),
                                   http_client=http, max_retries=0)
            answer = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content == "tok0 tok1 tok2 "
            chunks = [c.choices[0].delta.content for c in client.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], stream=True) if c.choices]
            assert "".join(chunks) == "tok0 tok1 tok2 "
            assert client.responses.create(model="m1", input="hi").output_text == "tok0 tok1 tok2 "
        assert stack.sql("SELECT count(*) FROM requests WHERE status = 200") == [(3,)]
    finally:
        stack.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_gets_the_models_over_tls_and_plain_http_on_the_tls_port_gets_nothing(tmp_path, certificate):
    stack = tls_stack(tmp_path, certificate)
    try:
        stack.engine("m1")
        key = stack.key()
        out = subprocess.run(["curl", "-s", "--cacert", certificate[0], "-H", f"authorization: Bearer {key}",
                              f"https://127.0.0.1:{stack.port}/v1/models"], capture_output=True, timeout=30)
        assert [m["id"] for m in json.loads(out.stdout)["data"]] == ["m1"]
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            data, closed = read_to_close(sock, 5.0)
        assert closed and b"HTTP/1.1" not in data
    finally:
        stack.close()


def test_a_handshake_that_never_comes_holds_a_place_and_is_cut_at_the_head_deadline(tmp_path, certificate):
    stack = tls_stack(tmp_path, certificate, head_timeout_s=1.0, max_connections=2)
    try:
        silent = [socket.create_connection(("127.0.0.1", stack.port)) for _ in range(2)]
        time.sleep(0.2)
        assert stack.call(lambda: stack.ingress.metrics.connections) == 2   # counted mid-handshake
        third = socket.create_connection(("127.0.0.1", stack.port))
        assert read_to_close(third, 3.0)[1]   # over the cap: closed
        third.close()
        assert all(read_to_close(sock, 5.0)[1] for sock in silent)   # cut by the head's deadline, not left open
        for sock in silent:
            sock.close()
        deadline = time.monotonic() + 5
        while stack.call(lambda: stack.ingress.metrics.connections) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.call(lambda: stack.ingress.metrics.connections) == 0
    finally:
        stack.close()
