"""Models that change while serving (issue 42, items 2 and 5): LoRA adapters loaded and unloaded
through the overlay (admin keys only) reach the registry with their base and the ingress's
/v1/models with vLLM's `parent` and `root`; a node reads its engine's model list again on a short
period; an engine's context window (`max_model_len`) sends a prompt too long for a model to the
next model of its fallbacks, or answers 400 context_length_exceeded; the fallback lists are read
and changed through the admin API."""
from __future__ import annotations

import json
import time

import pytest
from test_ingress_support import Client, Cluster, Stack, free_port

import crdt
import otela_node

ENGINE = "{python} tests/fake_engine.py --model base --max-model-len 4096 --port {port}"


def wait_for(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("not within %g s" % timeout)


def models(client):
    return {m["id"]: m for m in json.loads(client.request("GET", "/v1/models")[2])["data"]}


@pytest.mark.slow
def test_an_adapter_loaded_through_the_ingress_is_routed_with_its_base_and_unloaded_again(tmp_path, monkeypatch):
    monkeypatch.setenv("OTELA_ENGINE_MODELS_INTERVAL", "0.3")
    cluster = Cluster(str(tmp_path))
    try:
        port = free_port()
        cluster.node("n1", ENGINE.format(python=cluster.python, port=port), port, "base")
        admin = Client(cluster.url, cluster.token)
        status, _, body = admin.request("POST", "/v1/load_lora_adapter",
                                        {"lora_name": "sql", "lora_path": "/adapters/sql", "model": "base"})
        assert status == 200, body
        answer = json.loads(body)
        assert (answer["action"], [s["status"] for s in answer["sessions"]]) == ("load", [200])
        # the answer came once the node's record said it: the adapter is routed at once
        listed = models(admin)
        assert {k: listed["sql"].get(k) for k in ("parent", "root", "max_model_len")} == {
            "parent": "base", "root": "/adapters/sql", "max_model_len": 4096}
        assert "parent" not in listed["base"]
        status, _, body = admin.chat("sql")
        assert status == 200 and json.loads(body)["model"] == "sql"
        stats = json.loads(Client(f"http://127.0.0.1:{port}").request("GET", "/fake/stats")[2])
        assert json.loads(stats["last_body"])["model"] == "sql"
        # an adapter loaded at the engine itself, not through the overlay: seen on the next period
        Client(f"http://127.0.0.1:{port}").request("POST", "/v1/load_lora_adapter",
                                                   {"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert wait_for(lambda: models(admin).get("chat", {}).get("parent") == "base")
        status, _, body = admin.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 200, body
        assert "sql" not in models(admin)
        served = json.loads(Client(f"http://127.0.0.1:{port}").request("GET", "/fake/stats")[2])["requests"]
        assert admin.chat("sql")[0] == 503   # (a model served a moment ago: a retry, not a 404)
        assert json.loads(Client(f"http://127.0.0.1:{port}").request("GET", "/fake/stats")[2])["requests"] == served
    finally:
        cluster.close()
