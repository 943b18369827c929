"""A site cut off (root; the WAN lab): sites a and b, each with its ingress on its login host and a
node serving the same model behind its NAT, lose their WAN link for a while.

What must hold (`run_site_cut`, also a `make reliability` row with a longer cut):
  - each side serves its own users with its own engine all along: 0 errors for the model both
    sides serve, before, during and after the cut (an attempt that finds the far node gone is
    retried on the near one);
  - a key made at site a and a key revoked at site b during the cut: each applies at its own
    site at once, and at the other within seconds of the heal;
  - a key's day budget, spent at both sides during the cut, is over-spent by at most what each
    side had left when the link went (each side counts its own spending and what it heard
    before: the bound is (sites - 1) x the budget left at the cut);
  - usage counted exactly once after the heal: each ingress's /v1/admin/usage totals (the per-ingress
    G-counter slots, merged) equal the requests the clients saw answered, at both ingresses.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Optional

import netns
import pytest
import reliability as rel
import wanlab

BUDGET_TOKENS = 200   # the budget key's day budget; a fake engine's chat costs ~10-20 tokens


def call_api(url: str, method: str = "GET", token: str = "", body: Optional[Dict[str, Any]] = None,
             timeout: float = 10.0) -> Dict[str, Any]:
    """One HTTP call (run inside a Place): its status and parsed body, an error status included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return {"status": resp.status, "body": json.loads(resp.read() or b"null")}
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return {"status": exc.code, "body": json.loads(raw)}
        except ValueError:
            return {"status": exc.code, "body": raw[:200].decode("utf-8", "replace")}
    except OSError as exc:   # no answer: refused, reset, timed out
        return {"status": 0, "body": f"{exc.__class__.__name__}: {exc}"}


