"""Benchmark of otela across sites (issue 46), in the WAN lab (tests/wanlab.py; root only):

    .venv/bin/python tests/bench_wan.py [--out bench-results] [--quick] [--only cross|gossip]
                                        [--gossip-rtt-ms MS]

1. The added latency of a cross-site request: sites a and b RTT ms apart, a chat through site a's
   ingress served by site b's node (relayed: b's node behind its NAT; direct: on b's public login
   host) against one served by site a's own node, both from site a's login host, after a warm-up
   (wanlab.run_cross_site). Reported against the link's round trip measured over the same lab,
   not the number set: the emulator's timers fire up to a millisecond late on a busy box. Two
   figures: `paced` (judged), every request and the link's bare TCP request/answer of the
   tunnel's sizes an RTT after the last answer, so that the local path idles before its steps as
   the cross-site path's processes do; `b2b`, the requests back to back and the link a UDP echo
   (probes 10 ms apart), the first figure this bench gave (it grew with the RTT by the host's
   cold paths after idling: wanlab.run_cross_site). Targets (issue 46): added <= RTT + 1 ms
   at p50 direct, <= RTT + 2 ms relayed. RTTs 10, 40 and 150 ms; --quick: 40 ms.
2. The gossip bytes per member per second across sites, idle: three sites 40 ms apart (or
   --gossip-rtt-ms), each with
   its ingress on its login host and a node behind its NAT, all SERVING; every member's
   `otela_gossip_bytes_total` (ingresses, /metrics) or its /healthz gossip counters (nodes) read
   twice WINDOW_S apart. A member's bytes include its own site's gossip, so the figure is an upper
   bound of what crosses the WAN; the links carry nothing else.

The production timings (no OTELA_* settings): what a site runs. Prints a table, writes
<out>/wan.json; never asserts. Where the lab cannot be built (not root, no TUN) it says why,
writes that, and exits 0. Traffic stays inside the lab's namespaces; everything is removed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reliability as rel  # noqa: E402
import wanlab  # noqa: E402

RTTS_MS, QUICK_RTTS_MS = (10.0, 40.0, 150.0), (40.0,)
REQUESTS, QUICK_REQUESTS = 40, 20
WINDOW_S, QUICK_WINDOW_S = 30.0, 15.0
GOSSIP_RTT_MS = 40.0
TARGET_OVER_LINK_MS = {"direct": 1.0, "relayed": 2.0}


def cross_site(rtts, requests) -> Dict[str, Any]:
    rows = {}
    for rtt in rtts:
        for direct in (False, True):
            name = f"{'direct' if direct else 'relayed'}@{rtt:g}ms"
            with tempfile.TemporaryDirectory(prefix="otela-bench-wan-") as tmp:
                try:
                    out = wanlab.run_cross_site(tmp, {}, rtt_ms=rtt, requests=requests, direct=direct)
                except (RuntimeError, TimeoutError, OSError) as exc:   # a run that fails is a row that says so
                    out = {"error": f"{exc.__class__.__name__}: {exc}"}
            out["target_over_link_ms"] = TARGET_OVER_LINK_MS["direct" if direct else "relayed"]
            rows[name] = out
            print(f"{name:>16}: " + (out.get("error") or
                  f"paced: cross {out['cross_paced']['p50_ms']} ms, local {out['local_paced']['p50_ms']} ms, added "
                  f"{out['added_paced_ms']} ms = TCP link {out['link_tcp_p50_ms']} ms + {out['added_over_tcp_link_ms']} "
                  f"ms (target <= link + {out['target_over_link_ms']:g}); b2b: cross {out['cross']['p50_ms']} ms, "
                  f"local {out['local']['p50_ms']} ms, "
                  f"added {out['added_ms']} ms = UDP link {out.get('link_rtt_p50_ms')} ms + "
                  f"{out.get('added_over_link_ms')} ms; ok {out['cross']['ok']}/{out['cross']['of']}"),
                  flush=True)
    return rows


def gossip_bytes(member: rel.Member, fleet: rel.Fleet) -> int:
    """Bytes the member's overlay sent and received so far."""
    if member.role == "ingress":
        text = member.place.call(_text, member.url + "/metrics")
        return sum(int(n) for n in re.findall(r'^otela_gossip_bytes_total\{direction="\w+"\} (\d+)$', text, re.M))
    _, health = fleet.get(member, "/healthz")
    return health["gossip"]["bytes_sent"] + health["gossip"]["bytes_received"]


