"""A (re)started ingress that has not heard from the cluster yet: an unknown model is a 503 with
Retry-After (clients retry it), not a 404, until a peer's record arrives or the warm-up ends."""
from __future__ import annotations

import json

import pytest
from test_ingress_support import Client, Stack, StandInNode

import otela_ingress
import otela_node


def warming_stack(path: str) -> Stack:
    """An ingress on a stand-in node that, like an overlay node's, hears of the cluster after it
    starts, with a warm-up longer than any test here."""
    node = StandInNode()
    node.whole_registry = False
    return Stack(path, node=node, limits=otela_ingress.Limits(warmup_max_s=60.0))


@pytest.fixture
def warming(tmp_path):
    stack = warming_stack(str(tmp_path / "w.sqlite"))
    yield stack
    stack.close()


def test_an_unknown_model_is_503_with_retry_after_before_the_ingress_heard_from_a_peer(warming):
    client = Client(warming.url, warming.key())
    status, headers, body = client.chat("m1")
    assert status == 503
    assert json.loads(body)["error"]["code"] == "no_healthy_provider"
    assert headers["retry-after"] == "1"
    client.close()


def test_the_first_peer_record_ends_the_warm_up_and_unknown_models_are_404_again(warming):
    client = Client(warming.url, warming.key())
    warming.engine("m1")   # a worker's record arrives: the registry is a peer's view now
    assert client.chat("m1")[0] == 200
    status, _, body = client.chat("nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    client.close()


def test_the_warm_up_ends_by_itself_for_a_lone_ingress(tmp_path):
    stack = warming_stack(str(tmp_path / "lone.sqlite"))
    try:
        client = Client(stack.url, stack.key())
        assert client.chat("m1")[0] == 503
        stack.call(setattr, stack.ingress, "_warm_until", 1.0)   # as if warmup_max_s had passed
        status, _, body = client.chat("m1")
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
        client.close()
    finally:
        stack.close()


def test_an_overlay_node_gets_the_warm_up_and_a_stand_in_none(tmp_path):
    node = otela_node.Node(otela_node.Config(key=b"k" * 32), role="ingress", models=[], hardware={}, labels={})
    assert otela_ingress.Ingress(node, db_path=str(tmp_path / "a.sqlite")).warmup == otela_ingress.WARMUP_MAX_S
    assert otela_ingress.Ingress(StandInNode(), db_path=str(tmp_path / "b.sqlite")).warmup == 0.0