def chat(url: str, token: str, model: str = rel.MODEL, timeout: float = 30.0) -> Dict[str, Any]:
    return call_api(url + "/v1/chat/completions", "POST", token,
                    {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout)


def chat_for(url: str, token: str, seconds: float, every: float = 0.05) -> Dict[str, Any]:
    """Sequential chats for `seconds` (run inside a Place): statuses, tokens answered, errors."""
    out: Dict[str, Any] = {"statuses": [], "tokens": 0, "errors": [], "slowest_ms": 0.0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        got = chat(url, token)
        out["slowest_ms"] = max(out["slowest_ms"], (time.monotonic() - began) * 1e3)
        out["statuses"].append(got["status"])
        if got["status"] == 200:
            out["tokens"] += (got["body"].get("usage") or {}).get("total_tokens", 0)
        else:
            out["errors"].append(str(got["body"])[:200])
        time.sleep(every)
    return out


def spend(url: str, token: str, seconds: float) -> Dict[str, Any]:
    """Chats with a budgeted key until refused (429 insufficient_quota) or `seconds` pass."""
    out = {"ok": 0, "refused": False}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = chat(url, token)
        if got["status"] == 200:
            out["ok"] += 1
        elif got["status"] == 429:
            out["refused"] = True
            break
        time.sleep(0.02)
    return out


def totals(place: netns.Place, url: str, admin: str, key_id: str) -> Dict[str, int]:
    """The cluster's usage totals of one key today (/v1/admin/usage: its G-counters, merged)."""
    got = place.call(call_api, f"{url}/v1/admin/usage?key={key_id}&days=1", "GET", admin)
    if got["status"] != 200:
        raise ValueError(f"/v1/admin/usage answered {got['status']}")
    sums = got["body"]["totals"]
    return {"requests": sums["requests"], "tokens": sums["prompt_tokens"] + sums["completion_tokens"]}


def run_site_cut(tmp: str, timings: Dict[str, str], cut_s: float = 20.0, rtt_ms: float = 10.0) -> Dict[str, Any]:
    """The scenario of the module docstring; returns its figures (asserts nothing)."""
    out: Dict[str, Any] = {"cut_s": cut_s, "rtt_ms": rtt_ms}
    # per site: the ingress on its login host, the node on host 0, the clients on host 1 (a Place
    # runs one call at a time: the load must not hold up the test's own calls)
    with wanlab.WanLab(sites=2, hosts=2, links={"a-b": {"rtt_ms": rtt_ms}}) as lab, rel.Fleet(tmp, timings) as fleet:
        ingress = {"a": fleet.ingress(lab.login("a"), policy="ttft", name="ingress-a", flags=("--site-name", "a"))}
        ingress["b"] = fleet.ingress(lab.login("b"), policy="ttft", name="ingress-b", bootstrap=(ingress["a"].gossip,),
                                     db=os.path.join(tmp, "b.sqlite"), flags=("--site-name", "b"))
        for s in ("a", "b"):
            fleet.node(f"node-{s}", lab.host(s), bootstrap=(ingress[s].gossip,),
                       grant=fleet.grant(f"node-{s}", (rel.MODEL,), "--label", f"site={s}"),
                       flags=("--site-name", s, "--reach", "private"))
        place = {s: lab.login(s) for s in ("a", "b")}
        url = {s: ingress[s].url for s in ("a", "b")}
        admin = fleet.token
        rel.wait(lambda: fleet.up() and all(len(fleet.serving(ingress[s])) == 2 for s in "ab"), 120,
                 "both nodes SERVING at both ingresses")

        def make_key(side: str, **spec: Any) -> Dict[str, Any]:
            got = place[side].call(call_api, url[side] + "/v1/admin/keys", "POST", admin, spec)
            assert got["status"] == 200, got
            return got["body"]

        outside = {"n": 0}   # the client key's answers outside its load (usage must count each once)

        def works(side: str, token: str) -> bool:
            ok = place[side].call(chat, url[side], token)["status"] == 200
            outside["n"] += ok and token == client["key"]
            return ok

        client = make_key("a", user="cut-client")
        doomed = make_key("a", user="cut-doomed")
        budgeted = make_key("a", user="cut-budget", budget_day=BUDGET_TOKENS)
        for side in "ab":   # every key known at both sides, and each side's tunnels made
            rel.wait(lambda side=side: all(works(side, k["key"]) for k in (client, doomed)), 60, f"keys at site {side}")
        # the cut
        lab.set_link("a", "b", loss=1.0)
        cut_at = time.monotonic()
        side_load: Dict[str, Any] = {}
        threads = [threading.Thread(target=lambda s=s: side_load.__setitem__(
            s, lab.host(s, 1).call(chat_for, url[s], client["key"], cut_s, timeout=cut_s + 120))) for s in "ab"]
        for t in threads:
            t.start()
        time.sleep(min(3.0, cut_s / 4))
        made = make_key("a", user="cut-made")     # during the cut, at a
        got = place["b"].call(call_api, f"{url['b']}/v1/admin/keys/{doomed['id']}/revoke", "POST", admin)
        out["revoke_status"] = got["status"]
        out["made_works_at_a_during"] = rel.until(lambda: works("a", made["key"]), 10) is not None
        out["doomed_refused_at_b_during"] = rel.until(lambda: not works("b", doomed["key"]), 10) is not None
        out["doomed_works_at_a_during"] = works("a", doomed["key"])   # a cannot know yet
        spent = {s: place[s].call(spend, url[s], budgeted["key"], cut_s / 2, timeout=cut_s + 60) for s in "ab"}
        for t in threads:
            t.join()
        out["during"] = {s: {"requests": len(v["statuses"]), "errors": len(v["errors"]), "slowest_ms": round(v["slowest_ms"]),
                             "first_errors": v["errors"][:3]} for s, v in side_load.items()}
        out["budget"] = {"budget_day": BUDGET_TOKENS, "spent": spent,
                         "spent_at_a_during": totals(place["a"], url["a"], admin, budgeted["id"])["tokens"],
                         "spent_at_b_during": totals(place["b"], url["b"], admin, budgeted["id"])["tokens"]}
        # the heal
        lab.set_link("a", "b", loss=0.0)
        healed_at = time.monotonic()
        out["cut_lasted_s"] = round(healed_at - cut_at, 1)
        made_b = rel.until(lambda: works("b", made["key"]), 60)
        doomed_a = rel.until(lambda: not works("a", doomed["key"]), 60)
        out["made_works_at_b_after_s"] = None if made_b is None else round(made_b - healed_at, 1)
        out["doomed_refused_at_a_after_s"] = None if doomed_a is None else round(doomed_a - healed_at, 1)
        after = {s: place[s].call(chat_for, url[s], client["key"], 3.0, timeout=60) for s in "ab"}
        out["after"] = {s: {"requests": len(v["statuses"]), "errors": len(v["errors"]), "slowest_ms": round(v["slowest_ms"])}
                        for s, v in after.items()}
        answered = outside["n"] + sum(v["statuses"].count(200) for v in side_load.values()) + \
            sum(v["statuses"].count(200) for v in after.values())
        tokens = sum(v["tokens"] for v in side_load.values()) + sum(v["tokens"] for v in after.values())
        # usage once: both ingresses' totals of the client key settle at the count of its answers
        warm = {s: totals(place[s], url[s], admin, client["id"]) for s in "ab"}

        def settled() -> bool:
            now = [totals(place[s], url[s], admin, client["id"]) for s in "ab"]
            warm.update(a=now[0], b=now[1])
            return now[0] == now[1] and now[0]["requests"] == answered
        rel.until(settled, 30, every=0.5)
        out["usage"] = {"answered_in_test": answered, "tokens_in_test": tokens, "at_a": warm["a"], "at_b": warm["b"]}
        out["budget"]["refused_at_both_after"] = all(not works(s, budgeted["key"]) for s in "ab")
        out["budget"]["spent_total"] = {s: totals(place[s], url[s], admin, budgeted["id"])["tokens"] for s in "ab"}
    return out


@pytest.mark.root
def test_a_site_cut_off_serves_its_own_users_and_keys_and_usage_agree_after_the_heal(tmp_path):
    reason = wanlab.unavailable()
    if reason:
        pytest.skip(reason)
    out = run_site_cut(str(tmp_path), dict(rel.QUICK_TIMINGS), cut_s=20.0)
    print(json.dumps(out, indent=1))
    assert all(v["errors"] == 0 for v in out["during"].values()), out["during"]
    assert all(v["errors"] == 0 for v in out["after"].values()), out["after"]
    assert out["revoke_status"] == 200 and out["made_works_at_a_during"] and out["doomed_refused_at_b_during"]
    assert out["made_works_at_b_after_s"] is not None and out["doomed_refused_at_a_after_s"] is not None, out
    budget = out["budget"]
    # each side spends what was left at the cut (all of it) and may pass it by its last answer (a few tokens)
    assert budget["spent_total"]["a"] == budget["spent_total"]["b"] <= 2 * (BUDGET_TOKENS + 20), budget
    assert budget["refused_at_both_after"], budget
    usage = out["usage"]
    assert usage["at_a"] == usage["at_b"], usage
    assert usage["at_a"]["requests"] == usage["answered_in_test"], usage   # each answer counted once