def _text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def gossip_rate(window: float, rtt_ms: float = GOSSIP_RTT_MS) -> Dict[str, Any]:
    sites = ("a", "b", "c")
    links = {f"{x}-{y}": {"rtt_ms": rtt_ms} for i, x in enumerate(sites) for y in sites[i + 1:]}
    with tempfile.TemporaryDirectory(prefix="otela-bench-wan-") as tmp, \
            wanlab.WanLab(sites=3, links=links) as lab, rel.Fleet(tmp, {}) as fleet:
        ingresses = [fleet.ingress(lab.login("a"), name="ingress-a", flags=("--site-name", "a"))]
        for s in sites[1:]:
            ingresses.append(fleet.ingress(lab.login(s), name=f"ingress-{s}", bootstrap=(ingresses[0].gossip,),
                                           db=os.path.join(tmp, f"{s}.sqlite"), flags=("--site-name", s)))
        nodes = [fleet.node(f"node-{s}", lab.host(s), bootstrap=(ingress.gossip,),
                            grant=fleet.grant(f"node-{s}", (rel.MODEL,), "--label", f"site={s}"),
                            flags=("--site-name", s)) for s, ingress in zip(sites, ingresses)]
        rel.wait(lambda: fleet.up() and all(len(fleet.serving(i)) == len(nodes) for i in ingresses), 120,
                 "every node SERVING at every ingress")
        members = ingresses + nodes
        before = {m.name: gossip_bytes(m, fleet) for m in members}
        t0 = time.monotonic()
        time.sleep(window)
        after = {m.name: gossip_bytes(m, fleet) for m in members}
        seconds = time.monotonic() - t0
    per = {name: round((after[name] - before[name]) / seconds) for name in before}
    out = {"sites": len(sites), "rtt_ms": rtt_ms, "window_s": round(seconds, 1),
           "bytes_per_member_per_s": per, "mean_bytes_per_member_per_s": round(sum(per.values()) / len(per))}
    print(f"gossip, {len(members)} members at {len(sites)} sites {rtt_ms:g} ms apart, idle: "
          f"{out['mean_bytes_per_member_per_s']} bytes per member per second (sent + received; per member {per})",
          flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--quick", action="store_true", help="one RTT (40 ms), fewer requests, a shorter window")
    p.add_argument("--only", choices=("cross", "gossip"), help="one of the two parts")
    p.add_argument("--gossip-rtt-ms", type=float, default=GOSSIP_RTT_MS, help="the sites' RTT in the gossip part")
    a = p.parse_args()
    if not 0 <= a.gossip_rtt_ms <= 10_000:
        p.error("--gossip-rtt-ms: 0 to 10000")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "wan.json")
    why = wanlab.unavailable()
    if why:
        print(f"bench_wan: skipped: {why}")
        with open(path, "w") as fh:
            json.dump({"skipped": why}, fh, indent=1)
        return 0
    result: Dict[str, Any] = {"quick": a.quick}
    if a.only != "gossip":
        result["cross_site"] = cross_site(QUICK_RTTS_MS if a.quick else RTTS_MS,
                                          QUICK_REQUESTS if a.quick else REQUESTS)
    if a.only != "cross":
        result["gossip"] = gossip_rate(QUICK_WINDOW_S if a.quick else WINDOW_S, a.gossip_rtt_ms)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
