"""A session's site: `--site-name NAME` (OTELA_SITE_NAME) on every overlay member, carried as its
label site=NAME, shown in /v1/registry and the dashboard; where grants are checked, the grant's
site label is the one believed, and a record claiming another site is shown beside it, never used."""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import pytest
from test_ingress_support import Client, Stack

import crdt
import otela_node as on


def overlay_config(argv, env=None):
    parser = argparse.ArgumentParser()
    on.add_overlay_args(parser)
    return on.config_from_args(crdt.parse_settings(parser, argv, on.SETTING_NAMES, env or os.environ))


def test_site_name_becomes_the_site_label_from_the_flag_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OTELA_KEY_FILE", on.keygen(str(tmp_path))[0])
    assert overlay_config(["--site-name", "lrz", "--label", "tier=gold"]).labels == {"site": "lrz", "tier": "gold"}
    monkeypatch.setenv("OTELA_SITE_NAME", "alcf")
    assert overlay_config([]).labels == {"site": "alcf"}
    assert overlay_config(["--site-name", "alcf", "--label", "site=alcf"]).labels == {"site": "alcf"}
    assert overlay_config(["--site-name", "lrz"]).labels == {"site": "lrz"}   # the flag over the variable


@pytest.mark.parametrize("argv, why", [
    (["--site-name", "two words"], "bad --site-name"),
    (["--site-name", "x" * 65], "bad --site-name"),
    (["--site-name", ""], "bad --site-name"),
    (["--site-name", "a", "--label", "site=b"], "disagree"),
])
def test_a_bad_or_contradicted_site_name_is_a_config_error(tmp_path, argv, why):
    key = on.keygen(str(tmp_path))[0]
    with pytest.raises(on.ConfigError, match=why):
        overlay_config(["--key-file", key, *argv])


def test_a_bad_site_name_stops_start_with_one_line_and_exit_2(tmp_path, capsys):
    key = on.keygen(str(tmp_path))[0]
    assert on.main(["start", "--key-file", key, "--process", "true", "--site-name", "a/b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad --site-name 'a/b'" in err


def registry(stack):
    with urllib.request.urlopen(stack.url + "/v1/registry", timeout=10) as resp:
        view = json.loads(resp.read())
    sessions = view["sessions"]
    return sessions if isinstance(sessions, dict) else {s["session"]: s for s in sessions}


def grant_to(stack, tier, sid, labels):
    record = stack.node.registry.get(sid)
    record.update(version=record["version"] + 1,
                  grant=tier.issue(["m-site"], labels, "1", time.time() + 600, time.time())[0])
    stack.node.registry.put(sid, record)
    stack.node._changed(sid)


def test_registry_shows_each_sessions_site_as_its_grant_says_and_a_contrary_claim_beside_it(tmp_path):
    stack = Stack(str(tmp_path / "otela.sqlite"))
    try:
        honest, _ = stack.engine("m-site", labels={"site": "a"})
        liar, _ = stack.engine("m-site", labels={"site": "b"})      # its grant says site a
        unplaced, _ = stack.engine("m-site")
        placed, _ = stack.engine("m-site")                         # placed by its grant alone
        assert registry(stack)[liar]["site"] == "b"                 # nothing checked yet: its word
        tier = crdt.Authority([b"i" * 32])
        stack.call(stack.ingress.grants.use, tier)
        for sid in (honest, liar, placed):
            stack.call(grant_to, stack, tier, sid, {"site": "a"})
        stack.call(grant_to, stack, tier, unplaced, {})
        view = registry(stack)
        assert (view[honest]["site"], "site_claimed" in view[honest]) == ("a", False)
        assert (view[liar]["site"], view[liar]["site_claimed"]) == ("a", "b")
        assert view[unplaced]["site"] is None and "site_claimed" not in view[unplaced]
        assert view[placed]["site"] == "a" and "site_claimed" not in view[placed]
        # a key whose requests must stay at site b reaches no engine: the one claiming b is at a
        assert Client(stack.url, stack.key("bob", allow=["site=b"])).chat("m-site")[0] != 200
        assert Client(stack.url, stack.key("carol", allow=["site=a"])).chat("m-site")[0] == 200
    finally:
        stack.close()


def own_site(cluster):
    view = json.loads(Client(cluster.url).request("GET", "/v1/registry")[2])
    sessions = view["sessions"]
    mine = [s for s in sessions if s["session"] == view["self"]] if isinstance(sessions, list) \
        else [sessions[view["self"]]]
    return mine[0]["site"]


def test_an_ingress_is_at_its_site_files_site_unless_its_site_name_says_otherwise(tmp_path):
    from test_ingress_support import Cluster
    site_file = tmp_path / "site.json"
    site_file.write_text(json.dumps({"name": "lrz", "catalogue": [{"name": "m"}]}))
    for flags, site in ((("--site", str(site_file)), "lrz"),
                        (("--site", str(site_file), "--site-name", "lrz-login2"), "lrz-login2")):
        folder = tmp_path / site
        folder.mkdir()
        cluster = Cluster(str(folder), ingress_flags=flags)
        try:
            assert own_site(cluster) == site
        finally:
            cluster.close()
