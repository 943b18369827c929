"""otela_node.py: the provider's side of otela, and the overlay every member runs.

Role: `otela_node.py start --process "vllm serve …"` wraps one engine inside a Slurm job or a pod:
it starts the engine as a child, waits until it is ready, joins the overlay as a session
(JOIN, then SERVING), health-checks the engine, forwards tunnelled HTTP requests to it on
loopback, and on SIGTERM drains, stops the engine and leaves. The ingress imports this module
and runs the same overlay with role "ingress".

Theory of operation. The file is in sections, each a room with one job:

    config             Config: every setting, and where it is read from
    wire format        Wire: seal/open a message (HMAC, replay window, size)
    Overlay            the membership and the registry, sans-IO: messages and a clock in,
                       messages out (dissemination, SWIM failure detection); tests/simnet.py
                       runs many of them on a simulated network
    HTTP               the codec (parse_request/parse_response, BodyReader; request_head,
                       forwarded_request_head, response_head, whole_response write every
                       head), EngineClient
    tunnel security    Tunnel: the tunnel port's admission (caps on strangers, TLS, credential)
                       and its HTTP: the node's pages, the engine forward
    NAT traversal      Reach: the rules of reaching a private peer, pure (per peer: relays,
      and relay        punches, how its tunnel went; the tunnel's path as a table); then the
                       transports those rules drive: relay links and envelopes, mux streams
                       (_MuxCredit, _MuxStream at a relay, _MuxTunnel at a member), punch
                       sockets, TCP simultaneous open; and the parts of a node that act on
                       them: HolePunch (rules 4-6), RelayServer (a relay's side), RelayClient
                       (a private member's links, the reach check, a dialer's RelayClient.open)
    asyncio node       GossipTCP: the gossip port's TCP side (admission, joins, state transfers,
                       the hellos that make a link, a splice, a dial-back). Node: the sockets,
                       the timer and the lifecycle; it wires the others, and routes messages
    prompt prefixes    what a worker publishes for the ingresses' routing: the hashes of the
                       prompts its engine was sent (PrefixSummary), its engine's speed from the
                       answers it relays (EngineSpeed, SpeedFit), publish_engine_view
    engine supervisor  the engine as a child process, its health, its model list read again
                       (adapters loaded and unloaded while serving, its context window)
    spans              SpanExporter: both roles' spans to an OTLP collector (--otlp-endpoint)
    CLI                keygen, start, relay

A gossip message:
    UDP datagram / TCP frame / relay link frame / punched socket
        ─▶ Wire.open (HMAC, replay window, size) ─▶ Node.deliver ─▶ Overlay.receive(msg, src, now)
    timer ─▶ Overlay.tick(now)                                    ─┘          │
                                                                              ▼
        Node.send: Wire.seal ◀── [Out(addr, msg, tcp)] ◀── messages to send; to a relayed
        address ("relay/<link>") in an envelope through one of its relays (Reach.relays), or
        over the punched UDP path when there is one.
    Node.deliver is the one dispatch, by the table MESSAGE_TYPES: the Overlay's types go to
    Overlay.receive, NAT traversal's to HolePunch and RelayServer; a TCP hello, and an answer
    read on the socket that asked for it, stay with their reader.
    The registry itself is crdt.GMap; liveness and suspicion stay in the Overlay, never in the map.

A request (the ingress dials the node's "addr" from its record):
    direct       TCP to --listen ─▶ Tunnel.admit (caps, TLS, credential) ─▶ its _TunnelConnection's
                 codec reads the head ─▶ forwarded_request_head to the engine (EngineClient's pool)
                 ─▶ the answer passed on as it came (its head re-written by response_head when it
                 holds a hop-by-hop field), its body relayed as it comes, in callbacks
    private      the dialer asks RelayClient.open, which asks Reach.tunnel_path: a punched TCP
                 connection, the member's dial-back, or a relay's splice / mux stream; at the
                 member each is given to Tunnel.admit like an accepted socket, then as above.

This file must never: trust a datagram that fails its HMAC or replay check, let a malformed
message crash the node, put secrets in argv or logs, daemonize, or let the engine outlive it;
do work for a connection beyond bounded frame and head limits before it authenticates, or
relay a message whose tag it has not checked.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import dataclasses
import errno
import functools
import gc
import getpass
import hashlib
import hmac
import http.client
import ipaddress
import itertools
import logging
import math
import operator
import os
import random
import re
import secrets
import shlex
import signal
import socket
import ssl
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from typing import (
    Any,
    Awaitable,
    Callable,
    Container,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

try:
    import h11
except ModuleNotFoundError as exc:   # a bare cluster Python: one line that says what to do
    if exc.name != "h11":
        raise
    sys.exit(f"{os.path.basename(sys.argv[0]) or 'otela'}: this Python ({sys.executable}) lacks the "
             "package h11 (pure Python): run with .venv/bin/python after `make venv`, or "
             "`pip install --user h11`, or put its wheel on PYTHONPATH (README: without pip)")

import crdt

log = logging.getLogger("otela.node")


def install_event_loop() -> bool:
    """Use uvloop when importable (the one place optional accelerators are picked up here). And
    what the imports made (~22,000 objects that live as long as the process) is moved out of the
    collector's reach (gc.freeze): a full collection through them took 3.5 ms, a request's tail."""
    gc.freeze()
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# =============================================================================================
# Config: every setting and timing default, with the reason for the number
# =============================================================================================
DEFAULT_LISTEN = "127.0.0.1:7700"   # TCP: tunnel + GET /v1/registry, /healthz
DEFAULT_GOSSIP = "127.0.0.1:7946"   # UDP gossip (and TCP on the same port for big transfers),
                                    # memberlist's port, so firewall rules people have still fit
INGRESS_GOSSIP = "0.0.0.0:7946"     # the ingress is what nodes on other hosts bootstrap to: it
                                    # gossips on every interface unless told otherwise
TUNNEL_HEADER = "x-otela-tunnel"
PREFIX_HEADER = b"x-otela-prefix"   # the prompt's prefix anchors as the ingress hashed them (PrefixSummary)
ADAPTER_ROUTES = (b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter")   # vLLM's: the model list changes


def knob(default: Any, unit: str, why: str) -> Any:
    """A numeric Config field that is also a flag of its own (`--probe-timeout`) and so a variable
    (OTELA_PROBE_TIMEOUT): its default, its unit and why the default is what it is (its help)."""
    return dataclasses.field(default=default, metadata={"unit": unit, "why": why})


@dataclasses.dataclass
class Config:
    key: bytes = b""
    listen: str = DEFAULT_LISTEN
    gossip: str = DEFAULT_GOSSIP
    bootstrap: List[str] = dataclasses.field(default_factory=list)  # HOST:PORT, file or URL specs
    labels: Dict[str, str] = dataclasses.field(default_factory=dict)
    advertise_listen: str = ""      # what peers should dial when --listen binds 0.0.0.0
    advertise_gossip: str = ""

    # -- failure detection (memberlist's LAN profile, then Lifeguard) --
    probe_interval: float = knob(0.7, "seconds",
        "one probe per member per 0.7 s: ~0.23 KB/s sent, flat in N; some member probes a dead one within "
        "~1 round (P(no probe in a round) = e^-1), so 'suspected' lands ~1.3 s after death")
    probe_timeout: float = knob(0.3, "seconds",
        "the floor: loopback/LAN RTT is < 1 ms; 300 ms absorbs a GC pause or a saturated CPU before we bother "
        "k other members. A member farther away gets its measured round trip + 4 deviations")
    indirect_timeout: float = knob(0.3, "seconds",
        "then k members and the TCP path get as long again (4 hops); across a WAN, as long as their measured "
        "round trips need")
    indirect_checks: int = knob(3, "members",
        "k members asked to probe for us (SWIM/memberlist default)")
    suspicion_mult: float = knob(4.0, "multiple",
        "min grace = mult * log10(N) * probe_interval (memberlist)")
    suspicion_max_mult: float = knob(6.0, "multiple",
        "a lone suspector waits 6x longer (Lifeguard): one sick prober cannot evict a healthy member "
        "quickly")
    max_local_health: int = knob(8, "steps",
        "Lifeguard LHM cap: a stalled node stretches its timeouts 9x")
    stall_threshold: float = knob(0.25, "seconds",
        "a timer this late means *we* were stalled: don't judge others")
    probe_timeout_max: float = knob(1.5, "seconds",
        "a member whose acks come late gets up to this long (twice the slowest recent ack): a lagging "
        "member is not flapped, and a dead one is still suspected within ~2 s")
    nack_after: float = knob(0.8, "share of indirect_timeout",
        "Lifeguard nack: a ping-req helper that got no ack within this share of indirect_timeout says so; "
        "a prober missing nacks knows *it* is the slow one and stretches its own timeouts")
    suspicion_hold_max: float = knob(600.0, "seconds",
        "a member that sees most of the cluster suspected is likely on the small side of a partition (or "
        "sick): it evicts nobody until it sees a majority again or this long has passed")
    suspicion_hold_unreached: float = knob(60.0, "seconds",
        "a suspect that never answered us (forged, or met only across the split) is held at most this long: a "
        "live one evicted rejoins")

    # -- dissemination --
    gossip_fanout: int = knob(4, "peers",
        "peers per push: with push-on-first-receipt, a fraction ~e^-4 (2%) of members misses the first "
        "wave (e^-3 at 3: 5%)")
    gossip_interval: float = knob(0.05, "seconds",
        "retransmit tick, only while a rumour is pending: the 2% the first wave missed get it within ~50 "
        "ms")
    origin_fanout: int = knob(4096, "members",
        "the writer of a change sends it straight to every member up to this many (sealed once): it alone "
        "knows the change for sure, and one hop means no duplicate first-wave copies to open (the cost on "
        "busy hosts). Receivers then send it once more, a tick later, to `gossip_fanout` peers (for loss). "
        "Bigger clusters: a push to `gossip_fanout`, forwarded on. At 400 members a write cost each 2,558 "
        "bytes as a rumour (the old limit, 256) and 326 pushed (tests/bench_registry.py --only fanout); "
        "4,096 datagrams is a ~3 MB burst for the writer")
    retransmit_mult: int = knob(2, "multiple",
        "rounds per rumour = mult * ceil(log10(N+1)); with push on first receipt, 2 is enough and halves "
        "churn traffic")
    push_resend_interval: float = knob(0.15, "seconds",
        "the writer resends its change to members that have not acked it, every 150 ms (LAN RTTs are < 1 "
        "ms; a busy host's loop may lag 100 ms); a member farther away: after its measured round trip + 4 "
        "deviations, so its ack is not beaten by a copy it did not need")
    push_resend_rounds: int = knob(12, "rounds",
        "the writer resends up to this many times: at 20% loss a member still lacks it after k rounds with p = 0.2^k, so 128 "
        "members are all reached in ~1 s, and anti-entropy is the fallback, not the tail")
    push_pull_interval: float = knob(5.0, "seconds",
        "anti-entropy: idle cost is one 100-byte digest per 5 s")
    seed_redial_interval: float = knob(3.0, "seconds",
        "a bootstrap, ingress or relay address with no live member: one digest every ~3 s, so a restarted "
        "ingress is found again within seconds of its start (~50 bytes/s while it is away)")
    lost_redial_max: float = knob(30.0, "seconds",
        "an evicted member's address is re-dialled from 1 s, doubling to this: two halves of a healed "
        "partition find each other")
    lost_forget: float = knob(3600.0, "seconds",
        "an evicted member's address is re-dialled for this long, then forgotten (a job that ended "
        "stays gone)")
    max_remembered: int = knob(1024, "addresses",
        "addresses re-dialled at most: bounded memory and traffic")
    join_warn_after: float = knob(3.0, "seconds",
        "a bootstrap that has not answered in this long is named in the log and on /healthz")
    join_left_age: float = knob(600.0, "seconds",
        "a join answer carries LEFT records only this recent: enough to stop a stale copy resurrecting "
        "them; older ones follow by anti-entropy, bucket by bucket")
    join_answer_rate: float = knob(0.5, "answers per second",
        "full-state join answers per second to one source (an address, an IPv6 /64, or a relayed member): "
        "a joiner asks once, then at join_retry_min..max; a flood of joins gets no more state than this")
    join_answer_burst: int = knob(8, "answers",
        "full-state join answers to one source at once before join_answer_rate applies (eight jobs "
        "starting on one host)")
    join_retry_min: float = knob(1.0, "seconds",
        "the bootstrap retry backoff starts here: a fast first retry")
    join_retry_max: float = knob(30.0, "seconds",
        "the bootstrap retry backoff grows to this: a whole cluster restarting must not hammer one seed")
    compact_interval: float = knob(60.0, "seconds",
        "LEFT compaction check; retention is 15 minutes, so a minute is fine")
    retention: float = knob(crdt.RETENTION_S, "seconds",
        "LEFT records are kept this long, then compacted (crdt.RETENTION_S)")
    state_chunk: int = knob(256 * 1024, "bytes",
        "a full state or anti-entropy answer goes in frames of at most this much (records, ~500 bytes "
        "each): no answer needs a big frame, and a receiver merges a piece at a time")
    accept_keys: List[bytes] = dataclasses.field(default_factory=list)  # older cluster keys still
                                    # accepted while a new one rolls out (cluster.key's later lines)
    ingress_keys: List[bytes] = dataclasses.field(default_factory=list)  # the ingress tier's
                                    # secrets (ingress hosts only; the first signs): see crdt.Authority
    grant: Optional[Dict[str, Any]] = None   # this job's grant from the login node (--grant-file):
    grant_key: bytes = b""          # ... and its key, which binds our records (crdt, "Records bound")
    job_tls: Optional[Tuple[bytes, bytes]] = None   # ... and the tunnel certificate and key it pins

    # -- wire --
    replay_window: float = knob(30.0, "seconds",
        "accepted clock skew; NTP keeps cluster nodes within ms")
    max_datagram: int = knob(8192, "bytes",
        "any single record (<= 2 KB) fits; bigger goes over TCP")
    max_frame: int = knob(32 * 1024 * 1024, "bytes",
        "TCP full state: 10,000 sessions * ~1 KB, with margin")
    tcp_timeout: float = knob(5.0, "seconds",
        "connect + write of one TCP gossip frame")
    nonce_cache: int = knob(200000, "entries",
        "replay cache entries: ~6,000 msgs/s for a whole window (an entry lives until its datagram would "
        "be stale: ~31 s)")
    nonce_cache_per_sender: int = knob(50000, "entries",
        "replay cache entries one sender address holds at most this many (~1,600 msgs/s, far above a member's or a "
        "relay's honest rate): a flooding holder of the key fills its own share, and others' datagrams "
        "still get in (Wire.open)")

    # -- engine supervisor --
    engine_ready_timeout: float = knob(7200.0, "seconds",
        "big models take many minutes to load; 2 h is generous")
    engine_check_interval: float = knob(2.0, "seconds",
        "health checks cost the engine nothing at this rate")
    engine_check_timeout: float = knob(5.0, "seconds",
        "a busy engine still answers /health within seconds")
    engine_models_interval: float = knob(10.0, "seconds",
        "the engine's /v1/models is read again this often, so models and LoRA adapters loaded after it "
        "started are routed within seconds (and at once after a load or unload passed through the tunnel); "
        "engines without /health (llama-cpp-python, whose /v1/models waits behind generations) are read "
        "only after a load or unload")
    engine_check_failures: int = knob(3, "checks",
        "consecutive failures before DOWN: one slow answer under full load is not a dead engine")
    drain_timeout: float = knob(30.0, "seconds",
        "Slurm's default KillWait between SIGTERM and SIGKILL")
    engine_stop_timeout: float = knob(10.0, "seconds",
        "SIGTERM -> SIGKILL grace for the engine")
    leave_linger: float = knob(0.5, "seconds",
        "after LEFT/DOWN, keep gossiping this long so it spreads")
    max_request_body: int = knob(64 * 1024 * 1024, "bytes",
        "tunnelled request bodies (long prompts, images)")

    # -- ports before authentication: a stranger gets no memory, no descriptors, no time --
    max_gossip_connections: int = knob(64, "connections",
        "gossip TCP carries full-state transfers and the third probe path, a handful at a time; strangers "
        "can hold at most 64 * max_datagram (0.5 MiB) before a frame is authentic")
    gossip_auth_timeout: float = knob(2.0, "seconds",
        "a gossip TCP connection's first authentic frame is due this long after it opens: members send it "
        "in their first packet (a lost one is resent within ~1 s); a stranger's 4 bytes are not a reason "
        "to hold a slot for tcp_timeout")
    max_gossip_strangers: int = knob(16, "connections",
        "gossip TCP connections one address (an IPv6 /64) holds before their first authentic frame: a "
        "quarter of the slots, so filling them takes four hosts; a newcomer over it cuts that address's "
        "oldest, and when every slot is taken, a newcomer cuts the oldest stranger: authenticated links "
        "and transfers are never cut for it (a keyless flood cannot shut members out)")
    max_frame_bytes: int = knob(64 * 1024 * 1024, "bytes",
        "frames over max_datagram being read at once, all gossip connections together: two full states in "
        "flight; a big frame over it is refused (its sender retries), so a holder of the key opening "
        "connections does not grow us by max_frame each")
    max_tunnel_connections: int = knob(512, "connections",
        "the ingress keeps <= 128 idle per session plus its streams; 512 stays inside the usual "
        "1,024-descriptor limit, and the one over it gets a 503 error body, not a reset")
    max_unauthenticated: int = knob(64, "connections",
        "tunnel connections not yet past TLS or their credential; a newcomer over this cuts the oldest: "
        "members authenticate within a millisecond, idle strangers never starve them")
    head_timeout: float = knob(10.0, "seconds",
        "TLS handshake and first request head after connecting, a stranger's every head (the ingress's "
        "HEAD_TIMEOUT_S)")
    body_timeout: float = knob(60.0, "seconds",
        "a request body whole after its head: 64 MiB at >= 1 MiB/s")
    tunnel_idle_timeout: float = knob(300.0, "seconds",
        "an authenticated kept-alive connection with no request this long is closed (the ingress "
        "reconnects on demand)")
    # -- NAT traversal and relay --
    reach: str = "auto"                   # auto: a seed's dial-back decides; private: act as if behind
                                          # a NAT (links to relays at once); public: never ask
    relay: bool = True                    # a dialable member relays for private ones (--no-relay: off)
    relay_links: int = knob(2, "links",
        "links a private member keeps: one relay dying is survived")
    relay_check_interval: float = knob(1.0, "seconds",
        "links re-checked each second: a dead relay is replaced in ~1 s")
    relay_link_timeout: float = knob(10.0, "seconds",
        "a relay link that gets nothing acked this long is dead (TCP_USER_TIMEOUT; idle: keepalive probes): "
        "the kernel alone retries ~15 min while a private member's gossip goes into it. 10 s rides out 4 "
        "RTO doublings on a 300 ms path at loss (2 % loss: 4 losses in a row, 1 in 6 million), and is "
        "within Lifeguard's grace (2.8-16.8 s): the member links again and refutes, or at worst rejoins, "
        "in seconds. The floor: a link whose peer is measured farther gets 16 x its srtt + 4 rttvar "
        "(Reach.link_timeout)")
    dialback_timeout: float = knob(1.0, "seconds",
        "a seed's dial-back connect: LAN/WAN connects take < 100 ms")
    splice_timeout: float = knob(5.0, "seconds",
        "a private member's dial-back for a relayed tunnel stream")
    max_relay_links: int = knob(1024, "links",
        "private members one relay serves (one descriptor each)")
    relay_mux: int = knob(1, "0 or 1",
        "1: tunnel streams multiplexed on the member's link; 0: a dial-back connection per stream, spliced "
        "(rule 2); at a relay: whether it offers streams; at a member: whether its links take them (both "
        "1: streams), so one lab runs both")
    max_link_streams: int = knob(256, "streams",
        "tunnel streams on one link at once (an OPEN over it gets a CLOSE): each a tunnel connection at "
        "the member, so two links fill its max_tunnel_connections (512); the ingress keeps <= 128 idle per "
        "session plus its streams in flight")
    punch_timeout: float = knob(1.5, "seconds",
        "probes every 50 ms for 1.5 s: a cone NAT opens in 2 RTTs")
    punch_delay: float = knob(0.3, "seconds",
        "the side that sends second waits this long, so the first side's NAT has its mapping before any "
        "packet reaches it (a leaky gateway remaps a port an early packet touched)")
    punch_retry: float = knob(30.0, "seconds",
        "a pair that failed is tried again after this: the UDP conntrack timeout, so stale entries are "
        "gone")
    punch_idle: float = knob(10.0, "seconds",
        "a punched path silent this long falls back to the relay")
    punch_keepalive: float = knob(3.0, "seconds",
        "a probe on each punched path: NAT mappings live >= 30 s")
    max_punched: int = knob(32, "paths",
        "punched paths (one UDP socket each): bounded descriptors")
    tunnel_punch_timeout: float = knob(1.0, "seconds",
        "a TCP simultaneous open, mapping to connection: a cone NAT connects in ~1 relay RTT + "
        "punch_delay; under 1 s leaves 2 s of the ingress's 3 s connect deadline for the relay's splice")
    tunnel_syn_interval: float = knob(0.2, "seconds",
        "a fresh SYN this often (Linux resends one only after 1 s): a SYN dropped or reset by the peer's "
        "NAT is soon replaced")
    tunnel_reply_margin: float = knob(0.05, "seconds",
        "the dialer sending second in a kept order waits this, not punch_delay: the member connects as it "
        "sends its mapping, which came through the relay, so its SYN has left. NAT lab, a leaky gateway at "
        "the dialer: 20 ms failed 4 of 7, 50 ms 0 of 8")
    punched_tcp_timeout: float = knob(5.0, "seconds",
        "a punched tunnel connection that gets nothing acked this long is dead (TCP_USER_TIMEOUT, "
        "keepalive when idle): TCP alone waits ~15 min (tcp_retries2); 5 s rides out ~4 RTO doublings of a "
        "lossy WAN path before the request moves on")
    tls_cert: str = ""                    # the cluster certificate (keygen's cluster.crt): with it the
    tls_key: str = ""                     # tunnel is mutual TLS; without, plain HTTP (said loudly)

    @property
    def gossip_addr(self) -> str:
        return self.advertise_gossip or advertise(self.gossip)

    @property
    def listen_addr(self) -> str:
        return self.advertise_listen or advertise(self.listen)


KNOBS = tuple(f for f in dataclasses.fields(Config) if "unit" in f.metadata)   # the numeric settings
# knobs that act only where an engine is wrapped (`start`) or a tunnel port is served (`start`, `relay`)
ENGINE_KNOBS = ("engine_ready_timeout", "engine_check_interval", "engine_models_interval", "engine_check_timeout",
                "engine_check_failures", "drain_timeout", "engine_stop_timeout")
TUNNEL_KNOBS = ("max_request_body", "max_tunnel_connections", "max_unauthenticated", "head_timeout",
                "body_timeout", "tunnel_idle_timeout")


def number_arg(kind: type, positive: bool = False) -> Callable[[str], Any]:
    """An argparse type: a `kind` (int or float) that is >= 0, or > 0 when `positive` (every role's
    numeric flags, the ingress's limits among them)."""
    def number(value: str) -> Any:
        parsed = kind(value)
        if not (parsed > 0 if positive else parsed >= 0):
            raise argparse.ArgumentTypeError(f"{value} is not > 0" if positive else f"{value} is negative")
        return parsed
    number.__name__ = kind.__name__   # argparse names the type in its messages
    return number


def add_knob_args(parser: argparse.ArgumentParser, skip: Tuple[str, ...] = ()) -> None:
    """Every knob but those in `skip` as a flag (each also its OTELA_<NAME>, crdt.parse_settings):
    the group "tuning" of `start`, `relay` and the ingress's `serve`."""
    g = parser.add_argument_group("tuning", "the overlay's numbers, each with its reason: change them "
                                  "for a WAN, a lab or a test")
    for f in KNOBS:
        if f.name not in skip:
            g.add_argument("--" + f.name.replace("_", "-"), type=number_arg(int if f.type == "int" else float),
                           default=None, metavar=f.metadata["unit"].split()[0].upper(),
                           help=f"{f.metadata['why']} ({f.metadata['unit']}; default "
                                f"{f.default:,})".replace("%", "%%"))


def tuned(config: Config, args: argparse.Namespace) -> Config:
    """`config` with the knobs `args` holds (add_knob_args' flags, or their variables)."""
    for f in KNOBS:
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(config, f.name, value)
    return config


def config_from_env(config: Config, env: Optional[Mapping[str, str]] = None) -> Config:
    """`config` with the knobs set as OTELA_<NAME> in `env` (os.environ): what a test or a bench
    that builds its Config in-process reads, by the same reader as the flags. Raises ConfigError."""
    parser = argparse.ArgumentParser(add_help=False)
    add_knob_args(parser)
    try:
        return tuned(config, crdt.parse_settings(parser, [], None, os.environ if env is None else env))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def own_address(host: str) -> bool:
    """Whether `host` (an IP address) is one of this host's own: a socket can bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def split_addr(addr: str) -> Tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT (port 0-65535)")
    return host.strip("[]"), int(port)


def address_group(host: str) -> str:
    """What one client "address" is for per-address caps: an IPv4 address, or an IPv6 /64 (one
    host is given a whole /64, so its addresses are one client's)."""
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


def advertise(addr: str) -> str:
    host, port = split_addr(addr)
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{host}:{port}"


class ConfigError(ValueError):
    """A bad setting given by the user; the CLI prints it on one line and exits 2."""


def load_key(path: str) -> bytes:
    """Read the cluster secret written by `keygen` (64 hex chars); refuse group/world access.
    A file of several lines is a rotation: the first line is the key, see load_secrets."""
    return load_secrets(path)[0]


def job_end(env: Dict[str, str], grant: Optional[Dict[str, Any]]) -> Optional[float]:
    """When this job ends (unix time): Slurm's SLURM_JOB_END_TIME (set in jobs by Slurm 23.02 and
    later, by sbatch/node.sh from squeue before), or its grant's end, whichever comes first; None
    when neither says."""
    ends = []
    try:
        ends.append(float(env["SLURM_JOB_END_TIME"]))
    except (KeyError, ValueError):
        pass
    if grant is not None:
        ends.append(float(grant["until"]))
    return min(ends) if ends else None


def load_grant(path: str) -> Tuple[Dict[str, Any], bytes, Optional[Tuple[bytes, bytes]]]:
    """This job's grant, its key and its tunnel certificate and key (None for a grant that pins
    none), from the file `otela_ingress.py grant` wrote (a JSON object {"grant": {...}, "key":
    "<64 hex>", "cert": PEM, "tls_key": PEM}); refuses a file others can read, as a key file."""
    try:
        data = crdt.loads(_read_private(path, "grant", 64 * 1024))
    except ValueError:
        raise ConfigError(f"grant {path} is not JSON: write it with `otela_ingress.py grant`") from None
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        raise ConfigError(f"grant {path} has no key: write it with `otela_ingress.py grant`")
    try:
        crdt.check_grant(data.get("grant"), f"grant {path}")
        key = bytes.fromhex(data["key"])
    except crdt.RecordError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError:
        raise ConfigError(f"grant {path}: key must be hex") from None
    if len(key) != 32 or "mac" not in data["grant"]:
        raise ConfigError(f"grant {path}: key must be 64 hex digits and the grant signed (mac)")
    return data["grant"], key, _pinned_tls(path, data)


def _pinned_tls(path: str, data: Dict[str, Any]) -> Optional[Tuple[bytes, bytes]]:
    """A grant file's tunnel certificate and key, checked against the grant's pin (None: no pin)."""
    pin = data["grant"].get("tls")
    if pin is None:
        return None
    cert, tls_key = data.get("cert"), data.get("tls_key")
    if not isinstance(cert, str) or not isinstance(tls_key, str):
        raise ConfigError(f"grant {path} pins a tunnel certificate but holds none (cert, tls_key)")
    try:
        if certificate_fingerprint(cert) != pin:
            raise ConfigError(f"grant {path}: its certificate is not the one the grant pins")
    except ValueError:
        raise ConfigError(f"grant {path}: cert is not a PEM certificate") from None
    return cert.encode(), tls_key.encode()


def _read_private(path: str, what: str, limit: int = -1) -> bytes:
    """A secret file's bytes (at most `limit`); refuses a file others can read. Raises ConfigError."""
    try:
        st = os.stat(path)
        with open(path, "rb") as fh:
            data = fh.read(limit)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what} {path} is accessible by others (mode {stat.S_IMODE(st.st_mode):o});"
                          f" run chmod 600 {path}")
    return data


def load_secrets(path: str, what: str = "cluster key") -> List[bytes]:
    """Every secret in a key file written by `keygen`, one per line (64 hex chars): the first is
    the one this member seals (or signs) with, all of them are accepted (rotation). Refuses a
    file others can read."""
    if not path:
        raise ConfigError(f"no {what}: pass --key-file or set OTELA_KEY_FILE (make one with keygen)")
    raw = _read_private(path, what).strip()
    lines = [line.strip() for line in raw.splitlines() if line.strip()] or [b""]
    secrets_ = []
    for line in lines:
        try:
            key = bytes.fromhex(line.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            key = line if len(lines) == 1 else b""   # one line may be any bytes (older files)
        if len(key) < 16:
            raise ConfigError(f"{what} {path} is too short: need at least 16 bytes a line (use keygen)")
        secrets_.append(key)
    return secrets_


# =============================================================================================
# Wire format
# =============================================================================================
# Every datagram (and every TCP frame body) is
#
#     magic "o1" (2) | unix time, seconds (uint32) | nonce (8 random bytes) | JSON body | tag (32)
#
# tag = HMAC-SHA256(cluster key, everything before it). A datagram is dropped, and counted, if
# it is oversized, too short, forged (tag mismatch), stale (time outside the replay window),
# replayed (nonce seen within the window), flooded (new, but its sender's share of the replay
# cache is full: see Wire) or malformed (body not a JSON object with a known
# "t"). TCP frames are a 4-byte big-endian length followed by the same sealed bytes; a message
# sent over TCP carries "ra", the sender's gossip address, which the receiver uses as `src`
# (the TCP source port is ephemeral).
MAGIC = b"o1"
_HEAD = struct.Struct(">2sI8s")
TAG_LEN = 32
ENVELOPE = _HEAD.size + TAG_LEN     # 46 bytes of overhead per message
DROP_REASONS = ("oversized", "truncated", "forged", "stale", "replayed", "malformed",
                "flooded")                  # authentic and new, but its sender's replay cache share is full
FLOODERS_NAMED = 64                 # senders whose "flooded" drops are counted by name (then "other")


class Wire:
    """Seal and open messages. The replay cache holds each accepted nonce until its datagram
    would be stale anyway, with the sender that brought it: one sender address holds at most
    nonce_cache_per_sender entries, and once the whole cache (nonce_cache) is full only senders
    holding less than the average share get in (to at most twice it), so a holder of the key
    flooding from a few addresses fills their own shares, not everyone's. A nonce is looked up
    in the whole cache: a datagram replayed from another address is still a replay."""

    def __init__(self, key: bytes, config: Config):
        if not key:
            raise ConfigError("the overlay needs a cluster key")
        self._key = key
        self._keys = [key] + [k for k in config.accept_keys if k != key]   # rotation: seal with the
                                                                            # first, accept any
        self.window = config.replay_window
        self.max_datagram = config.max_datagram
        self.max_frame = config.max_frame
        self.cache_limit = config.nonce_cache
        self.sender_limit = config.nonce_cache_per_sender
        self._nonces: Dict[bytes, Tuple[float, str]] = {}   # nonce -> (when it may go, its sender)
        self._held: Dict[str, int] = {}                     # sender -> its nonces in the cache
        self._names: Dict[str, str] = {}                    # sender -> the one copy of its name kept
        self._next_prune = self._pruned = 0.0
        self.dropped = collections.Counter({r: 0 for r in DROP_REASONS})
        self.flooders: collections.Counter = collections.Counter()   # sender -> datagrams "flooded"
        self.accepted = 0

    def seal(self, msg: Dict[str, Any], now: float) -> bytes:
        head = _HEAD.pack(MAGIC, int(now) & 0xFFFFFFFF, os.urandom(8))
        data = head + crdt.dumps(msg)
        return data + hmac.new(self._key, data, hashlib.sha256).digest()

    def authentic(self, data: bytes, limit: int) -> bool:
        """Whether `data` carries a valid tag (a relay's check before forwarding: the nonce is
        left for the final receiver). A forgery is counted."""
        if len(data) > limit or len(data) < ENVELOPE + 2 or data[:2] != MAGIC:
            self.dropped["forged"] += 1
            return False
        if not self._tag_ok(data[:-TAG_LEN], data[-TAG_LEN:]):
            self.dropped["forged"] += 1
            return False
        return True

    def _tag_ok(self, body: bytes, tag: bytes) -> bool:
        return any(hmac.compare_digest(hmac.new(k, body, hashlib.sha256).digest(), tag) for k in self._keys)

    def open(self, data: bytes, now: float, tcp: bool = False, sender: str = "") -> Optional[Dict[str, Any]]:
        """The message inside `data`, or None (counted in `dropped`). `sender`: the address it
        came from (its share of the replay cache)."""
        if len(data) > (self.max_frame if tcp else self.max_datagram):
            return self._drop("oversized")
        if len(data) < ENVELOPE + 2 or data[:2] != MAGIC:
            return self._drop("truncated")
        body, tag = data[:-TAG_LEN], data[-TAG_LEN:]
        if not self._tag_ok(body, tag):
            return self._drop("forged")
        why = self._first_sight(body, now, sender)
        if why:
            return self._drop(why)
        try:
            msg = crdt.loads(body[_HEAD.size:])
        except ValueError:
            return self._drop("malformed")
        if not isinstance(msg, dict) or msg.get("t") not in MESSAGE_TYPES:
            return self._drop("malformed")
        self.accepted += 1
        return msg

    def _first_sight(self, body: bytes, now: float, sender: str) -> str:
        """Why an authentic envelope is refused by the replay cache ("stale", "replayed",
        "flooded"), or "" when it is new (its nonce then held until it is stale anyway)."""
        _, sent, nonce = _HEAD.unpack_from(body)
        if abs(now - sent) > self.window + 1:
            return "stale"
        if nonce in self._nonces:
            return "replayed"
        if now >= self._next_prune or (len(self._nonces) >= self.cache_limit and now >= self._pruned + 1.0):
            self._prune(now)                # full: at most once a second, not once per datagram
        sender = self._names.setdefault(sender, sender)   # one string per sender, not per entry
        held = self._held.get(sender, 0)
        if held >= self.sender_limit or (len(self._nonces) >= self.cache_limit and (
                held * len(self._held) >= len(self._nonces) or len(self._nonces) >= 2 * self.cache_limit)):
            named = sender in self.flooders or len(self.flooders) < FLOODERS_NAMED
            self.flooders[sender if named else "other"] += 1
            return "flooded"                # refuse, don't grow: its sender's share is full
        self._nonces[nonce] = (sent + self.window + 2, sender)   # stale after that: no replay to fear
        self._held[sender] = held + 1
        return ""

    def _prune(self, now: float) -> None:
        self._nonces = {n: kept for n, kept in self._nonces.items() if kept[0] > now}
        held: Dict[str, int] = {}
        for _, sender in self._nonces.values():
            held[sender] = held.get(sender, 0) + 1
        self._held = held
        self._names = {sender: sender for sender in held}
        self._pruned, self._next_prune = now, now + self.window

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        return None


# Message types ("t"): short names, because idle traffic is mostly pings and acks. Each row names
# the part of a node that handles the type, and that part's method:
#   overlay       Overlay.receive calls it (msg, src, now, tcp): sans-IO
#   gossip_tcp, relay_server, punch   Node.deliver calls it (msg, src, via: where it came in)
#   path, reader  never routed: read by the punched socket it arrives on (_PunchSocket: answers to
#                 what it asked, its probes), or on the connection that asked / by the reader named
# Node wires the routed rows into one table (Node.routes) and Node.deliver dispatches there alone;
# a join is the Overlay's, its answer sent only where it came from (GossipTCP.answer_join).


class MessageType:
    """A row of MESSAGE_TYPES: the fields, the part that handles it, that part's handler, and
    whether anyone may send it (no "ra" sender, no membership: a reach check precedes a join)."""

    __slots__ = ("fields", "part", "handler", "anyone")

    def __init__(self, fields: str, part: str, handler: str, anyone: bool = False):
        self.fields, self.part, self.handler, self.anyone = fields, part, handler, anyone


MESSAGE_TYPES = {
    "p":  MessageType("n seq, to sid[:8], sv?", "overlay", "_on_p"),
    #     ping (direct probe; over TCP the third probe path); sv: "you are suspected at this version"
    "a":  MessageType("n seq", "overlay", "_on_a"),                  # ack of ping n
    "i":  MessageType("n seq, to sid[:8], a", "overlay", "_on_i"),   # ping-req: probe address a for me
    "n":  MessageType("n seq", "overlay", "_on_n"),                  # nack of ping-req n: no answer
    "r":  MessageType("r {sid: record}, s [[sid, version, by]], vo?, k?", "overlay", "_on_r"),
    #     rumours: records and suspicions; vo [[sid, version, by, voucher]]: the vouchers of confirmers
    #     in s (crdt, "The end of a session"); k: the writer's push id, to be acked
    "k":  MessageType("k push id", "overlay", "_on_k"),              # ack of a push: stop resending it
    "j":  MessageType("r {sid: record}", "overlay", "_on_j"),        # join: my record; answer: all state
    "st": MessageType("r {sid: record}", "overlay", "_on_st"),       # state to merge (join answer, push-pull)
    "d":  MessageType("d {n, root}, di?, s?", "overlay", "_on_d"),
    #     push-pull 1: my digest root (and my suspicions); di: the ingress plane's (between ingresses)
    "db": MessageType("d {n, root, b}, pl?", "overlay", "_on_db"),
    #     push-pull 2: roots differ, my bucket hashes (pl "i": the ingress plane's; none: routing's)
    "dr": MessageType("r {sid: record}, d, pl?", "overlay", "_on_dr"),
    #     push-pull 3: what you lack, and my buckets (the rest of what you lack follows in "st" pieces)
    "h":  MessageType("link?, splice?, accept?, dial?", "reader", "GossipTCP._hello"),
    #     TCP hello: the one frame after it may be up to max_frame (others max_datagram); link: a private
    #     member's relay link; splice: a tunnel stream to that link; dial (relay->member, read by
    #     RelayClient._read_link)/accept: its dial-back
    "rq": MessageType("n, a?", "relay_server", "_on_reach", anyone=True),
    #     reachability: dial me back at gossip address a (TCP); no a: only say where you see me
    "rs": MessageType("n, seen, back, relaying?, relays?", "reader", "RelayClient.ask_reach"),
    #     its answer on the asking connection (also HolePunch._tcp_mapping): the address seen, whether
    #     the dial worked, whether it relays, the relays it knows (gossip addresses)
    "ob": MessageType("n", "punch", "_on_observe"),                 # UDP: where do you see my socket?
    "os": MessageType("n, seen", "path", "_on_seen"),               # its answer (a punch socket's mapping)
    "pq": MessageType("a, seen, first", "punch", "_on_punch_request"),
    #     punch request (relayed): my socket is seen at `seen`; first: you send first (attempt a)
    "pr": MessageType("a, seen", "punch", "_on_reply"),             # punch reply (relayed): mine at `seen`
    "pp": MessageType("", "path", "_on_probe"),                     # punch probe, at the peer's mapping
    "pa": MessageType("", "path", "_on_probe_ack"),                 # your probe arrived: both ways work
    "tq": MessageType("n, seen, first", "punch", "_on_tunnel_punch"),
    #     tunnel punch request (relayed): connect to my TCP mapping `seen` now (first: you send the
    #     first SYN); token n
    "tr": MessageType("n, seen", "punch", "_on_reply"),             # tunnel punch reply: connect to mine
}


class Via:
    """Where a routed message came in (Node.deliver): over TCP (a connection, a link, an
    envelope) or a datagram; `peer`: the IP address or "relay/<link>" it came from (a join's
    answer goes only there; None: read on a join's own connection); `conn`: the TCP connection
    it came on, where a reach check or a join ("rc") is answered."""

    __slots__ = ("tcp", "peer", "conn")

    def __init__(self, tcp: bool, peer: Optional[str] = None, conn: Optional[_Stream] = None):
        self.tcp, self.peer, self.conn = tcp, peer, conn


def _suspicions(msg: Dict[str, Any]) -> List[list]:
    """The [sid, version, by] suspicions a message carries, checked; ValueError if malformed."""
    items = msg.get("s") or []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and type(item[1]) is int and isinstance(item[2], str)):
            raise ValueError("bad suspicion")
    return items


def _vouchers(msg: Dict[str, Any]) -> List[list]:
    """The [sid, version, by, voucher] a message carries beside its suspicions ("vo"), at most
    one per suspicion; a malformed one is skipped (a later release may say more), not fatal."""
    items = msg.get("vo")
    if not isinstance(items, list):
        return []
    return [item for item in items[: Overlay.MAX_SUSPICIONS]
            if isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and type(item[1]) is int
            and isinstance(item[2], str) and crdt.is_voucher(item[3])]


SHORT_ID = 8                        # hex chars of a session id in pings: 32 bits tell apart
                                    # sessions sharing one address; a full id adds 24 bytes/probe


# =============================================================================================
# Dissemination and failure detection: the sans-IO Overlay
# =============================================================================================
# Theory of operation. Each member holds the registry (crdt.GMap) and a local, unreplicated
# view of liveness. Rules:
#   1. A change to the map (own write, eviction, or a merge that changed something) becomes a
#      rumour: pushed at once to `gossip_fanout` random peers, then retransmitted on the gossip
#      tick a bounded number of times. Every 5 s push-pull anti-entropy with one random peer
#      compares digest roots and sends only the differing buckets, repairing what rumours missed.
#   2. Each probe round checks one member (round-robin over a shuffled list) along three
#      independent paths; only when all fail is the member suspected. Suspicion is gossiped but
#      never written into the map; the suspect refutes by bumping its record version. A
#      suspicion that outlives its grace (Lifeguard: shrinking from max to min as independent
#      confirmations arrive, min growing with log N) becomes LEFT, written by the member whose
#      timer fired (evicted_by). A member that finds its own live session evicted rejoins as a
#      new session.
#   3. Two planes (crdt.PLANES). The routing plane (sessions) is every member's; the ingress
#      plane (API keys, usage) is only the ingresses': its writer pushes it to the members whose
#      session record proves the ingress tier (crdt.Authority), nobody forwards it, push-pull
#      compares it only between two such members ("di", "pl"), and a record of it that the
#      tier did not sign is dropped and counted (`refused`). A worker never holds it.
#   4. State moves in pieces: a join answer or an anti-entropy answer is split into messages
#      of at most `state_chunk` bytes of records, each merged on its own (a set, not a list:
#      linear in what arrives).
#
# The probe round as a table: phase, its deadline after the round starts, and what happens at
# the deadline if no ack (from any path) has arrived. Deadlines scale with (1 + local health).
#   phase       deadline (sum of config fields)      on deadline without an ack
PROBE_ROUND = (
    ("direct",   ("probe_timeout",),                   "indirect"),  # ping-req via k members + TCP ping
    ("indirect", ("probe_timeout", "indirect_timeout"), "suspect"),  # all three paths failed
)

Out = collections.namedtuple("Out", "addr msg tcp")
# A rumour queued for gossip (Overlay.rumours): a record ("r", sid) or a suspicion of sid by a
# confirmer ("s", sid, by); a tuple, as it keys the queue.
Rumour = collections.namedtuple("Rumour", "kind sid by", defaults=("",))


SEED_ROLES = ("ingress", "relay")   # members others bootstrap to: their addresses are kept for good
LATER = "later"                     # _changed(push=LATER): queue for one retransmit, no push now


class Redial:
    """An address dialled again while no live member is there (Overlay.remember): when next, the
    backoff, since when, and whether it is a seed (dialled for good)."""

    __slots__ = ("due", "backoff", "since", "seed")

    def __init__(self, due: float, backoff: float, since: float, seed: bool):
        self.due, self.backoff, self.since, self.seed = due, backoff, since, seed


class Known:
    """What we hold of a session, to tell a copy (or an older record) from news before it is
    validated: its state and version, and the record itself."""

    __slots__ = ("state", "version", "record")

    def __init__(self, record: Dict[str, Any]):
        self.state, self.version, self.record = record["state"], record["version"], record


class PingReq:
    """A ping-req we are carrying out for another member (FailureDetector._on_i): who asked and
    its probe's seq, when we forget it (a late ack still counts until then), and when we nack
    it (inf once sent)."""

    __slots__ = ("requester", "seq", "expiry", "nack_at")

    def __init__(self, requester: str, seq: int, expiry: float, nack_at: float):
        self.requester, self.seq, self.expiry, self.nack_at = requester, seq, expiry, nack_at


class LateProbe:
    """A recent probe of ours, kept after its round so that its late ack is still evidence."""

    __slots__ = ("sid", "start")

    def __init__(self, sid: str, start: float):
        self.sid, self.start = sid, start


class Suspicion:
    __slots__ = ("version", "since", "began", "confirmers", "deadline", "held", "vouchers")

    def __init__(self, version: int, since: float, by: str):
        self.version = version
        self.since = self.began = since             # (since restarts after a hold; began never)
        self.confirmers = {by}
        self.deadline = math.inf
        self.held = False                           # eviction held back (see FailureDetector._evict)
        self.vouchers: Dict[str, tuple] = {}        # confirmer -> (version, its voucher): crdt,
                                                    # "The end of a session"


class RoundTrip:
    """One peer's measured round trip, estimated as TCP estimates its own (RFC 6298, Jacobson and
    Karels): a smoothed mean `srtt` and a smoothed mean deviation `rttvar` of its acks' delays, so
    that `srtt + 4 rttvar` (`timeout`) is rarely beaten by an ack that is merely slow. A peer on
    loopback keeps a timeout of a few ms (today's floors rule); one 150 ms away with jitter gets
    its RTT plus four deviations. Samples come from direct acks only (a ping-req's relayed ack
    measures three legs, not this path)."""

    __slots__ = ("srtt", "rttvar")

    GAIN = 0.125                    # RFC 6298's alpha: the mean follows ~8 samples (we probe a
                                    # given peer about once in N-1 rounds); a rise shows at its
                                    # first slow ack through rttvar (and 2 x the slowest ack)
    VAR_GAIN = 0.25                 # RFC 6298's beta: the deviation reacts faster than the mean
    DEVIATIONS = 4                  # RFC 6298's K: a timeout four deviations above the mean

    def __init__(self, sample: float):
        self.srtt = sample
        self.rttvar = sample / 2                    # RFC 6298: one sample says little of the spread

    def add(self, sample: float) -> None:
        self.rttvar += self.VAR_GAIN * (abs(self.srtt - sample) - self.rttvar)
        self.srtt += self.GAIN * (sample - self.srtt)

    def timeout(self) -> float:
        return self.srtt + self.DEVIATIONS * self.rttvar


class FailureDetector:
    """The failure detector's half of an Overlay (SWIM probes over three paths, Lifeguard
    suspicion, evictions with their evidence). It owns the liveness state: `members` (the
    Overlay keeps it in step with the map through `_track_member` and `_untrack_member`),
    `suspects`, `probe`, `lhm` (local health), `late`. Overlay is the only class built on it,
    and provides it this narrow interface:
        sid, cfg, rng, leaving     our session id, the settings, the random source, leaving
        record_of(sid)             a session's record in the map (None if unknown)
        own_version()              the version of our own record
        update(now, **fields)      an owner write of our record (a refutation, with our lhm)
        digest_to(addr)            an anti-entropy opening to `addr`
        _rumour(keys, now, src)    gossip suspicions
        _notify(sid, record)       a change of suspicion, to the listeners
        _write_eviction(sid, record, now)  our LEFT for another session, merged and pushed
        _voucher(sid, version)     our word that we suspected `sid` at `version`

    Timeouts that follow the round trip. Each member's direct acks are samples of its round trip
    (RoundTrip: srtt and rttvar, as TCP's RTO), and every wait is the setting or the measure,
    whichever is longer, so a LAN keeps the settings' fast detection and a WAN peer is not
    judged before its answer could be back:
        direct probe     max(probe_timeout, srtt + 4 rttvar, 2 x its slowest recent ack), at most
                         probe_timeout_max
        indirect phase   max(indirect_timeout, the slowest of its paths: the TCP ping's two round
                         trips, and per helper its round trip twice plus the target's), at most
                         2 x probe_timeout_max
        helper's nack    max(nack_after x indirect_timeout, the target's srtt + 4 rttvar)
        suspicion grace  Lifeguard's, its minimum plus 4 of the suspect's srtt + 4 rttvar (the
                         rumour to it and its refutation back, twice)
    Bounds, default settings, 9 members (tests/test_wan_overlay.py, simulated, 160 runs): a
    killed member is suspected within 2 s and LEFT at every member within 4.75 s on a LAN (as
    with fixed timeouts); across three sites 150 ms apart with 2 % loss, within 4 s and 7.85 s
    (p50 1.45 s and 5.1 s), and no live member is suspected in 30 minutes, nor at 300 ms and
    5 % (fixed timeouts: 1 and 597 suspicions, each refuted). A member answering late stretches
    its own timeouts at most to probe_timeout_max, 2 x that for the indirect phase, and 4 x that
    more grace. A private member's relay link is dropped when its relay is suspected, so the
    links follow the same timeouts.

    Outside the detector, two more waits for an answer follow the same estimate (`_rto`):
        writer's resend  max(push_resend_interval x (1 + lhm), the member's srtt + 4 rttvar)
                         per member (Overlay._resend_wait): at 150 ms a far member got each
                         write 1.7 times (2.6 at 300 ms), now once when nothing is lost
        relay link       TCP_USER_TIMEOUT and keepalive: max(relay_link_timeout, 16 x the
                         peer's srtt + 4 rttvar), at both ends (Reach.link_timeout)
    And these do not, on purpose: probe_interval (it sets how soon a death is noticed, and a
    probe round already waits out its target's round trip before the next begins);
    gossip_interval (a receiver's blind retransmits of a rumour to random peers, against loss,
    no answer awaited); push_pull_interval and seed_redial_interval (seconds, far above any
    round trip; an exchange in flight is not timed by them); punch and tunnel timings (a punch
    has no measured round trip yet: it is what would measure one)."""

    def __init__(self, config: Config, rng: random.Random, now: float, replay: bool = False):
        self.members: Dict[str, str] = {}          # live or draining sid -> gossip address
        self.ring: Optional[List[str]] = None       # sorted sids, self included: probe schedule
        self.hinted: Dict[str, float] = {}          # addr -> when we last answered a stray ping
        self.suspects: Dict[str, Suspicion] = {}
        self.evictions: collections.deque = collections.deque()   # when members were evicted
        self.retired: Dict[str, float] = {}         # sessions we evicted -> when (bounded)
        self.lhm = 0                                # Lifeguard local health multiplier
        self.seq = 0                                # the Overlay's push ids (acked by their receiver only)
        # Probe and ping-req numbers: an ack names the probe it answers, and counts for the member
        # probed whoever sends it (a ping-req's helper does), so a number another key holder could
        # guess would let it keep a dead member alive or make a far one look near (locality reads
        # these round trips). Drawn at random, 53 bits (JSON's exact integers); the simulator's runs
        # replay, so they count there.
        self.numbers = itertools.count(1).__next__ if replay else lambda: secrets.randbits(53)
        self.probe: Optional[dict] = None
        self.relays: Dict[int, PingReq] = {}        # our seq -> the ping-req we carry out
        self.late: Dict[int, LateProbe] = {}        # recent probe seq -> it: late acks
        self.slow: Dict[str, float] = {}            # sid -> its slowest recent ack, decaying
        self.round_trips: Dict[str, RoundTrip] = {} # sid -> its measured round trip (direct acks)
        self.next_probe = now + rng.uniform(0, config.probe_interval)

    # -- queries ----------------------------------------------------------------------------
    def is_suspected(self, sid: str) -> bool:
        return sid in self.suspects

    def rtt(self, sid: str) -> Optional[float]:
        """`sid`'s smoothed round trip in seconds as our probes measured it (direct acks), None
        before its first ack: for routing, which weighs a path's RTT, and for the timeouts here."""
        measured = self.round_trips.get(sid)
        return None if measured is None else measured.srtt

    def _rto(self, sid: str, unknown: float = 0.0) -> float:
        """How long an ack from `sid` may take before it is late (srtt + 4 rttvar), unclamped;
        `unknown` for a peer never measured."""
        measured = self.round_trips.get(sid)
        return unknown if measured is None else measured.timeout()

    # -- the timer (Overlay.tick, Overlay.next_wakeup) -----------------------------------------
    def _detect(self, now: float) -> List[Out]:
        """The probe round, the ping-reqs we carry out, and the suspicions, as far as they are due."""
        out: List[Out] = []
        if self.probe is not None and now >= self.probe["deadline"]:
            out += self._advance_probe(now)
        if self.probe is None and now >= self.next_probe and not self.leaving:
            out += self._start_probe(now)
        if self.relays:
            out += self._nacks(now)
        for sid in [s for s, sus in self.suspects.items() if now >= sus.deadline]:
            out += self._evict(sid, now)
        return out

    def _detector_wakeups(self) -> List[float]:
        times = [s.deadline for s in self.suspects.values()]
        if self.probe is not None:
            times.append(self.probe["deadline"])
        elif self.members and not self.leaving:
            times.append(self.next_probe)
        if self.relays:
            times.append(min(r.nack_at for r in self.relays.values()))
        return times

    def _compact_detector(self, now: float) -> None:
        """Forget late probes, stray pings answered and slow acks of members gone."""
        cfg = self.cfg
        horizon = now - 10 * cfg.probe_timeout_max
        self.late = {n: p for n, p in self.late.items() if p.start > horizon}
        self.hinted = {a: t for a, t in self.hinted.items() if t > now - cfg.push_pull_interval}
        self.slow = {sid: v for sid, v in self.slow.items() if sid in self.members}
        self.round_trips = {sid: v for sid, v in self.round_trips.items() if sid in self.members}

    def _stop_probing(self) -> None:
        """We leave: no probe round is finished or started."""
        self.probe = None

    def _new_session(self) -> None:
        """Our session id changed: the probe ring is rebuilt around it."""
        self.ring = None

    # -- membership, as the Overlay's map says ----------------------------------------------
    def _track_member(self, sid: str, addr: str) -> bool:
        """`sid` is live at `addr`: True when it was not a member there before."""
        if self.members.get(sid) == addr:
            return False
        self.members[sid] = addr
        self.ring = None
        return True

    def _untrack_member(self, sid: str, evicted: bool, now: float) -> Optional[str]:
        """`sid` is no longer live (`evicted`: by a failure detector); its address, None if it
        was not a member."""
        addr = self.members.pop(sid, None)
        if addr is not None:
            self.ring = None
            if evicted:
                self.evictions.append(now)
        return addr

    # -- message handlers -------------------------------------------------------------------
    def _on_p(self, msg, src, now, tcp):
        if self.leaving:
            return []
        if msg["to"] != self.sid[:SHORT_ID]:
            # An old session at this address (we restarted here): the prober does not know us
            # yet. Start an anti-entropy exchange with it (once per push-pull period), so it
            # learns our session, and that ours supersedes the one it is probing, at once.
            if now - self.hinted.get(src, -math.inf) < self.cfg.push_pull_interval:
                return []
            self.hinted[src] = now
            return [self.digest_to(src)]
        out = [Out(src, {"t": "a", "n": int(msg["n"])}, tcp)]
        if "sv" in msg:                             # the prober suspects us: refute at once
            out += self._suspect(self.sid, int(msg["sv"]), "", now, None)
        return out

    def _on_a(self, msg, src, now, tcp):
        n = msg["n"]
        p = self.probe
        if p is not None and n == p["seq"]:
            if now - p["start"] <= self._timeout("probe_timeout", p["sid"]):   # in time by the
                self.lhm = max(0, self.lhm - 1)     # undegraded clock: we may trust ourselves more again
            self._acked(p["sid"], now - p["start"], now, direct=p["phase"] == 0 and src == p["addr"])   # (relay legs in it)
            self._end_probe()
            return []
        relay = self.relays.pop(n, None)
        if relay is not None:
            return [Out(relay.requester, {"t": "a", "n": relay.seq}, False)]
        late = self.late.get(n)
        if late is not None:                        # after its round gave up: still evidence
            sid = late.sid
            self._acked(sid, now - late.start, now, direct=src == self.members.get(sid) and not tcp)
            if sid in self.suspects and self.suspects[sid].confirmers == {self.sid}:
                self._degrade()                     # we alone accused a live member: our clock
                                                    # or socket lags, so we judge more slowly
            sus = self.suspects.get(sid)
            if sus is not None and sid in self.members:   # tell it, so that it refutes
                return [Out(self.members[sid], {"t": "r", "s": [[sid, sus.version, self.sid]]}, False)]
        return []

    def _acked(self, sid: str, rtt: float, now: float, direct: bool = True) -> None:
        """An ack from `sid` after `rtt` seconds: remember how slow it is (the slowest recent
        ack, decaying by a fifth per ack), a `direct` one (its own UDP answer, not relayed by a
        helper nor on the TCP path sent a phase later) as a sample of its round trip, and drop
        our own suspicion of it, which is refuted."""
        self.slow[sid] = max(rtt, self.slow.get(sid, 0.0) * 0.8)
        if direct:
            measured = self.round_trips.get(sid)
            if measured is None:
                self.round_trips[sid] = RoundTrip(rtt)
            else:
                measured.add(rtt)
        sus = self.suspects.get(sid)
        if sus is not None:
            record = self.record_of(sid)
            if record is not None and record["version"] <= sus.version:
                del self.suspects[sid]              # fresh evidence beats a rumour
                self._notify(sid, record)

    def _on_i(self, msg, src, now, tcp):
        n = self.numbers()
        cfg = self.cfg
        # Nack once the target is late by the setting, or by its round trip as we measured it (a
        # target across a WAN is not "late" before its ack could be back)
        target = self._member_at(str(msg["a"]))
        rto = min(self._rto(target), cfg.probe_timeout_max) if target else 0.0
        nack_at = now + max(cfg.nack_after * cfg.indirect_timeout, rto)
        expiry = now + (cfg.probe_interval + cfg.probe_timeout_max) * (1 + self.lhm)   # a late ack still counts
        self.relays[n] = PingReq(src, int(msg["n"]), expiry, nack_at)
        split_addr(msg["a"])
        return [Out(msg["a"], {"t": "p", "n": n, "to": str(msg["to"])}, False)]

    def _member_at(self, addr: str) -> Optional[str]:
        """The live member at gossip address `addr`, if any (a scan: ping-reqs are rare)."""
        for sid, at in self.members.items():
            if at == addr:
                return sid
        return None

    def _on_n(self, msg, src, now, tcp):
        p = self.probe
        if p is not None and msg["n"] == p["seq"]:
            p["nacks"] += 1
        return []

    def _nacks(self, now: float) -> List[Out]:
        """Ping-reqs whose target has not answered in time get a nack; expired ones are dropped."""
        out = []
        for seq, relay in list(self.relays.items()):
            if relay.nack_at <= now:
                relay.nack_at = math.inf
                out.append(Out(relay.requester, {"t": "n", "n": relay.seq}, False))
            if relay.expiry <= now:
                del self.relays[seq]
        return out

    # -- failure detection ------------------------------------------------------------------
    def _start_probe(self, now: float) -> List[Out]:
        """Probe the member `offset` places after us on the ring of sorted session ids, with one
        offset per round for everyone (a hash of the round number): with one view of the
        membership each round is a permutation, so every member is probed by exactly one other
        in every round, and a dead one is suspected within one round plus the timeouts (a
        random choice leaves it unprobed for a round with p = 1/e, and the p99 at ~5 rounds).
        The prober of a member changes every round, so one sick prober judges nobody twice."""
        if not self.members:
            self.next_probe = now + self.cfg.probe_interval
            return []
        if self.ring is None:
            self.ring = sorted([self.sid, *self.members])
        ring = self.ring
        rnd = int(now / self.cfg.probe_interval)
        offset = 1 + ((rnd * 2654435761) >> 7) % (len(ring) - 1)   # Knuth's multiplicative hash
        sid = ring[(ring.index(self.sid) + offset) % len(ring)]
        n = self.numbers()
        addr = self.members[sid]
        self.probe = {"seq": n, "sid": sid, "addr": addr, "start": now, "phase": 0,
                      "extended": False, "nacks": 0, "helpers": 0}
        self.late[n] = LateProbe(sid, now)
        self._set_deadline()
        ping = {"t": "p", "n": n, "to": sid[:SHORT_ID]}
        sus = self.suspects.get(sid)
        if sus is not None:
            ping["sv"] = sus.version                # Lifeguard's buddy: tell it, so it refutes
        self.probe["ping"] = ping
        return [Out(addr, ping, False)]

    def _timeout(self, name: str, sid: str) -> float:
        """A probe phase's timeout, for the member `sid`, as measured (see "Timeouts that follow
        the round trip" below)."""
        cfg = self.cfg
        if name == "probe_timeout":
            record = self.record_of(sid) or {}
            lhm = record.get("lhm", 0) if type(record.get("lhm", 0)) is int else 0
            wait = max(2 * self.slow.get(sid, 0.0), self._rto(sid), cfg.probe_timeout * (1 + lhm))
            return max(cfg.probe_timeout, min(cfg.probe_timeout_max, wait))
        if name == "indirect_timeout":
            p = self.probe
            helpers = p.get("helper_ids", ()) if p is not None and p["sid"] == sid else ()
            target = self._rto(sid, cfg.probe_timeout)
            # the TCP ping: a connect and a frame, two round trips; a helper's path: to it and back
            # (its RTT, measured), and from it to the target and back (at most its RTT plus the
            # target's, by the triangle through us)
            paths = [2 * target] + [2 * self._rto(h, cfg.probe_timeout) + target for h in helpers]
            return max(cfg.indirect_timeout, min(2 * cfg.probe_timeout_max, max(paths)))
        return getattr(cfg, name)

    def _set_deadline(self) -> None:
        p = self.probe
        _, after, _ = PROBE_ROUND[p["phase"]]
        p["deadline"] = p["start"] + sum(self._timeout(f, p["sid"]) for f in after) * (1 + self.lhm)

    def _end_probe(self) -> None:
        start = self.probe["start"]
        self.probe = None
        self.next_probe = start + self.cfg.probe_interval * (1 + self.lhm)

    def _advance_probe(self, now: float) -> List[Out]:
        p = self.probe
        if p["sid"] not in self.members:            # left or evicted meanwhile
            self._end_probe()
            return []
        if now - p["deadline"] > self.cfg.stall_threshold and not p["extended"]:
            # We woke up late, so an ack may be sitting unread in our socket: give it a chance.
            p["extended"] = True
            p["deadline"] = now + self.cfg.probe_timeout
            return []
        _, _, action = PROBE_ROUND[p["phase"]]
        if action == "indirect":
            p["phase"] += 1
            ping_req = {"t": "i", "n": p["seq"], "to": p["sid"][:SHORT_ID], "a": p["addr"]}
            helpers = [s for s in self.members if s != p["sid"]]
            helpers = self.rng.sample(helpers, min(len(helpers), self.cfg.indirect_checks))
            p["helpers"], p["helper_ids"] = len(helpers), helpers
            self._set_deadline()                    # (its indirect phase waits on these helpers)
            out = [Out(self.members[s], ping_req, False) for s in helpers]
            out.append(Out(p["addr"], p["ping"], True))
            return out
        # action == "suspect": no path answered. Lifeguard: if the helpers' nacks did not reach
        # us either, the fault is likely ours, so we trust our own timeouts less.
        sid = p["sid"]
        if p["nacks"] < p["helpers"] or not p["helpers"]:
            self._degrade()
        self._end_probe()
        record = self.record_of(sid)
        return self._suspect(sid, record["version"], self.sid, now, None)

    def _degrade(self) -> None:
        self.lhm = min(self.lhm + 1, self.cfg.max_local_health)

    def _suspect(self, sid: str, version: int, by: str, now: float, src: Optional[str]) -> List[Out]:
        if sid == self.sid:
            return self._refute(version, now)
        record = self.record_of(sid)
        if record is None or record["state"] == crdt.LEFT or version < record["version"]:
            return []
        sus = self.suspects.get(sid)
        new = sus is None or version > sus.version
        if new:
            sus = self.suspects[sid] = Suspicion(version, now, by)
        if by == self.sid and src is None:          # our own probe failed: our word on it, which
            sus.vouchers[by] = (version, self._voucher(sid, version))   # nobody else can give
            if new:                                 # (the WAN lab counts these: false suspicions)
                log.info("session %s suspected: no ack on any path", sid)
        if not new:
            if by in sus.confirmers:
                return []
            sus.confirmers.add(by)
        # One member writes the eviction: the lowest-id confirmer. The rest are a backup a
        # little later, so that N timers firing together do not make N different LEFT records.
        backup = 2 * self.cfg.probe_interval if self.sid != min(sus.confirmers) else 0.0
        sus.deadline = sus.since + self._grace(len(sus.confirmers) - 1, sid) + backup
        out: List[Out] = []
        if len(sus.confirmers) <= self._expected_confirmations() + 1:
            out = self._rumour([Rumour("s", sid, by)], now, src)
        if new:
            self._notify(sid, record)
        return out

    def _refute(self, version: int, now: float) -> List[Out]:
        """We are suspected: a newer version clears the suspicion. It carries our local health,
        so that every prober gives a member that knows it is slow longer to answer."""
        if version < self.own_version() or self.leaving:
            return []
        self._degrade()                             # others can't reach us: maybe we are the problem
        return self.update(now, lhm=self.lhm)

    def _expected_confirmations(self) -> int:
        return max(1, int(self.cfg.suspicion_mult) - 2)

    def _grace(self, confirmations: int, sid: str = "") -> float:
        """Lifeguard: start at max, fall towards min (which grows with log N) as independent
        confirmations arrive. On top, the suspect gets REFUTE_ROUND_TRIPS of its measured
        round trip to hear the rumour and answer it (milliseconds on a LAN)."""
        n = len(self.members) + 1
        low = self.cfg.suspicion_mult * max(1.0, math.log10(n)) * self.cfg.probe_interval
        high = self.cfg.suspicion_max_mult * low
        k = self._expected_confirmations()
        frac = math.log(confirmations + 1) / math.log(k + 1)
        refute = self.REFUTE_ROUND_TRIPS * min(self._rto(sid), self.cfg.probe_timeout_max)
        return max(low, high - (high - low) * frac) + refute

    def _evict(self, sid: str, now: float) -> List[Out]:
        sus = self.suspects[sid]
        hold = self.cfg.suspicion_hold_max if sid in self.slow else self.cfg.suspicion_hold_unreached
        if self._partitioned(now) and now - sus.began < hold:
            # A quarter of the cluster unreachable at once (and at least 3 members) is far
            # likelier a partition than independent failures. Hold the suspicion (a suspected session is not routed) and evict
            # nobody, so the halves merge again without losing the sessions alive on each.
            # A member that never answered a probe of ours is held for less (forged sessions
            # gossiped by a holder of the cluster key at addresses that never answer would
            # otherwise hold themselves, and each other, in the map for the whole hold).
            sus.held = True
            sus.deadline = now + self.cfg.probe_interval
            return []
        if sus.held:
            # The split is over (or was never one): a held suspect gets a whole grace from now
            # to hear of it and refute, as the rest of the cluster comes back into view.
            sus.held = False
            sus.since = now
            sus.deadline = now + self._grace(len(sus.confirmers) - 1, sid)
            return []
        del self.suspects[sid]
        version = (self.record_of(sid) or {}).get("version")
        vouchers = {c: mac for c, (v, mac) in sus.vouchers.items() if v == version}
        # the confirmers with a voucher first: made-up confirmers do not push them out of the evidence
        others = sorted((c for c in sus.confirmers if c != self.sid),
                        key=lambda c: (c not in vouchers, c))[: crdt.MAX_CONFIRMERS - 1]
        grace = min(self._grace(len(sus.confirmers) - 1, sid), max(0.0, now - sus.since))
        by = [self.sid] + others
        return self._retire(sid, now, "suspected and unrefuted",
                            {"since": sus.since, "grace": grace, "by": by},
                            {c: vouchers[c] for c in by if c in vouchers})

    REFUTE_ROUND_TRIPS = 4          # the rumour to the suspect and its refutation back, twice
                                    # (one of them lost): 4 x ~0.2 s at 150 ms RTT
    PARTITION_SHARE = 0.25          # of the cluster, suspected now or evicted within ...
    PARTITION_WINDOW = 60.0         # ... this long: the first evictions of a split (before the
                                    # rest are suspected) must not shrink the cluster it is judged
                                    # against; steady churn (a kill every 20 s) stays below it

    def _partitioned(self, now: float) -> bool:
        evictions = self.evictions
        while evictions and evictions[0] < now - self.PARTITION_WINDOW:
            evictions.popleft()
        unreachable = len(evictions) + sum(1 for sid in self.suspects if sid in self.members)
        return unreachable >= max(3, self.PARTITION_SHARE * (len(self.members) + len(evictions) + 1))

    MAX_RETIRED = 1024              # sessions this member evicted, remembered (Node.evicted_here):
                                    # more than a partition's worth of evictions in a minute

    def _retire(self, sid: str, now: float, why: str, evidence: Dict[str, Any],
                vouch: Optional[Dict[str, str]] = None) -> List[Out]:
        """Write LEFT for another member's session, as its evictor, with the evidence and the
        confirmers' vouchers (crdt: the end of a session); the writer pushes it to all."""
        self.suspects.pop(sid, None)
        record = self.record_of(sid)
        if record is None or record["state"] == crdt.LEFT:
            return []
        by = list(evidence["by"])                   # (ours first, then the vouched confirmers)
        record = dict(record, state=crdt.LEFT, left_at=now, evicted_by=self.sid, evidence=dict(evidence, by=by))
        record["vouch"] = vouch = dict(vouch or {})
        # At most what one record may be (a record near it, with a grant and many models, is rare):
        # the last confirmers named go first, the unvouched ones among them before the rest, ours last.
        while len(crdt.encode(record)) > crdt.MAX_RECORD_BYTES and (len(by) > 1 or vouch):
            vouch.pop(by.pop() if len(by) > 1 else self.sid, None)
        if not vouch:
            del record["vouch"]
        if len(self.retired) >= self.MAX_RETIRED:
            self.retired.pop(next(iter(self.retired)))
        self.retired[sid] = now
        log.info("session %s evicted: %s", sid, why)
        return self._write_eviction(sid, record, now)


class Overlay(FailureDetector):
    """Membership protocol state for one member. No I/O: every method takes `now` (unix time,
    the one clock) and returns the list of Out messages to send."""

    HANDLERS = {t: row.handler for t, row in MESSAGE_TYPES.items() if row.part == "overlay"}   # receive's

    def __init__(self, config: Config, session_id: str, record: Dict[str, Any], now: float,
                 rng: Optional[random.Random] = None):
        self.cfg = config
        self.rng = rng or random.Random()
        self._secure = rng is None                  # the simulator passes rng: runs replay
        FailureDetector.__init__(self, config, self.rng, now, replay=not self._secure)   # members, suspects, probes
        # The ingress tier (crdt.Authority): only a member holding its secret writes, verifies and
        # sends on the ingress plane. An ingress without it keeps keys and usage to itself.
        self.authority = crdt.Authority(config.ingress_keys) if config.ingress_keys else None
        holds_ingress = self.authority is not None or record.get("role") == "ingress"
        self.map = crdt.GMap(retention=config.retention,
                             planes=crdt.PLANES if holds_ingress else (crdt.ROUTING,))
        # Our records are bound to us (crdt, "Records bound to their writers"): under our grant's
        # key, the ingress tier's (an ingress), or a key of this process alone; the map refuses a
        # record of our session that we did not write, and, on an ingress, any that fails its check.
        self.binder = crdt.Binder(self.authority)
        self.map.binder = self.binder
        if config.grant_key:
            self.bind_key = config.grant_key
        elif self.authority is not None and record.get("role") == "ingress":
            self.bind_key = crdt.Authority.ingress_binding(self.authority.secrets[0])
        else:
            self.bind_key = secrets.token_bytes(32) if self._secure else b"replay-" + session_id.encode()
        self.sid = session_id
        self.addr = record.get("gossip", config.gossip_addr)
        self.record = self._signed(session_id, self._sealed(dict(record)))
        self.map.put(session_id, self.record)
        self.ingresses: Dict[str, str] = {}         # proven ingress sid -> gossip address: the
                                                    # only members the ingress plane goes to
        self.met_ingresses: List[str] = []          # newly proven ones, sent a digest at once
        self.seeds: Dict[str, str] = {}             # live ingress and relay sid -> gossip address
        self.refused = collections.Counter()        # entries refused: unsigned, plane
        self.known: Dict[str, Known] = {session_id: Known(self.record)}
        self.rumours: Dict[Rumour, int] = {}        # rumour -> transmits left
        self.by_addr: Dict[str, str] = {}           # gossip address -> live sid there
        self.listeners: List[Callable[[str, Optional[dict]], None]] = []
        self.rejoin_listeners: List[Callable[[str, str], None]] = []
        self.bootstrap: List[str] = []
        self.leaving = False
        self.pushes: Dict[int, dict] = {}           # our push id -> its message, its unacked
                                                    # addrs -> next resend, resends so far, the earliest
        self.next_resend = math.inf                 # the earliest push's next resend (or later):
                                                    # no scan of every push at every wakeup
        self.remembered: Dict[str, Redial] = {}     # addr -> when and how to dial it again
        self.heard: set = set()                     # bootstrap addresses that have answered
        self.sent = collections.Counter()           # messages sent by type
        self.next_gossip = math.inf
        self.next_push_pull = now + self.rng.uniform(0.5, 1.0) * config.push_pull_interval
        self.next_join = math.inf
        self.next_redial = math.inf
        self.join_backoff = config.join_retry_min
        self.started = now
        self.next_compact = now + config.compact_interval
        self.expected_wakeup = now

    # -- what the failure detector asks of us (FailureDetector's interface) -----------------
    def record_of(self, sid: str) -> Optional[Dict[str, Any]]:
        return self.map.get(sid)

    def own_version(self) -> int:
        return self.record["version"]

    def _voucher(self, sid: str, version: int) -> str:
        return crdt.voucher(self.bind_key, sid, version, self.sid)

    def _write_eviction(self, sid: str, record: Dict[str, Any], now: float) -> List[Out]:
        """Our LEFT for another member's session, as its evictor: merged, and pushed to all."""
        self.map.put(sid, record, writer=self.sid)
        return self._changed([sid], now, origin=True)

    # -- inputs -----------------------------------------------------------------------------
    def join(self, bootstrap: List[str], now: float) -> List[Out]:
        self.bootstrap = [a for a in bootstrap if a != self.addr]
        self.next_join = now + self.join_backoff if self.bootstrap else math.inf
        for addr in self.bootstrap:
            self.remember(addr, now, seed=True)
        # Join over TCP: it is reliable, and the answer (our full state) rarely fits a datagram.
        out = [Out(a, {"t": "j", "r": {self.sid: self.record}}, True) for a in self.bootstrap]
        out += self._rumour([Rumour("r", self.sid)], now)
        return self._count(out)

    def _signed(self, sid: str, record: Dict[str, Any]) -> Dict[str, Any]:
        """Our own write as it goes out: an ingress's proof of the ingress tier
        (crdt.Authority.proof), our grant, and last the binding of the whole record to us."""
        record.pop("tier", None)
        if self.authority is not None and record.get("role") == "ingress":
            record["tier"] = self.authority.proof(sid, record.get("gossip", self.addr))
        if self.cfg.grant is not None:
            record["grant"] = self.cfg.grant
        self.binder.own[sid] = self.bind_key
        return crdt.bound(self.bind_key, sid, record)

    def receive(self, msg: Dict[str, Any], src: str, now: float, tcp: bool = False) -> List[Out]:
        """Handle one authenticated message. Raises ValueError/KeyError/TypeError/RecordError on a
        malformed one (the caller counts and drops it); the state is unchanged in that case."""
        out = getattr(self, self.HANDLERS[msg["t"]])(msg, src, now, tcp)
        if src not in self.heard and src in self.bootstrap:
            self.heard.add(src)
        return self._count(out)

    def remember(self, addr: str, now: float, seed: bool = False) -> None:
        """Keep dialling `addr` while no live member is there: seeds (bootstrap, ingress and relay
        addresses) for good, every `seed_redial_interval`; other lost peers on a backoff for
        `lost_forget` seconds. Two halves of a healed partition and a restarted ingress are found
        this way, with nobody naming them again."""
        if addr == self.addr:
            return
        entry = self.remembered.get(addr)
        if entry is not None:
            entry.seed = entry.seed or seed
            return
        if len(self.remembered) >= self.cfg.max_remembered:
            oldest = min((a for a, e in self.remembered.items() if not e.seed),
                         key=lambda a: self.remembered[a].since, default=None)
            if oldest is None:
                return
            del self.remembered[oldest]
        first = self.cfg.seed_redial_interval if seed else self.cfg.join_retry_min
        entry = self.remembered[addr] = Redial(now + first * self.rng.uniform(0.5, 1.0), first, now, seed)
        self.next_redial = min(self.next_redial, entry.due)

    def health(self, now: float) -> List[str]:
        """Warnings for /healthz and the log: bootstrap peers that never answered, being alone."""
        warnings = []
        if self.bootstrap and now - self.started >= self.cfg.join_warn_after:
            silent = [a for a in self.bootstrap if a not in self.heard]
            if silent and not self.members:
                warnings.append(f"bootstrap {', '.join(silent)} has not answered in "
                                f"{now - self.started:.0f} s: is it running, and does its --gossip bind an "
                                "address this host can reach (not 127.0.0.1 across hosts)?")
            elif not self.members:
                warnings.append("every peer is lost: re-dialling the bootstrap and remembered peers")
        return warnings

    def _sealed(self, record: Dict[str, Any]) -> Dict[str, Any]:
        """Our new session's record with the seal of a new secret (crdt: the end of a session):
        only this process can write its DOWN or LEFT."""
        self._unseal = secrets.token_hex(16) if self._secure else \
            hashlib.blake2b(b"unseal" + self.sid.encode(), digest_size=16).hexdigest()   # a replay: no secret
        for stale in ("unseal", "evidence", "vouch"):
            record.pop(stale, None)
        record["seal"] = crdt.seal_of(self._unseal)
        return record

    def update(self, now: float, **fields) -> List[Out]:
        """Owner write: change fields of our own record (state, models, labels…), bump version.
        It starts from what we wrote last, never from the map's copy: a field we did not write
        is never ours (the map may hold an eviction, whose version we pass)."""
        current = self.map.get(self.sid) or self.record
        record = dict(self.record)
        record.update(fields)
        record.pop("evicted_by", None)
        record.pop("evidence", None)
        record.pop("vouch", None)
        record["version"] = max(self.record["version"], current["version"]) + 1
        if record["state"] == crdt.LEFT:
            record.setdefault("left_at", now)
        if record["state"] >= crdt.DOWN and "seal" in record:
            record["unseal"] = self._unseal         # our own end: proven by the secret
        record = self._signed(self.sid, record)
        self.record = record
        if not self.map.put(self.sid, record):
            return []
        return self._count(self._changed([self.sid], now, origin=True))

    def leave(self, now: float) -> List[Out]:
        self.leaving = True
        self._stop_probing()
        return self.update(now, state=crdt.LEFT, left_at=now)

    def rejoin(self, now: float, **fields) -> List[Out]:
        """Start a new session (after an eviction, or an engine restart); the old one is LEFT."""
        old = self.sid
        out = []
        current = self.map.get(old)
        if current is not None and current["state"] < crdt.LEFT:
            out += self.update(now, state=crdt.LEFT, left_at=now)
        record = dict(self.record)
        for stale in ("evicted_by", "left_at"):
            record.pop(stale, None)
        record.update(fields)
        record.update(version=0, started=now)
        if record["state"] >= crdt.DOWN:
            record["state"] = crdt.SERVING
        self.sid = f"{self.rng.getrandbits(128):032x}"   # from our rng: the simulator replays a run
        self._new_session()
        self.record = record = self._signed(self.sid, self._sealed(record))
        self.leaving = False
        self.map.put(self.sid, record)
        for cb in self.rejoin_listeners:
            cb(old, self.sid)
        out += self._changed([self.sid], now, origin=True)
        return self._count(out)

    def tick(self, now: float) -> List[Out]:
        """Advance every timer that is due."""
        out: List[Out] = []
        cfg = self.cfg
        if now - self.expected_wakeup > cfg.stall_threshold:
            self._degrade()                         # we ran late: trust our own judgement less
        out += self._detect(now)
        if now >= self.next_gossip:
            out += self._gossip(now)
        if self.pushes and now >= self.next_resend:
            out += self._resend(now)
        if now >= self.next_redial:
            out += self._redial(now)
        if now >= self.next_push_pull:
            out += self._push_pull(now)
        if now >= self.next_join:
            out += self._knock(now)
        if now >= self.next_compact:
            self.next_compact = now + cfg.compact_interval
            if self.map.compact(now):
                self.known = {sid: k for sid, k in self.known.items() if sid in self.map}
            self._compact_detector(now)
        self.expected_wakeup = self.next_wakeup()
        return self._count(out)

    def _push_pull(self, now: float) -> List[Out]:
        """Anti-entropy with a random member, and with a seed (an ingress, or a relay): whatever
        the members' number, or how many of them are forged sessions nobody answers for, the
        seeds hear from everyone and everyone from the seeds every round. An ingress picks an
        ingress (the ingress plane is compared with ingresses only)."""
        self.next_push_pull = now + self.rng.uniform(0.8, 1.2) * self.cfg.push_pull_interval
        peer = self._peers(1)
        out = [self.digest_to(peer[0])] if peer else []
        seeds = [a for a in (self.ingresses or self.seeds).values() if a not in peer]
        if seeds:
            out.append(self.digest_to(self.rng.choice(seeds)))
        return out

    def _knock(self, now: float) -> List[Out]:
        """The join's watchdog: while we have peers, nothing; alone, join again, backing off."""
        cfg = self.cfg
        if self.members:
            self.join_backoff = cfg.join_retry_min
            self.next_join = now + cfg.join_retry_max
            return []
        self.join_backoff = min(self.join_backoff * 2, cfg.join_retry_max)
        self.next_join = now + self.join_backoff
        return [Out(a, {"t": "j", "r": {self.sid: self.map.get(self.sid)}}, True) for a in self.bootstrap]

    def next_wakeup(self) -> float:
        times = [self.next_push_pull, self.next_join, self.next_compact, self.next_redial]
        if self.rumours:
            times.append(self.next_gossip)
        if self.pushes:
            times.append(self.next_resend)
        return min(times + self._detector_wakeups())

    # -- message handlers -------------------------------------------------------------------

    def _on_k(self, msg, src, now, tcp):
        push = self.pushes.get(msg["k"])
        if push is not None:
            push["pending"].pop(src, None)
            if not push["pending"]:
                del self.pushes[msg["k"]]
        return []

    def _on_r(self, msg, src, now, tcp):
        records = msg.get("r") or {}
        suspicions = _suspicions(msg)               # validated before touching any state
        if "k" in msg:                              # the writer resends until we ack: no forwarding
            push = False
        else:
            push = LATER if msg.get("a") == 1 else True
        out = self._merge(records, src, now, push=push)
        for sid, version, by in suspicions:
            out += self._suspect(sid, version, by, now, src)
        self._take_vouchers(_vouchers(msg))
        if "k" in msg:
            out.append(Out(src, {"t": "k", "k": int(msg["k"])}, False))
        return out

    def _on_j(self, msg, src, now, tcp):
        out = self._merge(msg["r"], src, now, joining=tuple(msg["r"]))
        horizon = now - self.cfg.join_left_age      # what a joiner needs: no day of LEFT records
        records = [(sid, r) for sid, r in self.map.plane_items(crdt.ROUTING)
                   if r["state"] < crdt.LEFT or r.get("left_at", now) > horizon]
        # Keys and usage are not in it: a joining ingress (proven by its record, just merged)
        # is sent a digest of them at once (see _changed), and pulls what it lacks, bucket by
        # bucket, instead of everything (a restarted one holds most of it already).
        return out + self._state(src, records, tcp, self._with_suspicions({"t": "st", "r": {}}))

    def _state(self, dest: str, records, tcp: bool, first: Dict[str, Any]) -> List[Out]:
        """Records to send, in messages of at most `state_chunk` bytes of records each: `first`
        carries the first piece, "st" messages the rest (a release before this one merges each)."""
        out: List[Out] = []
        msg, size = first, 0
        msg.setdefault("r", {})
        for sid, record in records:
            cost = self.map.size_of(sid) + len(sid) + 6
            if msg["r"] and size + cost > self.cfg.state_chunk:
                out.append(Out(dest, msg, tcp))
                msg, size = {"t": "st", "r": {}}, 0
            msg["r"][sid] = record
            size += cost
        out.append(Out(dest, msg, tcp))
        return out

    def _proven(self, sid: str, record: Dict[str, Any]) -> bool:
        """An ingress's session, as proven by its tier (never without our own ingress secret)."""
        return self.authority is not None and sid != self.sid and self.authority.proven(sid, record)

    def _on_st(self, msg, src, now, tcp):
        suspicions = _suspicions(msg)
        return self._merge(msg["r"], src, now, push=False) + self._take(suspicions, src, now)

    # Push-pull per plane: "d" carries the routing plane's root (what every member holds) and,
    # between two proven ingresses, "di", the ingress plane's; "db" and "dr" name the plane they
    # are about ("pl": "i" for the ingress plane; none: the routing plane, as before planes).
    def _plane(self, msg: Dict[str, Any], src: str) -> Optional[str]:
        if msg.get("pl") != "i":
            return crdt.ROUTING
        return crdt.INGRESS if src in self.ingresses.values() else None

    def _on_d(self, msg, src, now, tcp):
        out = self._take(_suspicions(msg), src, now)
        if msg["d"]["root"] != self.map.digest(plane=crdt.ROUTING)["root"]:
            out.append(Out(src, {"t": "db", "d": self.map.digest(buckets=True, plane=crdt.ROUTING)}, tcp))
        if "di" in msg and src in self.ingresses.values() \
                and msg["di"]["root"] != self.map.digest(plane=crdt.INGRESS)["root"]:
            out.append(Out(src, {"t": "db", "pl": "i", "d": self.map.digest(buckets=True, plane=crdt.INGRESS)}, tcp))
        return out

    def _on_db(self, msg, src, now, tcp):
        plane = self._plane(msg, src)
        if plane is None:
            self.refused["plane"] += 1
            return []
        reply = {"t": "dr", "r": {}, "d": self.map.digest(buckets=True, plane=plane)}
        if plane == crdt.INGRESS:
            reply["pl"] = "i"
        return self._state(src, self.map.diff(msg["d"], plane).items(), tcp, self._with_suspicions(reply))

    def _on_dr(self, msg, src, now, tcp):
        plane = self._plane(msg, src)
        if plane is None:
            self.refused["plane"] += 1
            return []
        suspicions = _suspicions(msg)
        ours = self.map.diff(msg["d"], plane)       # judged against their state before merging
        out = self._merge(msg["r"], src, now, push=False) + self._take(suspicions, src, now)
        if ours:
            out += self._state(src, ours.items(), tcp, self._with_suspicions({"t": "st", "r": {}}))
        return out

    # Anti-entropy carries suspicions too: a member that missed the rumour that it is suspected
    # learns it at the next exchange and refutes, instead of being evicted while healthy.
    MAX_SUSPICIONS = 64                             # per message: one datagram's worth

    def _with_suspicions(self, msg: Dict[str, Any]) -> Dict[str, Any]:
        if self.suspects:
            msg["s"] = [[sid, sus.version, min(sus.confirmers)]
                        for sid, sus in list(self.suspects.items())[: self.MAX_SUSPICIONS]]
        return msg

    def digest_to(self, addr: str) -> Out:
        msg = {"t": "d", "d": self.map.digest(plane=crdt.ROUTING)}
        if addr in self.ingresses.values():
            msg["di"] = self.map.digest(plane=crdt.INGRESS)
        return Out(addr, self._with_suspicions(msg), False)

    MAX_VOUCHERS = 4 * crdt.MAX_CONFIRMERS          # held per suspicion: a rumour's worth of made-up
                                                    # confirmers leaves room for the real ones'

    def _take_vouchers(self, vouchers: List[list]) -> None:
        """Keep the vouchers of confirmers of suspicions we hold, to write into the eviction (the
        first for each confirmer: a worker cannot check them; our own is never replaced)."""
        for sid, version, by, mac in vouchers:
            sus = self.suspects.get(sid)
            if sus is None or by == self.sid or by not in sus.confirmers or by in sus.vouchers \
                    or len(sus.vouchers) >= self.MAX_VOUCHERS:
                continue
            sus.vouchers[by] = (version, mac)

    def _take(self, suspicions: List[list], src: str, now: float) -> List[Out]:
        out: List[Out] = []
        for sid, version, by in suspicions:
            out += self._suspect(sid, version, by, now, src)
        return out

    # -- dissemination ----------------------------------------------------------------------
    def _merge(self, records, src: str, now: float, push: bool = True, joining: tuple = ()) -> List[Out]:
        if not isinstance(records, dict):
            raise ValueError("records must be an object")
        fresh = {sid: record for sid, record in records.items() if self._news(sid, record)}
        changed = self.map.merge(fresh, joining)
        done = set(changed)                         # a set: a joiner's merge of 100k records is linear
        for sid in fresh if self.rumours else ():
            if sid not in done:
                self._known_elsewhere(sid)
        return self._changed(changed, now, exclude=src, push=push)

    def _news(self, sid: Any, record: Any) -> bool:
        """Whether a record sent to us goes on to the map's merge: not a copy we have or older
        (no need to validate those), and on the ingress plane only what the ingress tier signed."""
        if isinstance(sid, str) and ":" in sid and crdt.plane_of(sid) == crdt.INGRESS:
            # Held by ingresses, written only by the ingress tier. A worker drops it (an ingress
            # of the release before planes still sends it); an ingress applies only what the
            # tier signed (the cluster key alone writes nothing here).
            if self.authority is None or not isinstance(record, dict) or not self.authority.verify(sid, record):
                self.refused["plane" if self.authority is None else "unsigned"] += 1
                return False
        mine = self.known.get(sid)
        if mine is None or not isinstance(record, dict):
            return True
        theirs, ours = (record.get("state"), record.get("version")), (mine.state, mine.version)
        if type(theirs[0]) is int and type(theirs[1]) is int and \
                (theirs < ours or (theirs == ours and record == mine.record)):
            if self.rumours:
                self._known_elsewhere(sid)
            return False
        return True

    def _known_elsewhere(self, sid: str) -> None:
        """Others sent us the record we rumour: lose interest in it sooner."""
        key = Rumour("r", sid)
        if key in self.rumours:
            self.rumours[key] -= 1

    def _changed(self, sids: List[str], now: float, exclude: Optional[str] = None,
                 push=True, origin: bool = False) -> List[Out]:
        """Bookkeeping after map changes, then one rumour for all of them. Records learned by
        anti-entropy (push=False) are not rumoured: the peer that had them is not alone in
        knowing them (push-pull spreads them further), and a joiner re-gossiping the full state
        it was just given would cost N datagrams per join across the cluster. Records the
        origin sent to every member (push=LATER) are sent on once, a tick later."""
        out: List[Out] = []
        keys, met, gone = [], [], []
        for sid in sids:
            record = self.map.get(sid)
            if record is None:
                continue
            self.known[sid] = Known(record)
            if self._track(sid, record, now) and not push and self.members[sid] != exclude:
                met.append(self.members[sid])       # (the sender knows us: it sent us state, or
                                                    # pushed to us as a member it knows)
            if self._superseded(sid, record):
                gone.append(sid)
            sus = self.suspects.get(sid)
            if sus is not None and (record["state"] == crdt.LEFT or record["version"] > sus.version):
                del self.suspects[sid]              # refuted, or settled
            if sid == self.sid and not self.leaving and record["state"] >= crdt.DOWN \
                    and self.record["state"] < crdt.DOWN:   # evicted (or written down by anyone
                                                            # else, evicted_by or not): a new session
                out += self.rejoin(now, state=self.record["state"])
                continue
            keys.append(Rumour("r", sid))
            self._notify(sid, record)
        out += self._retire_superseded(gone, now)
        while self.met_ingresses:                   # the ingress plane's anti-entropy, now
            out.append(self.digest_to(self.met_ingresses.pop()))
        if met and not self.leaving:
            out += self._introduce(met, now)
        if push is LATER:
            self._rumour_later(keys, now)
            return out
        return out + (self._rumour(keys, now, exclude, origin) if push else [])

    def _retire_superseded(self, sids: List[str], now: float) -> List[Out]:
        """Our predecessors at our address LEFT, on our own word (we see their successor): once
        every member is known, pushed to all."""
        out: List[Out] = []
        for sid in sids:
            log.info("session %s superseded: this process now serves its address", sid)
            version = self.map.get(sid)["version"]
            out += self._retire(sid, now, "superseded", {"since": now, "grace": 0.0, "by": [self.sid]},
                                {self.sid: crdt.voucher(self.bind_key, sid, version, self.sid)})
        return out

    def _introduce(self, met: List[str], now: float) -> List[Out]:
        """Members met through anti-entropy (a healed split, a restart) may not know us: we
        introduce ourselves the way a write is pushed, acked and resent (to more than
        origin_fanout: as a rumour, which reaches them all in a few hops)."""
        if len(met) <= self.cfg.origin_fanout:
            return self._push([Rumour("r", self.sid)], met, now)
        return self._rumour([Rumour("r", self.sid)], now, origin=True)

    def _rumour_later(self, keys: List[Rumour], now: float) -> None:
        """What the origin sent to every member (push=LATER): sent on once, at the next gossip."""
        for key in keys:
            if crdt.plane_of(key.sid) == crdt.ROUTING:
                self.rumours[key] = 1
        if keys:
            self.next_gossip = min(self.next_gossip, now + self.cfg.gossip_interval)

    def _track(self, sid: str, record: Dict[str, Any], now: float) -> bool:
        """Keep `members` (and the address tables) in step with a changed record; True when
        it is a member we did not have."""
        seed = record.get("role") in SEED_ROLES
        if sid != self.sid and record["state"] < crdt.LEFT and record.get("gossip") \
                and record.get("role") == "ingress" and self._proven(sid, record):
            if sid not in self.ingresses:
                self.met_ingresses.append(record["gossip"])
            self.ingresses[sid] = record["gossip"]
        else:
            self.ingresses.pop(sid, None)
        if sid != self.sid and record["state"] < crdt.LEFT and record.get("gossip") and seed:
            self.seeds[sid] = record["gossip"]
        else:
            self.seeds.pop(sid, None)
        if sid != self.sid and record["state"] < crdt.LEFT and record.get("gossip"):
            addr = record["gossip"]
            new = self._track_member(sid, addr)
            if new:
                self.by_addr[addr] = sid
            if seed:
                self.remember(addr, now, seed=True)   # dialled again if it ever goes away
            return new
        else:
            addr = self._untrack_member(sid, bool(record.get("evicted_by")), now)
            if addr is None:
                return False
            if self.by_addr.get(addr) == sid:
                del self.by_addr[addr]
            if seed or record.get("evicted_by"):    # it may come back, or be alive beyond a split
                self.remember(addr, now, seed=seed)
        return False

    def _superseded(self, sid: str, record: Dict[str, Any]) -> bool:
        """A live session of our owner at our own gossip address, older than ours, belonged to the
        process that was here before us (a restart on the same port): it is LEFT at once, by
        us alone, instead of after a suspicion grace."""
        if record["state"] >= crdt.LEFT or sid == self.sid or record.get("gossip") != self.addr \
                or record.get("owner") != self.record.get("owner"):
            return False
        # a newer process claiming our address is not ours to judge
        return (record.get("started", 0), sid) < (self.record.get("started", 0), self.sid)

    def _notify(self, sid: str, record: Optional[Dict[str, Any]]) -> None:
        for cb in self.listeners:
            try:
                cb(sid, record)
            except Exception:                       # a listener's bug must not stop the protocol
                log.exception("on_change callback failed")

    def _retransmits(self) -> int:
        return max(1, int(self.cfg.retransmit_mult * math.ceil(math.log10(len(self.members) + 2))))

    def _rumour(self, keys: List[Rumour], now: float, exclude: Optional[str] = None,
                origin: bool = False) -> List[Out]:
        """Queue rumours and push them at once to a few random peers (their first transmit);
        the origin of a change, to every member (flagged "a": each sends it on once, later)."""
        out: List[Out] = []
        ingress_plane = [k for k in keys if k.kind == "r" and crdt.plane_of(k.sid) == crdt.INGRESS]
        if ingress_plane:
            # Pushed by its writer to every proven ingress, resent until acked; never rumoured on
            # (receivers do not forward it, and workers never see it); anti-entropy repairs.
            held = set(ingress_plane)
            keys = [k for k in keys if k not in held]
            if origin:
                out += self._push(ingress_plane, [a for a in self.ingresses.values() if a != exclude], now)
        if not keys:
            return out
        if origin and len(self.members) <= self.cfg.origin_fanout:
            # The writer pushes to every member and resends to those that have not acked, in
            # rounds (see _resend): no retransmit by the receivers, and no straggler waits for
            # anti-entropy.
            return out + self._push(keys, [a for a in self.members.values() if a != exclude], now)
        peers = self._peers(self.cfg.gossip_fanout, exclude)
        for payload in self._packs(keys):
            out += [Out(addr, payload, False) for addr in peers]
        if origin:                                  # the seeds always get it from its writer
            out += self._push(keys, [a for a in self.seeds.values() if a != exclude and a not in peers], now)
        self._queue(keys, now)
        return out

    def _queue(self, keys: List[Rumour], now: float) -> None:
        """Rumours kept for their retransmits, less the first (sent as they were queued)."""
        limit = self._retransmits()
        for key in keys:
            self.rumours[key] = limit
        for key in keys:
            self.rumours[key] -= 1
            if self.rumours[key] <= 0:
                del self.rumours[key]
        if self.rumours:
            self.next_gossip = min(self.next_gossip, now + self.cfg.gossip_interval)

    def _push(self, keys: List[Rumour], peers: List[str], now: float) -> List[Out]:
        out: List[Out] = []
        for payload in self._packs(keys):
            self.seq += 1
            payload["k"] = self.seq
            out += [Out(addr, payload, False) for addr in peers]
            if peers:
                pending = self._resend_dues(peers, now)
                nxt = min(pending.values())
                self.next_resend = min(self.next_resend, nxt)
                self.pushes[self.seq] = {"msg": payload, "pending": pending, "next": nxt, "resent": {}}
        return out

    def _resend(self, now: float) -> List[Out]:
        """Resend each push to the members that have not acked it (still members) once their
        own wait is over (_resend_wait), until every one has or its rounds run out."""
        out: List[Out] = []
        live = None
        for pid, push in list(self.pushes.items()):
            if push["next"] > now:
                continue
            if live is None:
                live = set(self.members.values())
            pending, resent, rounds = push["pending"], push["resent"], self.cfg.push_resend_rounds
            for addr, due in list(pending.items()):
                if addr not in live:
                    del pending[addr]
                elif due <= now:
                    resent[addr] = times = resent.get(addr, 0) + 1
                    if times > rounds:
                        del pending[addr]
                        continue
                    out.append(Out(addr, push["msg"], False))
                    pending[addr] = now + self._resend_wait(addr)
            if not pending:
                del self.pushes[pid]
                continue
            push["next"] = min(pending.values())
        self.next_resend = min((p["next"] for p in self.pushes.values()), default=math.inf)
        return out

    def _resend_wait(self, addr: str) -> float:
        """How long the writer waits for `addr`'s ack before it sends the push again: the
        setting (stretched by our local health: a slow member's acks come late), or the member's
        measured round trip plus four deviations when that is longer (a member 150 ms away acks
        after ~150 ms: resent every 150 ms, it got each write about twice)."""
        return max(self.cfg.push_resend_interval * (1 + self.lhm), self._rto(self.by_addr.get(addr, "")))

    def _resend_dues(self, addrs: List[str], now: float) -> Dict[str, float]:
        """When each of `addrs` is due a resend (`now` + its _resend_wait): every one at the
        setting, then the members measured slower than that later (a write goes to every member:
        one pass over the round trips, not a lookup per member)."""
        setting = self.cfg.push_resend_interval * (1 + self.lhm)
        dues = dict.fromkeys(addrs, now + setting)
        members = self.members
        for sid, measured in self.round_trips.items():
            wait = measured.timeout()
            if wait > setting:
                addr = members.get(sid)
                if addr in dues:
                    dues[addr] = now + wait
        return dues

    def _redial(self, now: float) -> List[Out]:
        """Dial remembered addresses that are due and have no live member: an anti-entropy
        digest, which starts a full two-way exchange if the far side holds anything else."""
        cfg = self.cfg
        self.next_redial = math.inf
        out: List[Out] = []
        for addr, entry in list(self.remembered.items()):
            seed = entry.seed
            if entry.due <= now:
                if addr in self.by_addr:            # a live member is there: probing covers it
                    if not seed:
                        del self.remembered[addr]
                        continue
                elif not seed and now - entry.since > cfg.lost_forget:
                    del self.remembered[addr]
                    continue
                else:
                    out.append(self.digest_to(addr))
                    if not seed:
                        entry.backoff = min(entry.backoff * 2, cfg.lost_redial_max)
                entry.due = now + (cfg.seed_redial_interval if seed else entry.backoff) * self.rng.uniform(0.8, 1.2)
            self.next_redial = min(self.next_redial, entry.due)
        return out

    def _packs(self, keys: List[Rumour]):
        """Rumour payloads, each small enough for one datagram."""
        if len(keys) == 1:
            yield self._payload(keys)
            return
        budget = self.cfg.max_datagram - ENVELOPE - 256
        batch, size = [], 0
        for key in keys:
            if key.kind == "r":
                record = self.map.get(key.sid)
                cost = len(crdt.dumps(record)) + 40 if record else 0
            else:
                cost = 160                          # a suspicion and its voucher
            if batch and size + cost > budget:
                yield self._payload(batch)
                batch, size = [], 0
            batch.append(key)
            size += cost
        if batch:
            yield self._payload(batch)

    def _payload(self, keys) -> Dict[str, Any]:
        records, suspicions, vouchers = {}, [], []
        for key in keys:
            if key.kind == "r":
                record = self.map.get(key.sid)
                if record is not None:
                    records[key.sid] = record
            else:
                sus = self.suspects.get(key.sid)
                if sus is not None:
                    suspicions.append([key.sid, sus.version, key.by])
                    if key.by in sus.vouchers:
                        version, mac = sus.vouchers[key.by]
                        vouchers.append([key.sid, version, key.by, mac])
        msg: Dict[str, Any] = {"t": "r"}
        if records:
            msg["r"] = records
        if suspicions:
            msg["s"] = suspicions
        if vouchers:                                # beside "s": a release before this one takes
            msg["vo"] = vouchers                    # three items per suspicion, and ignores "vo"
        return msg

    def _gossip(self, now: float) -> List[Out]:
        """Retransmit tick: pending rumours, packed into a few datagrams, to `gossip_fanout`
        random peers; each rumour loses one transmit."""
        self.next_gossip = math.inf
        keys = sorted(self.rumours, key=lambda k: -self.rumours[k])[: self.MAX_PER_TICK]
        for key in keys:
            self.rumours[key] -= 1
            if self.rumours[key] <= 0:
                del self.rumours[key]
        if self.rumours:
            self.next_gossip = now + self.cfg.gossip_interval
        out: List[Out] = []
        for payload in self._packs(keys):
            if len(payload) > 1:
                out += [Out(addr, payload, False) for addr in self._peers(self.cfg.gossip_fanout)]
        return out

    MAX_PER_TICK = 64                               # rumours per tick: a join storm drains over
                                                    # a few ticks instead of one burst

    def _peers(self, k: int, exclude: Optional[str] = None) -> List[str]:
        addrs = [a for a in self.members.values() if a != exclude]
        if len(addrs) <= k:
            return addrs
        return self.rng.sample(addrs, k)


    def _count(self, out: List[Out]) -> List[Out]:
        for o in out:
            self.sent[o.msg["t"]] += 1
        return out

    # -- replicated entries that are not sessions: API keys and usage slots ------------------
    # An ingress writes key records and its own usage slots (crdt's KEY and USAGE kinds) into
    # the same map. They travel as any change does: pushed by their writer to every member and
    # resent until acked, carried by digests and push-pull, and sent whole to a joiner, so an
    # ingress that was down catches up when it rejoins. They never touch membership.
    def adopt(self, entries: List[Tuple[str, Dict[str, Any]]], now: float) -> List[Out]:
        """Key records and usage slots an ingress kept on its own disk, taken back at its start:
        its slots from before a restart (another session's now) and the other ingresses' it had
        heard. Its own disk is as trusted as its secret, so a record whose signature does not
        verify (a release before signing, a retired secret) is signed anew; none is pushed (the
        other ingresses hold them, or pull them by digest). A malformed one is skipped."""
        if crdt.INGRESS not in self.map.planes:
            raise crdt.RecordError("only an ingress holds keys and usage")
        changed = []
        for entry_id, record in entries:
            if self.authority is not None and not self.authority.verify(entry_id, record):
                record = self.authority.sign(entry_id, record)
            try:
                if self.map.put(entry_id, record):
                    changed.append(entry_id)
            except crdt.RecordError as exc:
                log.warning("not taken back from the database: %s", exc)
        return self._count(self._changed(changed, now, push=False))

    def publish(self, entry_id: str, record: Dict[str, Any], now: float) -> List[Out]:
        """Write a key record, a grant's revocation, one of our usage slots, a limit or our flow;
        rumoured if it changed the map."""
        if crdt.kind_of(entry_id) not in (crdt.KEY, crdt.USAGE, crdt.REVOCATION, crdt.LIMIT, crdt.FLOW):
            raise crdt.RecordError(f"{entry_id}: sessions are written by update and eviction")
        if crdt.INGRESS not in self.map.planes:
            raise crdt.RecordError(f"{entry_id}: only an ingress writes keys and usage")
        if self.authority is not None:              # without the tier's secret: kept here alone
            record = self.authority.sign(entry_id, record)
        if not self.map.put(entry_id, record, writer=self.sid):
            return []
        return self._count(self._changed([entry_id], now, origin=True))


# =============================================================================================
# HTTP (the codec below; h11 for what it leaves to h11): GET /v1/registry, GET /healthz, the tunnel
# =============================================================================================
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                        b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})


class EngineError(Exception):
    """The engine refused, reset or never answered."""


def header_items(headers) -> List[Tuple[bytes, bytes]]:
    """(lower-case name, value) pairs of h11 headers. h11's Headers is a Sequence whose
    iteration goes through __getitem__ per item (2 us each); its backing list is read once."""
    full = getattr(headers, "_full_items", None)
    if full is None:                                # another h11 layout: the public way
        return list(headers)
    return [(name, value) for _, name, value in full]


# -- The HTTP/1.1 codec: sans-IO, strict by RFC 9112 ---------------------------------------------
# One parser of message heads and one reader of bodies for every hop: the node's tunnel (the
# ingress's requests in, the engine's responses back) and both sides of the ingress (clients'
# requests, the tunnel's responses). Bytes in; a head, a piece of body, "need more" or an
# HTTPViolation out; no sockets, no clock. Two numbered rules decide what belongs here:
#   1. A message we accept, h11 accepts too, with the same method, target, status, fields and
#      body (tests/test_http_codec.py checks it both ways, on generated and mutated bytes). We are
#      stricter where a proxy must be (RFC 9112 6.1, 6.3, 7.1): both Content-Length and
#      Transfer-Encoding, a repeated or non-decimal Content-Length, a chunk size that is not 1-15
#      hex digits, a bare CR or LF, a head or chunk over its limit.
#   2. What a client sends that the codec does not judge (HTTP/1.0, Expect, Upgrade, obs-fold,
#      odd bytes, a head over the limit) is H11_JUDGES: that request goes to h11 as it is, after
#      the framing check, so no parser after us can be smuggled a second request.
# A body's framing is a kind (NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE), never a length with
# sentinel values: a negative Content-Length once collided with them.
NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE = "no body", "content-length", "chunked", "until close"
H11_JUDGES = "h11 judges"           # parse_request: a request for h11 to read
MAX_HEAD = 65536                    # engine heads are < 1 KiB; 64 KiB allows big cookies/traces
MAX_CHUNK = 16 * 1024 * 1024        # engines send an SSE event or a whole body per chunk; a chunk
                                    # said to be bigger is garbage, refused before it is awaited
MAX_CHUNK_LINE = 4096               # a size line with its extension: "1f40" plus room for ";x=y"
MAX_LENGTH_DIGITS = 18              # 10^18 bytes is past any body; int() of 4,300+ digits raises
# The framing fields of a head we do not parse ourselves, line by line (bare LF too: h11 takes it)
_BLANK_LINE = re.compile(rb"\n\r?\n")           # the end of a head as h11 finds it
_FRAMING_FIELD = re.compile(rb"\n(content-length|transfer-encoding)[ \t]*:[ \t]*([^\r\n]*?)[ \t]*(?=\r?\n)",
                            re.IGNORECASE)
# A chunk-size line: hex digits only (int(x, 16) also takes "-6", "+6", "0x6" and "6_0"), an
# optional extension after ";"; 15 digits are 2**60, far past MAX_CHUNK.
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:;[^\r]*)?[ \t]*\r")
_TRAILER_FRAMING = re.compile(rb"(?i)(?:content-length|transfer-encoding|host)[ \t]*:")
_HANDED_TO_H11 = frozenset((b"expect", b"upgrade"))   # h11 speaks 100-continue and refuses upgrades


class HTTPViolation(ValueError):
    """A message whose framing we refuse: a client gets 400 and a close, an engine's answer is
    a failed upstream (502, or a cut stream)."""


class MessageHead:
    """A parsed request or response head. `headers`: (lower-case name, value) in order;
    `fields`: the same as a dict (the last of a repeated name).

    The defaults are class attributes, not slots set per head: a head is parsed on every request
    and every answer, and what a parse does not set costs nothing (a cold CPU pays for each
    instruction and each line of memory an idle-gapped request touches)."""

    method = target = reason = b""
    status = 0
    version = b"1.1"
    framing, length, keep_alive = NO_BODY, 0, True
    lines: Sequence[bytes] = ()         # the codec's: the field lines as they came, judged valid
                                        # (one per `headers` entry): what forwarded_request_head passes on

    def __init__(self, headers: List[Tuple[bytes, bytes]], fields: Dict[bytes, bytes], size: int):
        self.headers, self.fields, self.size = headers, fields, size


def framing_error(fields: List[Tuple[bytes, bytes]]) -> Optional[str]:
    """Why a message's body framing is refused (None: it is not), from its fields with lower-case
    names. Two readings of where a body ends are how a request is smuggled past a proxy: with
    both Content-Length and Transfer-Encoding, two Content-Lengths, or a coding we do not decode,
    the bytes after the head could be a second request to one reader and body to another.
    RFC 9112 6.1 and 6.3: answer 400 and close the connection (502 from an engine)."""
    lengths = [value for name, value in fields if name == b"content-length"]
    codings = [value for name, value in fields if name == b"transfer-encoding"]
    if codings and lengths:
        return "both Content-Length and Transfer-Encoding"
    if len(codings) > 1 or (codings and codings[0].strip().lower() != b"chunked"):
        return "a Transfer-Encoding other than chunked"
    if len(lengths) > 1:
        return "more than one Content-Length"
    if lengths and not (lengths[0].isdigit() and len(lengths[0]) <= MAX_LENGTH_DIGITS):
        return "a Content-Length that is not a number of bytes"
    return None


# The characters a head's pieces may hold (RFC 9110 5.6.2, 5.5; RFC 9112 3.2): `x.translate(None,
# SET)` deletes them, so what is left is what is not allowed (empty: all allowed).
_TCHARS = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_TARGET_CHARS = bytes(range(0x21, 0x7f))
_VALUE_CHARS = b"\t" + bytes(range(0x20, 0x7f)) + bytes(range(0x80, 0x100))   # no control but tab
# Tables of the lines seen before: a line -> what it says (request line: (method, target); status
# line: (status, reason, minor version); field line: (lower-case name, value)). Most lines come
# again and again (an engine's status and content-type, a client's request line, host and key),
# so each short one is judged once, and a head of lines seen before is read by lookups that run
# in C, with no regex: a cold CPU (16 requests/s) pays for each distinct routine a request runs.
# Bounded: short lines only, and a table starts afresh when full, so lines never seen twice cost
# a lookup and no memory. Only lines judged valid go in.
_FIELD_LINES: Dict[bytes, Tuple[bytes, bytes]] = {}
_REQUEST_LINES: Dict[bytes, Tuple[bytes, bytes]] = {}
_STATUS_LINES: Dict[bytes, Tuple[int, bytes, bytes]] = {}
_FIELD_LINES_MAX = 4096
_FIELD_LINE_CACHED = 256            # longer lines (cookies, traces, long targets) are judged each time
# Fields whose value is new on every request (the ingress's trace context and request id, on every
# request a node is sent): judged each time and never remembered, so they neither cost a table
# entry nor, every ~2,000 requests, empty the table of the lines that do come again.
_FRESH_FIELDS = frozenset((b"traceparent", b"tracestate", b"x-request-id"))


def _remember(table: Dict[bytes, Tuple], line: bytes, reading: Tuple) -> Tuple:
    if len(line) <= _FIELD_LINE_CACHED:
        if len(table) >= _FIELD_LINES_MAX:
            table.clear()
        table[line] = reading
    return reading


def _request_line(line: bytes) -> Optional[Tuple[bytes, bytes]]:
    """A request line not seen before, judged (and remembered if valid): (method, target) of
    `method SP origin-form SP HTTP/1.1`, or None (not ours to judge)."""
    method, _, rest = line.partition(b" ")
    target, _, version = rest.partition(b" ")
    if version != b"HTTP/1.1" or not method or method.translate(None, _TCHARS) \
            or target[:1] != b"/" or target.translate(None, _TARGET_CHARS):
        return None
    return _remember(_REQUEST_LINES, line, (method, target))


def _status_line(line: bytes) -> Optional[Tuple[int, bytes, bytes]]:
    """A status line not seen before, judged (and remembered if valid): (status, reason, minor
    version) of `HTTP/1.x SP 3DIGIT [SP reason]`, or None (malformed)."""
    code, rest = line[9:12], line[12:]
    if line[:7] != b"HTTP/1." or line[7:8] not in (b"0", b"1") or line[8:9] != b" " \
            or len(code) != 3 or not code.isdigit() \
            or (rest and (rest[:1] != b" " or rest.translate(None, _VALUE_CHARS))):
        return None
    return _remember(_STATUS_LINES, line, (int(code), rest[1:], line[7:8]))


def _field_reading(line: bytes) -> Optional[Tuple[bytes, bytes]]:
    """(lower-case name, value) of a field line (no CRLF) not seen before, judged (and remembered
    unless its value is new each time); None unless it is `token ":" value` with no control but
    tab (obs-fold excluded)."""
    name, colon, value = line.partition(b":")
    if not colon or not name or name.translate(None, _TCHARS) or value.translate(None, _VALUE_CHARS):
        return None
    name = name.lower()
    reading = name, value.strip(b" \t")
    return reading if name in _FRESH_FIELDS else _remember(_FIELD_LINES, line, reading)


def _fields(lines: List[bytes], size: int) -> Optional[MessageHead]:
    """The head of the field lines `lines` (`token:value`, the CRLFs split off), framed; None if
    a line is not a valid field line. Raises HTTPViolation for a framing that could smuggle."""
    headers = list(map(_FIELD_LINES.get, lines))
    if None in headers:                 # (the lines not seen before, found in C: the rest are read)
        for i in itertools.compress(range(len(headers)), map(operator.not_, headers)):
            headers[i] = _field_reading(lines[i])
            if headers[i] is None:
                return None
    fields = dict(headers)
    head = MessageHead(headers, fields, size)
    head.lines = lines
    length, coding = fields.get(b"content-length"), fields.get(b"transfer-encoding")
    if coding is not None:
        error = framing_error(headers)
        if error is not None:
            raise HTTPViolation(error)
        head.framing = CHUNKED
        if coding != b"chunked":        # "Chunked": written as h11 and RFC 9112 7 spell it
            head.headers = headers = [(n, b"chunked" if n == b"transfer-encoding" else v) for n, v in headers]
            fields[b"transfer-encoding"] = b"chunked"
    elif length is not None:
        if len(fields) < len(headers) or not length.isdigit() or len(length) > MAX_LENGTH_DIGITS:
            error = framing_error(headers)   # a repeated name: maybe a second Content-Length
            if error is not None:
                raise HTTPViolation(error)
        head.framing, head.length = LENGTH, int(length)
    connection = fields.get(b"connection")
    if connection is not None:
        head.keep_alive = b"close" not in [t.strip() for t in connection.lower().split(b",")]
    return head


def parse_request(buf, max_head: int = MAX_HEAD):
    """The request head at the front of `buf` (nothing is consumed: its length is `size`), None
    while it is incomplete, or H11_JUDGES for one h11 should read. Raises HTTPViolation for a
    framing that could smuggle a request, whoever would read it."""
    end = buf.find(b"\r\n\r\n")     # the first blank line ends the head (no line starts with CR)
    if end < 0 or end + 4 > max_head:
        if len(buf) > max_head or (buf and buf[0] < 0x21) or (end < 0 and (b"\n\n" in buf or b"\n\r\n" in buf)):
            _check_framing(buf, max_head)
            return H11_JUDGES
        return None
    lines = (buf[:end] if type(buf) is bytes else bytes(buf[:end])).split(b"\r\n")
    start = _REQUEST_LINES.get(lines[0]) or _request_line(lines[0])
    del lines[0]
    head = None if start is None else _fields(lines, end + 4)
    if head is None:                    # a whole head we do not read: h11 judges it
        _check_framing(buf, max_head)
        return H11_JUDGES
    fields = head.fields
    if b"host" not in fields or not _HANDED_TO_H11.isdisjoint(fields):
        return H11_JUDGES              # (its framing fields passed _fields already)
    if len(fields) < len(head.headers) and [name for name, _ in head.headers].count(b"host") > 1:
        raise HTTPViolation("more than one Host")   # RFC 9112 3.2: which host is it for?
    head.method, head.target = start
    if head.framing is NO_BODY:
        head.framing = LENGTH          # a request without framing fields has an empty body
    return head


def _check_framing(buf, max_head: int) -> None:
    """framing_error() of a head h11 is to read, line by line up to its end as h11 finds it (a
    blank line, bare LF or not): h11 merges repeated Content-Lengths and takes one beside
    Transfer-Encoding, so this is asked first."""
    blank = _BLANK_LINE.search(buf, 1)           # (a blank line first is h11's to refuse)
    end = min(blank.end() if blank else len(buf), max_head)
    error = framing_error([(name.lower(), value) for name, value in _FRAMING_FIELD.findall(buf, 0, end)])
    if error is not None:
        raise HTTPViolation(error)


def parse_response(buf, head_request: bool = False, max_head: int = MAX_HEAD) -> Optional[MessageHead]:
    """The final response head at the front of `buf` (interim 1xx heads before it are skipped;
    `size` counts them too), or None while it is incomplete. Raises HTTPViolation."""
    start = 0
    while True:
        end = buf.find(b"\r\n\r\n", start)
        if end < 0 or end + 4 - start > max_head:
            if len(buf) - start > max_head:
                raise HTTPViolation("response head too large")
            if _BLANK_LINE.search(buf, start):   # a head ended by bare LFs: h11 would take it
                raise HTTPViolation("a bare LF in the response head")
            return None
        lines = (buf[start:end] if type(buf) is bytes else bytes(buf[start:end])).split(b"\r\n")
        status_line = _STATUS_LINES.get(lines[0]) or _status_line(lines[0])
        if status_line is None:
            raise HTTPViolation(f"malformed response head {bytes(buf[start:start + 120])!r}")
        status, reason, minor = status_line
        del lines[0]
        head = _fields(lines, end + 4)
        if head is None:
            raise HTTPViolation(f"malformed response head {bytes(buf[start:start + 120])!r}")
        if status < 200:                # 100 Continue and friends: the final answer follows
            start = end + 4
            continue
        head.status, head.reason, head.version = status, reason, b"1." + minor
        if minor == b"0":
            head.keep_alive = False
        if head_request or status in (204, 304):
            head.framing, head.length = NO_BODY, 0
        elif head.framing is NO_BODY:   # neither field: the body runs until the connection closes
            head.framing, head.keep_alive = UNTIL_CLOSE, False
        return head


_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)   # BodyReader states (chunked framing)


class BodyReader:
    """The body of one message, by its framing: feed it bytes as they come; it tells how many
    belong to the body (the rest is the next message), and hands out the body's own bytes (the
    chunks unframed) or just finds the end of the body while its bytes pass through as they are.
    Bad framing sets `error` (the bytes before it were good) instead of raising, so a relay can
    pass on what came before it and then fail."""

    # per reader: framing, remaining (LENGTH: body bytes left; CHUNKED: of this chunk) and done;
    # the rest starts as these class defaults (one reader per answer: see MessageHead)
    state = _SIZE
    error: Optional[str] = None
    _line = b""                           # a size or trailer line split across reads
    max_chunk = MAX_CHUNK

    def __init__(self, framing: str, length: int = 0, max_chunk: int = MAX_CHUNK):
        self.framing, self.remaining = framing, length
        self.done = framing is NO_BODY or (framing is LENGTH and not length)
        if max_chunk != MAX_CHUNK:
            self.max_chunk = max_chunk

    def feed(self, data, pieces: Optional[list] = None) -> int:
        """Read `data`; return how many of its bytes belong to the body. With `pieces`, append
        the body's own bytes to it."""
        framing, n = self.framing, len(data)
        if self.done or self.error is not None:
            return 0
        if framing is UNTIL_CLOSE:
            if pieces is not None and n:
                pieces.append(data)
            return n
        if framing is LENGTH:
            step = min(self.remaining, n)
            if pieces is not None and step:
                pieces.append(data if step == n else data[:step])
            self.remaining -= step
            self.done = not self.remaining
            return step
        pos = 0
        while pos < n:
            state = self.state
            if state is _SIZE and not self._line:   # the common case: a whole chunk in one read
                eol = data.find(b"\n", pos)
                match = _CHUNK_SIZE.fullmatch(data, pos, eol) if eol > pos else None
                if match is not None:
                    size = int(match.group(1), 16)
                    start = eol + 1
                    end = start + size
                    if 0 < size <= self.max_chunk and data[end:end + 2] == b"\r\n":
                        if pieces is not None:
                            pieces.append(data[start:end])
                        pos = end + 2
                        continue
            if state is _DATA:
                step = min(self.remaining, n - pos)
                if pieces is not None:
                    pieces.append(data[pos:pos + step])
                pos += step
                self.remaining -= step
                if not self.remaining:
                    self.state = _CRLF
                continue
            if state is _CRLF:
                need = 2 - len(self._line)
                got = self._line + data[pos:pos + need]
                if got != b"\r\n"[:len(got)]:
                    self.error = "a chunk longer than its size"
                    return pos
                pos += len(got) - len(self._line)
                if len(got) < 2:
                    self._line = got
                    continue
                self._line, self.state = b"", _SIZE
                continue
            if state is _DONE:
                break
            eol = data.find(b"\n", pos)
            if eol < 0:
                self._line += data[pos:]
                if len(self._line) > MAX_CHUNK_LINE:
                    self.error = "a chunk size line that never ends"
                return n if self.error is None else pos
            line = self._line + data[pos:eol] if self._line else data[pos:eol]
            if state is _SIZE:
                match = _CHUNK_SIZE.fullmatch(line)
                size = int(match.group(1), 16) if match is not None else -1
                if not 0 <= size <= self.max_chunk:
                    self.error = f"bad chunk size {bytes(line[:40])!r}"
                    return pos
                self.remaining, self.state = size, (_DATA if size else _TRAILER)
            elif line == b"\r":           # the blank line after the trailer fields: the end
                self.state, self.done = _DONE, True
            elif len(line) > MAX_CHUNK_LINE or _field_reading(line[:-1]) is None \
                    or not line.endswith(b"\r") or _TRAILER_FRAMING.match(line):
                self.error = f"bad trailer line {bytes(line[:40])!r}"   # (framing there: RFC 9110 6.5.1)
                return pos
            self._line = b""
            pos = eol + 1
            if self.done:
                break
        return pos

    def take(self, buf: bytearray) -> Optional[bytes]:
        """The body bytes complete in `buf` now, unframed and consumed (b"" when there are none
        yet), or None once the body has ended. Raises HTTPViolation on bad framing, once the
        good bytes before it were taken."""
        if self.error is not None:
            raise HTTPViolation(self.error)
        if self.done:
            return None
        if not buf:
            return b""
        framing = self.framing
        if framing is LENGTH or framing is UNTIL_CLOSE:   # one copy, off the front of buf
            remaining = self.remaining if framing is LENGTH else len(buf)
            if len(buf) <= remaining:
                piece = bytes(buf)
                buf.clear()
            else:
                piece = bytes(buf[:remaining])
                del buf[:remaining]
            if framing is LENGTH:
                self.remaining = remaining - len(piece)
                self.done = not self.remaining
            return piece
        pieces: list = []
        data = bytes(buf)
        used = 0
        if self.state is _SIZE and not self._line:
            # whole chunks, the way an engine writes an SSE event: one size line, its data, CRLF;
            # anything else (a chunk cut by the read, the last chunk, bad framing) from `used`
            # on is feed's, in the same state, to judge
            find, size_line, max_chunk, append = data.find, _CHUNK_SIZE.fullmatch, self.max_chunk, pieces.append
            while True:
                eol = find(b"\n", used)
                match = size_line(data, used, eol) if eol > used else None
                if match is None:
                    break
                start = eol + 1
                end = start + int(match.group(1), 16)
                if not start < end <= start + max_chunk or data[end:end + 2] != b"\r\n":
                    break
                append(data[start:end])
                used = end + 2
            if used < len(data):
                used += self.feed(data[used:] if used else data, pieces)
        else:
            used = self.feed(data, pieces)
        if used == len(buf):
            buf.clear()
        else:
            del buf[:used]
        if not pieces:
            if self.error is not None:
                raise HTTPViolation(self.error)
            return None if self.done else b""
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def end_of_stream(self) -> None:
        """The connection ended: the end of an until-close body; HTTPViolation for any other
        unfinished one."""
        if self.framing is UNTIL_CLOSE:
            self.done = True
        elif not self.done:
            raise HTTPViolation("the connection closed mid-body")


# The codec's writers: every head this file sends is written here, as pieces for one b"".join
# with what follows (no copy of a body). Names and values are bytes, as the parsers give them.
# The one table of reason phrases, and of the OpenAI error type of each status, for every head and
# error body the node and the ingress write.
REASONS = {
    200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
    404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large",
    429: b"Too Many Requests", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
    502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 431: "invalid_request_error", 499: "client_closed_request",
    500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error",
}


def error_body(status: int, message: str, code: Optional[str] = None,
               param: Optional[str] = None, etype: Optional[str] = None) -> bytes:
    """The body OpenAI's API (and so every OpenAI client) expects for an error. `etype` names
    a type other than the status's (OpenAI's 429 insufficient_quota, say)."""
    return crdt.dumps({"error": {"message": message, "type": etype or ERROR_TYPES.get(status, "api_error"),
                                 "param": param, "code": code}})


def _fields_out(out: List[bytes], headers: Iterable[Tuple[bytes, bytes]], drop: Container[bytes]) -> List[bytes]:
    for name, value in headers:
        if name not in drop:
            out += (name, b": ", value, b"\r\n")
    return out


def request_head(method: bytes, target: bytes, host: bytes, length: int,
                 headers: Iterable[Tuple[bytes, bytes]] = (), drop: Container[bytes] = ()) -> List[bytes]:
    """An HTTP/1.1 request head: host and content-length ours, then `headers` but those in `drop`."""
    out = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\ncontent-length: %d\r\n" % length]
    _fields_out(out, headers, drop).append(b"\r\n")
    return out


_NAME = operator.itemgetter(0)          # of a (name, value) field


def forwarded_request_head(head: MessageHead, host: bytes, length: int, forwarded: Dict[bytes, bool]) -> bytes:
    """The head of a request passed on (a node's to its engine): host and content-length ours,
    then the request's own field lines as they came (the codec judged each), but those whose
    name `forwarded` maps to False (hop-by-hop fields, ours). The lines are picked in C, not a
    loop of ours: a node writes one per request, on a cold CPU at 16 requests/s."""
    if not head.lines:                  # (a head h11 read: its fields, written again)
        return b"".join(request_head(head.method, head.target, host, length, head.headers,
                                     {name for name, keep in forwarded.items() if not keep}))
    kept = itertools.compress(head.lines, map(forwarded.get, map(_NAME, head.headers), itertools.repeat(True)))
    return b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
        head.method, head.target, host, length, b"\r\n".join([*kept, b""]))


def response_head(status: int, reason: bytes, headers: Iterable[Tuple[bytes, bytes]] = (),
                  drop: Container[bytes] = (), framing: str = LENGTH, length: int = 0,
                  close: bool = False) -> List[bytes]:
    """An HTTP/1.1 response head: `headers` but those in `drop`, then the framing (`length`
    bytes, none, or chunked for anything else) and, if `close`, connection: close."""
    out = _fields_out([b"HTTP/1.1 %d %s\r\n" % (status, reason)], headers, drop)
    if framing is NO_BODY:
        out.append(b"content-length: 0\r\n")
    elif framing is LENGTH:
        out.append(b"content-length: %d\r\n" % length)
    else:                                           # chunked as the engine sent it, or an until-close
        out.append(b"transfer-encoding: chunked\r\n")   # body we frame as chunked
    if close:
        out.append(b"connection: close\r\n")
    out.append(b"\r\n")
    return out


def answer_head(status: int, headers: Iterable[Tuple[bytes, bytes]], extra: bytes = b"") -> Tuple[bytes, bool, bool]:
    """(head, chunked, close): a response head of `headers` as given and `extra` (whole header
    lines) last; a content-length among them frames the body, else it is chunked (the ingress's
    answers, which pass an engine's framing on or choose it)."""
    framed = close = False
    out = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
    for name, value in headers:
        if name == b"content-length":
            framed = True
        elif name == b"connection" and b"close" in value.lower():
            close = True
        out.append(b"%s: %s\r\n" % (name, value))
    if not framed:
        out.append(b"transfer-encoding: chunked\r\n")
    out.append(extra + b"\r\n")
    return b"".join(out), not framed, close


def whole_answer_format(field: bytes) -> bytes:
    """The %-format of a whole answer with one more header `field`, for a writer that answers all
    day: % (status, reason, content type, length, the field's value, extra lines, body)."""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" + field.replace(b"%", b"%%")
            + b": %s\r\n%s\r\n%s")


def request_format(method: bytes, target: bytes, host: bytes, lines: bytes = b"") -> Tuple[bytes, bytes]:
    """A request head with a JSON body as a (before, after) pair around its length, for a writer
    that sends many on one route (the ingress caches one per route and session): before + b"%d"
    % length + b"\r\n" + its own lines + after. `lines`: whole header lines every one carries."""
    return (b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: "
            % (method, target, host), lines + b"\r\n")


def whole_response(status: int, body: bytes, ctype: bytes = b"application/json", close: bool = False,
                   headers: Iterable[Tuple[bytes, bytes]] = ()) -> bytes:
    """A whole answer with its body (and `headers` after its content-type), in one piece of bytes."""
    head = response_head(status, REASONS.get(status, b"Status"), ((b"content-type", ctype), *headers),
                         length=len(body), close=close)
    head.append(body)
    return b"".join(head)


_HOP_BY_HOP_FIELDS = HOP_BY_HOP - {b"content-length"}   # an answer head with none of these is relayed as it is
RELAY_READ = 262144                 # a read of a relayed stream, and twice it buffered pauses reading
RELAY_HIGH_WATER = 262144           # our writes to a slow reader above this pause the engine's answer
MAX_REQUEST_HEAD = 65536


class _Stream(asyncio.Protocol):
    """A TCP connection (or a relay stream's plaintext) as a reader and a writer in one, whose
    bytes are ours: what it read and no one took yet is `buffer`, so a hand-over (a relay link
    then read in callbacks, a splice, a dial-back handed over as a socket, a tunnel stream's
    _TunnelConnection) takes it from here and never from inside an asyncio StreamReader. Reads as a
    StreamReader does (read, readexactly, at_eof, exception), writes as a StreamWriter does
    (write, drain, close, get_extra_info); reading pauses while more than 2 * `limit` bytes
    wait that no read asked for, and EOF keeps the transport open for what we still write.
    `on_connection(stream)` when the transport is made (an accepting server's handler)."""

    def __init__(self, on_connection: Optional[Callable[[_Stream], Any]] = None, limit: int = 65536):
        self.on_connection, self.limit = on_connection, limit
        self.transport: Optional[asyncio.Transport] = None
        self.buffer = bytearray()
        self.eof = False                            # EOF or the connection lost: no more bytes come
        self.error: Optional[BaseException] = None  # how the connection was lost, raised by reads
        self._wanted = 0                            # bytes the waiting read needs in `buffer`
        self._reading: Optional[asyncio.Future] = None   # a read waiting for bytes
        self._drains: List[asyncio.Future] = []     # drains waiting for resume_writing
        self._paused = self._write_paused = self._lost = False

    # -- the transport's side (asyncio.Protocol) ---------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.on_connection is not None:
            self.on_connection(self)

    def data_received(self, data) -> None:
        buffer = self.buffer
        buffer += data
        if len(buffer) >= self._wanted:
            self._wake()
        if not self._paused and len(buffer) > 2 * self.limit and len(buffer) >= self._wanted:
            try:
                self.transport.pause_reading()
                self._paused = True
            except (AttributeError, NotImplementedError, RuntimeError):
                pass

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True                                 # half-closed: our answers still go out

    def connection_lost(self, exc) -> None:
        self.eof = self._lost = True
        if exc is not None:
            self.error = exc
        self._wake()
        for waiter in self._drains:
            if not waiter.done():
                waiter.set_exception(exc or ConnectionResetError("Connection lost"))
        self._drains = []

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drains:
            if not waiter.done():
                waiter.set_result(None)
        self._drains = []

    def _wake(self) -> None:
        if self._reading is not None and not self._reading.done():
            self._reading.set_result(None)

    # -- the reader's side -------------------------------------------------------------------
    async def _wait(self, n: int) -> None:
        """Until `buffer` holds `n` bytes or no more come."""
        while len(self.buffer) < n and not self.eof:
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            self._wanted, self._reading = n, asyncio.get_running_loop().create_future()
            try:
                await self._reading
            finally:
                self._wanted, self._reading = 0, None

    def _take(self, n: int) -> bytes:
        buffer = self.buffer
        data = bytes(buffer[:n])
        del buffer[:n]
        if self._paused and len(buffer) <= self.limit:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes, as soon as there are any (b"" at the end)."""
        if self.error is not None:
            raise self.error
        if not self.buffer:
            await self._wait(1)
            if self.error is not None and not self.buffer:
                raise self.error
        return self._take(n)

    async def readexactly(self, n: int) -> bytes:
        if self.error is not None:
            raise self.error
        await self._wait(n)
        if len(self.buffer) < n:
            if self.error is not None:
                raise self.error
            raise asyncio.IncompleteReadError(self._take(len(self.buffer)), n)
        return self._take(n)

    def hand_over(self) -> bytes:
        """What was read and not taken: the next protocol of the transport's (nothing is left here)."""
        data, self.buffer = bytes(self.buffer), bytearray()
        return data

    def at_eof(self) -> bool:
        return self.eof and not self.buffer

    def exception(self) -> Optional[BaseException]:
        return self.error

    # -- the writer's side -------------------------------------------------------------------
    def write(self, data) -> None:
        self.transport.write(data)

    def writelines(self, data) -> None:
        self.transport.writelines(data)

    def write_eof(self) -> None:
        self.transport.write_eof()

    async def drain(self) -> None:
        if self.error is not None:
            raise self.error
        if self.transport.is_closing():
            await asyncio.sleep(0)                  # let connection_lost come first, as asyncio's does
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if self._write_paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drains.append(waiter)
            await waiter

    def get_extra_info(self, name: str, default=None):
        return self.transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()


async def open_stream(host: str, port: int, limit: int = 65536) -> _Stream:
    """A TCP connection to host:port as a _Stream (OSError when it cannot be made)."""
    stream = _Stream(limit=limit)
    await asyncio.get_running_loop().create_connection(lambda: stream, host, port)
    return stream


class _EngineConn(asyncio.Protocol):
    """A kept-alive connection to the engine, read in its callbacks: while a tunnel connection
    relays an answer it is `answer`, called from data_received (engine_data, engine_lost) with no
    task or future between; otherwise the bytes wait in `buf` for EngineClient's awaiting readers."""

    transport: Any = None
    body: Optional[BodyReader] = None              # the answer's body, for EngineClient.body
    keep_alive = True
    answer: Optional[_TunnelConnection] = None
    waiter: Optional[asyncio.Future] = None
    lost = False                                    # EOF or the connection lost: no more bytes come

    def __init__(self):
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.answer is not None:
            self.answer.engine_data(data)
            return
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def eof_received(self) -> bool:
        self.connection_lost(None)
        return False

    def connection_lost(self, exc) -> None:
        if not self.lost:
            self.lost = True
            if self.answer is not None:
                self.answer.engine_lost()
            elif self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    async def readable(self, timeout: Optional[float]) -> None:
        """Until more bytes came or the connection ended (asyncio.TimeoutError after `timeout`)."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await (self.waiter if timeout is None else asyncio.wait_for(self.waiter, timeout))
        finally:
            self.waiter = None


def _text(value) -> bytes:
    return value.encode("latin-1") if isinstance(value, str) else value


class EngineClient:
    """The one HTTP client path: keep-alive HTTP/1.1 connections to an engine on loopback, read
    by the codec. The tunnel relays its answers from the connections' callbacks (pooled, connect);
    health checks, model discovery and tests await them (exchange, send_raw, body, get)."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ConfigError(f"bad engine URL {url!r}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port
        self.host_header = f"{self.host}:{self.port}".encode()
        self.idle: List[_EngineConn] = []

    def pooled(self) -> Optional[_EngineConn]:
        """A kept-alive connection from the pool, or None (those the engine closed while they
        idled, or that read what no one asked for, are dropped)."""
        while self.idle:
            conn = self.idle.pop()
            if not (conn.lost or conn.buf or conn.transport.is_closing()):
                return conn
            conn.transport.close()
        return None

    async def connect(self) -> _EngineConn:
        conn = _EngineConn()
        try:
            await asyncio.get_running_loop().create_connection(lambda: conn, self.host, self.port)
        except OSError as exc:
            raise EngineError(f"engine unreachable at {self.host}:{self.port}: {exc}") from None
        return conn

    def release(self, conn: _EngineConn, reusable: bool) -> None:
        conn.answer = None
        if reusable and not conn.lost:
            conn.buf.clear()
            self.idle.append(conn)
        else:
            conn.transport.close()

    async def exchange(self, method: str, target: str, headers=(), body: bytes = b"",
                       timeout: Optional[float] = None):
        """Send one request; return (its response's MessageHead, connection). Read the body with
        `body()`. A pooled connection the engine closed while idle is retried once on a fresh one."""
        request = request_head(_text(method), _text(target), self.host_header, len(body),
                               [(_text(name), _text(value)) for name, value in headers])
        request.append(body)
        conn, buf, head = await self.send_raw(b"".join(request), method == "HEAD", timeout)
        conn.body, conn.keep_alive = BodyReader(head.framing, head.length), head.keep_alive
        return head, conn

    async def send_raw(self, request: bytes, head_only: bool = False, timeout: Optional[float] = None):
        """Write a ready-made request (head and body bytes); return (connection, bytes read past
        the response head, its MessageHead)."""
        for attempt in range(2):
            conn = self.pooled() if attempt == 0 else None
            fresh = conn is None                    # the retry is always on a new connection
            conn = conn if conn is not None else await self.connect()
            conn.transport.write(request)
            try:
                while True:
                    head = parse_response(conn.buf, head_only)
                    if head is not None:
                        del conn.buf[:head.size]
                        return conn, conn.buf, head
                    if conn.lost:
                        raise EngineError("engine closed the connection without an answer")
                    await conn.readable(timeout)
            except HTTPViolation as exc:
                conn.transport.close()
                raise EngineError(f"bad response from the engine: {exc}") from None
            except (OSError, EngineError, asyncio.TimeoutError) as exc:
                conn.transport.close()
                if fresh or attempt or conn.buf:
                    raise EngineError(str(exc) or type(exc).__name__) from None
        raise EngineError("unreachable")            # pragma: no cover

    async def body(self, conn: _EngineConn, timeout: Optional[float] = None):
        """Yield the response body piece by piece; return the connection to the pool after."""
        done = False
        try:
            while True:
                piece = conn.body.take(conn.buf)
                if piece is None:
                    done = True
                    return
                if piece:
                    yield piece
                elif conn.lost:
                    conn.body.end_of_stream()       # the end of an until-close body, or an error
                    conn.keep_alive = False
                else:
                    await conn.readable(timeout)
        except (OSError, HTTPViolation, asyncio.TimeoutError) as exc:
            raise EngineError(str(exc) or type(exc).__name__) from None
        finally:
            self.release(conn, done and conn.keep_alive and not conn.buf)

    async def get(self, path: str, timeout: float) -> Tuple[int, bytes]:
        response, conn = await self.exchange("GET", path, timeout=timeout)
        data = b"".join([chunk async for chunk in self.body(conn, timeout)])
        return response.status, data

    def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle = []


# =============================================================================================
# Tunnel security: mutual TLS from the cluster's key material, and no work before authentication
# =============================================================================================
# Theory of operation. `keygen` writes one cluster certificate and its private key beside the
# cluster secret; every member holds the same pair. The tunnel port is then TLS 1.3 with the
# certificate required on both sides and that one certificate as the only trust anchor (pinned:
# a peer must hold the cluster's TLS key to finish the handshake). No credential crosses the
# wire: each connection's keys come from a fresh ECDHE exchange, and Python's ssl offers no
# 0-RTT data, so recorded handshake or request bytes replayed on a new connection are refused.
# Rules:
#   1. A stranger costs bounded memory, descriptors and time: at most max_unauthenticated
#      connections wait for their handshake or credential (a newcomer cuts the oldest), all
#      within head_timeout; max_tunnel_connections in all (the one over gets a 503 body).
#   2. A request's credential is judged on its head, before one byte of its body is read.
#   3. The same port still answers plain HTTP for GET /healthz and /v1/registry (readiness
#      probes, curl): the first byte tells a TLS ClientHello (0x16) from a request line. A plain
#      tunnelled request to a TLS node is refused (403), never forwarded.
# Without the certificate (keygen without openssl, or a test's in-memory key) the tunnel is the
# older plain HTTP with the static header credential, and the node says so at start.
TLS_RECORD_HANDSHAKE = 0x16         # the first byte of every TLS ClientHello
TLS_SERVER_NAME = "otela-cluster"   # the certificate's CN; hosts are not named in it (rule: pin)
OPEN_PATHS = (b"/healthz", b"/v1/registry")   # GET without a credential, on plain HTTP too


def tunnel_credential(key: bytes) -> str:
    """The static credential of the plain tunnel (TUNNEL_HEADER's value) under a cluster key."""
    return hmac.new(key, b"tunnel", hashlib.sha256).hexdigest()


def tunnel_tls(config: Config) -> Tuple[Optional[ssl.SSLContext], Optional[ssl.SSLContext]]:
    """(server, client) contexts for the data tunnel, or (None, None) without a certificate.
    Raises ConfigError when the files are there but unusable."""
    if not config.tls_cert:
        return None, None
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        try:
            if purpose == ssl.PROTOCOL_TLS_SERVER and config.job_tls is not None:
                _load_job_pair(ctx, *config.job_tls)   # our grant's own: what an ingress pins
            else:
                ctx.load_cert_chain(config.tls_cert, config.tls_key)
            ctx.load_verify_locations(cafile=config.tls_cert)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the cluster certificate {config.tls_cert}: {exc}") from None
        ctx.check_hostname = False                  # the pinned certificate names the cluster
        ctx.verify_mode = ssl.CERT_REQUIRED         # mutual: the ingress shows it too
        contexts.append(ctx)
    return contexts[0], contexts[1]


def _load_job_pair(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """The job's certificate and key (from its grant file) into `ctx`: ssl reads only files, so
    they pass through a folder of our own, gone once read."""
    with tempfile.TemporaryDirectory() as tmp:
        crt, tls_key = os.path.join(tmp, "job.crt"), os.path.join(tmp, "job.key")
        _write_private(crt, cert)
        _write_private(tls_key, key)
        ctx.load_cert_chain(crt, tls_key)


def find_tunnel_tls(key_file: str) -> Tuple[str, str]:
    """keygen's cluster.crt and cluster-tls.key beside the cluster key, or ("", ""). The TLS key
    must be private to its owner, as the cluster key is."""
    folder = os.path.dirname(os.path.abspath(key_file))
    crt, tls_key = os.path.join(folder, "cluster.crt"), os.path.join(folder, "cluster-tls.key")
    if not (os.path.isfile(crt) and os.path.isfile(tls_key)):
        return "", ""
    mode = os.stat(tls_key).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"cluster TLS key {tls_key} is accessible by others (mode {stat.S_IMODE(mode):o});"
                          f" run chmod 600 {tls_key}")
    return crt, tls_key


def _busy_answer() -> bytes:
    body = error_body(503, "node at its connection limit; retry on another session", "busy")
    return whole_response(503, body, close=True)


BUSY_ANSWER = _busy_answer()        # the connection over max_tunnel_connections: one send, no read
LISTEN_BACKLOG = 1024               # a burst of reconnects after an ingress restart waits, not refused


def _listen(host: str, port: int) -> socket.socket:
    """The tunnel port's listening socket (accepted by Tunnel.accept, which admits)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


_WHOLE_BODY = BodyReader(NO_BODY)   # done: an answer relayed whole in one read (engine_data)


class _TunnelConnection(asyncio.Protocol):
    """One tunnel connection, served from its protocol callbacks alone, as the ingress serves a
    client: its admission (authenticated yet; one watchdog timer that cuts it at its current
    deadline: head, body or idle), its one parser, and the request being answered.

    data_received feeds `buf` and `serve` moves the requests on, one at a time: the codec reads
    each head (h11 reads a request the codec leaves to it, then hands the connection back), the
    credential is judged on the head (rule 2), the body is read as it arrives, and the whole
    request goes to the engine on a kept-alive connection whose data_received calls engine_data
    here: the answer's head is parsed (and re-written when it holds a hop-by-hop field or its
    framing is not the client's), then its body goes to the client as each read comes, read by
    a BodyReader only for its end; an answer whole in one read, with nothing to re-write, goes
    out as that read (the request's own field lines went to the engine as they came too). No
    task or future on that path (a new engine connection is a future that calls `_engine_ready`
    back). Backpressure: the engine's reading pauses while our writes to the client are over
    RELAY_HIGH_WATER (pause_writing), the client's while it is far ahead of us (pipelining). An
    answer the engine cuts is cut for the client too, never a silent 200; a client gone while
    the engine works (its reset, or its EOF: the ingress never half-closes) drops the engine's
    connection, which aborts the request there."""

    # per connection (`buf`, `parts`, the tunnel and its loop are set in __init__; the rest starts as these)
    task: Optional[asyncio.Task] = None             # its admission (a handshake) until connection_made
    transport = _timer = None                       # (_timer: the watchdog's, due at `deadline`)
    deadline, tls, authenticated = math.inf, False, False
    eof = closed = serving = False                  # the client's side closed; all gone; serve runs
    write_paused = read_paused = False
    h11: Optional[h11.Connection] = None            # reading a request the codec left to it
    head: Optional[MessageHead] = None              # the request whose body is being read ...
    body: Optional[BodyReader] = None               # ... its reader, and its size so far
    size = 0
    # the request being answered (busy): at the engine from _forward until _answered
    busy = close_after = head_only = False          # ... the connection closes after it; a HEAD
    request, retry = b"", False                     # the engine's request, kept for a retry when it
    engine_conn: Optional[_EngineConn] = None       # went on a pooled connection (maybe stale)
    answer: Optional[BodyReader] = None             # the engine's answer body, once its head came
    rechunk = extra = False                         # an until-close body; bytes past the answer
    reframe: Optional[h11.Connection] = None        # an HTTP/1.0 client's answer, framed by h11
    watch: Optional[_AnswerWatch] = None            # what EngineSpeed reads of it, with `sent`
    sent, others = 0.0, 0                           # and the requests the engine held then

    def __init__(self, tunnel: Tunnel):
        self.tunnel = tunnel
        self.loop = asyncio.get_running_loop()      # once: each asking is a getpid() system call
        self.buf = bytearray()                      # read, not parsed yet (while the codec reads)
        self.parts: List[bytes] = []

    # -- admission: the watchdog ---------------------------------------------------------------
    def arm(self, seconds: float) -> None:
        """Cut the connection `seconds` from now unless armed again or disarmed first. One timer,
        moved lazily: a later deadline waits for the one set (which then sets another), so a
        kept-alive connection's requests make no timer each."""
        loop = self.loop
        self.deadline = loop.time() + seconds
        if self._timer is None or self._timer.when() > self.deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self.deadline, self._due)

    def disarm(self) -> None:
        self.deadline = math.inf

    def _due(self) -> None:
        self._timer, now = None, self.loop.time()
        if self.deadline <= now:
            self.cut()
        elif self.deadline < math.inf:
            self.arm(self.deadline - now)

    def cut(self) -> None:
        """Close at once (before the connection is made, its admission task is cancelled)."""
        self.disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.tunnel.admitted["tls" if self.tls else "plain"] += 1
        if self.tls:                                # the handshake showed the cluster certificate
            self.tunnel.authenticated(self)
        transport.set_write_buffer_limits(high=RELAY_HIGH_WATER)
        self._await_head()

    def take_over(self, stream: _MuxTunnel) -> None:
        """Become the protocol of a relay link's stream, with what it read before (its _Stream's)."""
        held = stream.stream
        stream.set_protocol(self)
        self.connection_made(stream)
        if held.buffer:
            self.data_received(held.hand_over())
        if stream.is_closing():                     # ended before this: its end went to the _Stream
            self.connection_lost(held.error)
        elif held.eof:
            self.eof_received()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.h11 is not None:
            self.h11.receive_data(data)
        else:
            self.buf += data
        if not self.busy:
            self.serve()
        elif not self.read_paused and len(self.buf) > 2 * RELAY_READ:
            self.read_paused = True                 # a client far ahead of us waits in its socket
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        if self.busy:
            # the ingress's end while the engine works for it: its client left (the ingress
            # closes the upstream connection then, never half-closes it) and the engine's
            # connection is closed now (connection_lost), which aborts the request there
            self.cut()
            return False
        if self.h11 is not None:
            self.h11.receive_data(b"")
        self.serve()
        return not self.tls                         # half-closed: an answer still goes out (TLS
                                                    # cannot: asyncio's SSL transport closes)

    def connection_lost(self, exc) -> None:
        if not self.closed:
            self.closed = self.eof = True
            self.cut()
            self.tunnel.forget(self)
            self._answered(False)                   # gone mid-answer: the engine's work is wasted

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.engine_conn is not None:
            self.engine_conn.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.engine_conn is not None:
            self.engine_conn.transport.resume_reading()
        elif not self.busy and not self.closed:
            self.serve()

    # -- requests, one after the other -----------------------------------------------------------
    def _await_head(self) -> None:
        """Between requests: a member may idle; a stranger, or a head begun, gets head_timeout."""
        cfg = self.tunnel.config
        self.arm(cfg.tunnel_idle_timeout if self.authenticated and not self.buf else cfg.head_timeout)
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def serve(self) -> None:
        """Read what is buffered, request by request, until more bytes are needed, a request is at
        the engine, our writes wait for the client, or the connection ends."""
        if self.serving:                            # called back from inside itself: its loop goes on
            return
        self.serving = True
        try:
            while not self.busy and not self.write_paused and not self.transport.is_closing():
                if not (self._h11_step() if self.h11 is not None else self._codec_step()):
                    return
        except (h11.RemoteProtocolError, HTTPViolation) as exc:   # bad framing from the client
            self.transport.write(whole_response(400, error_body(400, f"bad request: {exc}", "bad_request"),
                                                close=True))
            self.transport.close()
        except h11.ProtocolError:
            self.transport.close()
        finally:
            self.serving = False

    def _codec_step(self) -> bool:
        """One step of a request the codec reads; False while more bytes are needed."""
        buf, head = self.buf, self.head
        if head is not None:
            return self._body_step(head)
        head = parse_request(buf, MAX_REQUEST_HEAD) if buf else None
        if head is None and self.eof and buf or head is H11_JUDGES:   # (an unfinished head at the
            return self._to_h11()                                      # end: h11's to judge)
        if head is None or not self._admit(head, head.length):
            if head is None and self.eof:
                self.transport.close()
            return False
        if head.framing is LENGTH and len(buf) == head.size + head.length:   # the common case: one
            body = bytes(buf[head.size:])                                    # read, one whole request
            buf.clear()
            self._dispatch(head, body, not head.keep_alive)
            return True
        del buf[:head.size]
        self.head, self.body = head, BodyReader(head.framing, head.length)
        self.arm(self.tunnel.config.body_timeout)
        return self._body_step(head)

    def _body_step(self, head: MessageHead) -> bool:
        """Take the body's pieces buffered; once it is whole, the request is dispatched."""
        while True:
            piece = self.body.take(self.buf)
            if piece is None:
                self._dispatch(head, b"".join(self.parts), not head.keep_alive)
                return True
            if not piece:
                if self.eof:
                    self.transport.close()
                return False
            if not self._body_piece(piece):
                return False

    def _to_h11(self) -> bool:
        conn = self.h11 = h11.Connection(h11.SERVER)
        conn.receive_data(bytes(self.buf))
        self.buf.clear()
        if self.eof:
            conn.receive_data(b"")
        self.arm(self.tunnel.config.head_timeout + self.tunnel.config.body_timeout)
        return True

    def _h11_step(self) -> bool:
        """One event of a request h11 reads (HTTP/1.0, Expect, odd bytes); False while more bytes
        are needed. Its answer is framed by h11 for an HTTP/1.0 client."""
        conn = self.h11
        event = conn.next_event()
        if event is h11.NEED_DATA:
            return False
        kind = type(event)
        if kind is h11.Request:
            headers = header_items(event.headers)
            head = self.head = MessageHead(headers, dict(headers), 0)
            head.method, head.target = event.method, event.target
            head.keep_alive = event.http_version == b"1.1" and b"close" not in head.fields.get(b"connection", b"").lower()
            return self._admit(head, 0)
        if kind is h11.Data:
            return self._body_piece(event.data)
        if kind is h11.EndOfMessage and self.head is not None:
            self.reframe = conn if conn.their_http_version != b"1.1" else None
            self._dispatch(self.head, b"".join(self.parts), not self.head.keep_alive)
            return True
        self.transport.close()                      # ConnectionClosed, or a switch we never accept
        return False

    def _admit(self, head: MessageHead, length: int) -> bool:
        """Rule 2, on the head: whether its body may be read (else answered with an error, closed)."""
        refusal = self.tunnel.refusal(head, self)
        if refusal is None and length > self.tunnel.config.max_request_body:
            refusal = 413, error_body(413, "request body too large")
        if refusal is None:
            self.parts, self.size = [], 0
            return True
        self._respond(refusal[0], refusal[1], close=refusal[0] != 413)
        self.transport.close()
        return False

    def _body_piece(self, piece: bytes) -> bool:
        self.parts.append(piece)
        self.size += len(piece)
        if self.size <= self.tunnel.config.max_request_body:
            return True
        self._respond(413, error_body(413, "request body too large"))
        self.transport.close()
        return False

    def _respond(self, status: int, body: bytes, ctype: bytes = b"application/json", close: bool = False) -> None:
        """A whole answer (an HTTP/1.0 client is told the connection closes after it)."""
        old = self.h11 is not None and self.h11.their_http_version not in (None, b"1.1")
        self.transport.write(whole_response(status, body, ctype, close or old))

    def _dispatch(self, head: MessageHead, body: bytes, close_after: bool) -> None:
        """Answer one whole request: a page of the node's, a refusal, or the engine's answer."""
        self.disarm()                               # the engine may take minutes to answer
        self.head, self.busy, self.close_after = None, True, close_after
        tunnel = self.tunnel
        page = tunnel.pages.get(head.target.split(b"?", 1)[0]) if head.method == b"GET" else None
        if not tunnel.started():                    # between binding the port and joining
            self._respond(503, error_body(503, "node starting", "unavailable"))
        elif page is not None:
            self._respond(*page())
        elif tunnel.draining() or tunnel.engine is None:
            self._respond(503, error_body(503, "this session is draining" if tunnel.draining()
                                          else "no engine behind this node", "unavailable"))
        else:
            self._forward(head, body)
            return
        self._done()

    def _done(self) -> None:
        """The answer went out: on to the next request, or the end of the connection."""
        self.busy = False
        if self.h11 is not None:                    # the codec again, with what h11 buffered
            self.buf += self.h11.trailing_data[0]
            self.h11 = self.reframe = None
        if self.close_after:
            self.transport.close()
            return
        self._await_head()
        if self.buf or self.eof:                    # (else the next request's bytes call serve)
            self.serve()

    # -- the engine's answer ---------------------------------------------------------------------
    def _forward(self, head: MessageHead, body: bytes) -> None:
        """Send the request to the engine as it came (but hop-by-hop fields and ours)."""
        tunnel = self.tunnel
        self.watch = self.answer = None
        self.extra, self.head_only = False, head.method == b"HEAD"
        prefixes = None
        if head.method == b"POST" and tunnel.prefixes is not None:
            prefixes = head.fields.get(PREFIX_HEADER)
            self.watch = _AnswerWatch()
        self.adapters = head.method == b"POST" and head.target.split(b"?", 1)[0] in ADAPTER_ROUTES
        self.span = node_span(head.fields, head.target) if tunnel.tracer is not None else None
        self.request = forwarded_request_head(head, tunnel.engine.host_header, len(body), tunnel.forwarded) + body
        self.others, self.sent = tunnel.inflight(1), time.monotonic()
        self._to_engine(tunnel.engine.pooled())
        if prefixes is not None:                    # booked while the engine works: nothing waits on it
            tunnel.prefixes.add(list(decode_prefixes(prefixes.decode("latin-1")))[:PREFIX_MAX_ANCHORS])

    def _to_engine(self, conn: Optional[_EngineConn]) -> None:
        self.retry = conn is not None
        if conn is None:                            # a new connection: its future calls back
            self.tunnel.spawn(self.tunnel.engine.connect()).add_done_callback(self._engine_ready)
            return
        self.engine_conn, conn.answer = conn, self
        conn.transport.write(self.request)

    def _engine_ready(self, future: asyncio.Future) -> None:
        exc = None if future.cancelled() else future.exception()
        if future.cancelled() or (exc is None and not self.request):   # the client went meanwhile
            if not future.cancelled():
                future.result().transport.close()
        elif exc is None:
            self.engine_conn, future.result().answer = future.result(), self
            self.engine_conn.transport.write(self.request)
        elif self.request:
            self._engine_failed(str(exc) or type(exc).__name__)

    def engine_data(self, data: bytes) -> None:
        """The engine's bytes (its connection's data_received): the answer's head, then its body."""
        if self.answer is not None:
            self._relay(data, [], False)
            return
        buf = self.engine_conn.buf
        if buf:                                     # (a head in pieces: rare)
            buf += data
            data = bytes(buf)
        try:
            head = parse_response(data, self.head_only)
        except HTTPViolation as exc:
            self._engine_failed(f"bad response from the engine: {exc}")
            return
        if head is None:
            if not buf:
                buf += data
            return
        buf.clear()
        if self.span is not None:
            self.span += (time.monotonic(), head.status)
        self.retry, self.rechunk = False, head.framing is UNTIL_CLOSE
        self.engine_conn.keep_alive = head.keep_alive
        if self.watch is not None and (head.status != 200 or not head.fields.get(
                b"content-type", b"").startswith(b"text/event-stream")):
            self.watch = None                       # only a stream's first byte is its first token
        verbatim = self.reframe is None and not self.close_after and head.version == b"1.1" \
            and _HOP_BY_HOP_FIELDS.isdisjoint(head.fields) and data.find(b"\r\n\r\n") + 4 == head.size
        if verbatim and head.framing is LENGTH and len(data) == head.size + head.length and self.watch is None:
            # (the common plain answer) its head and whole body in this read, nothing to drop,
            # re-frame or watch: the read goes out as it came, and the answer is done
            self.answer = _WHOLE_BODY
            self.transport.write(data)
            self._answered(True)
            self._done()
            return
        self.answer = BodyReader(head.framing, head.length)
        if self.reframe is not None:
            out = [self.reframe.send(h11.Response(
                status_code=head.status, reason=head.reason,
                headers=[(n, v) for n, v in head.headers if n not in HOP_BY_HOP or n == b"content-length"]))]
        elif verbatim and head.framing is LENGTH:
            out = [data[:head.size]]                # its head as it came: nothing to drop
        else:
            out = response_head(head.status, head.reason, head.headers, HOP_BY_HOP, head.framing, head.length,
                                self.close_after)
        self._relay(data[head.size:], out, True)

    def _relay(self, data: bytes, out: List[bytes], first: bool) -> None:
        """Body bytes to the client as the engine framed them (an until-close body chunked, an
        HTTP/1.0 client's unframed by h11), after `out` (`first`: the head, not sent yet); at
        the body's end, the answer is done."""
        body = self.answer
        if self.reframe is not None:
            pieces: List[bytes] = []
            used = body.feed(data, pieces)
            out += [self.reframe.send(h11.Data(data=piece)) for piece in pieces]
        else:
            used = body.feed(data)
            if self.rechunk and used:
                out += (b"%x\r\n" % used, data, b"\r\n")
            elif used:
                out.append(data if used == len(data) else data[:used])
        if body.error is not None and first:       # nothing went out yet: a clear 502
            self._engine_failed(f"bad response from the engine: {body.error}")
            return
        self.extra = self.extra or used < len(data)   # bytes past the body: not reusable
        if self.watch is not None and used:
            self.watch.seen(data[:used])
        if body.done and (self.reframe is not None or self.rechunk):
            out.append(self.reframe.send(h11.EndOfMessage()) if self.reframe is not None else b"0\r\n\r\n")
        if out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        if body.error is not None:                  # what came before it went out: now the cut
            self._answered(False)
            self.transport.close()
        elif body.done:
            self._answered(not self.extra)
            self._done()

    def engine_lost(self) -> None:
        """The engine's connection ended: the end of an until-close body, a pooled connection the
        engine closed while it idled (the request goes again, on a new one), or a failure."""
        if self.answer is None and self.retry and not self.engine_conn.buf:
            self.engine_conn.answer = self.engine_conn = None
            self._to_engine(None)
        elif self.answer is None:
            self._engine_failed("engine closed the connection without an answer")
        elif self.answer.framing is UNTIL_CLOSE:
            self.answer.end_of_stream()
            self._relay(b"", [], False)
        else:
            self._answered(False)                   # cut mid-body: cut for the client too
            self.transport.close()

    def _engine_failed(self, why: str) -> None:
        """No answer from the engine (nothing went out yet): a 502, and on to the next request."""
        self._answered(False)
        self._respond(502, error_body(502, f"engine failed: {why}", "bad_gateway"))
        self._done()

    def _answered(self, reusable: bool) -> None:
        """The engine's part of a request is over (booked once): its connection back to the pool
        (or closed), the node's count, the engine's speed."""
        if not self.request:
            return
        tunnel, conn, watch, body = self.tunnel, self.engine_conn, self.watch, self.answer
        self.request, self.engine_conn, self.watch, self.answer = b"", None, None, None
        if conn is not None:
            if self.write_paused:
                conn.transport.resume_reading()
            tunnel.engine.release(conn, reusable and conn.keep_alive)
        tunnel.inflight(-1)
        if self.adapters and tunnel.on_adapters is not None:
            tunnel.on_adapters()
        if self.span is not None:
            tunnel.tracer.add((*self.span, time.monotonic()))
        if watch is not None and body is not None and body.done and tunnel.speed is not None:
            tunnel.speed.answered(watch, self.sent, self.others)


async def _wait_readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


class Tunnel:
    """The tunnel port's side of a worker: admission (caps, TLS, credential: "Tunnel security"),
    then HTTP (a _TunnelConnection per connection): the node's pages answer GET /v1/registry and
    /healthz, anything else goes to the engine and its answer comes back as it is read. Its
    connections are accepted sockets, punched or dialled-back ones, and streams on relay links
    (_MuxTunnel): `admit` takes any of them.

    What it is given, and nothing of the node's else: the config, the TLS server context (None:
    the plain tunnel with its header credential), the engine (None: refused with a 503), `spawn`
    (runs a task the node stops), the `refused` counters, the node's `pages` (path -> a function
    giving (status, body)), `started` and `draining` (whether the node has joined, is draining),
    `inflight(step)` (adds to the node's count of requests at the engine, returns the count
    before) and the recorders of what the engine was sent and how fast it answered."""

    def __init__(self, config: Config, tls: Optional[ssl.SSLContext], engine: Optional[EngineClient],
                 spawn: Callable[[Any], asyncio.Task], refused: collections.Counter,
                 pages: Dict[bytes, Callable[[], Tuple[int, bytes]]], started: Callable[[], bool],
                 draining: Callable[[], bool], inflight: Callable[[int], int],
                 prefixes: Optional[PrefixSummary] = None, speed: Optional[EngineSpeed] = None):
        self.config, self.tls, self.engine, self.spawn, self.refused = config, tls, engine, spawn, refused
        self.pages, self.started, self.draining, self.inflight = pages, started, draining, inflight
        self.prefixes, self.speed = prefixes, speed
        self.credentials = [tunnel_credential(k).encode() for k in [config.key] + config.accept_keys]   # rotation
        # the engine never sees these (name -> False; any other name is passed on)
        self.forwarded = dict.fromkeys(HOP_BY_HOP | {TUNNEL_HEADER.encode(), PREFIX_HEADER}, False)
        self.connections: Dict[_TunnelConnection, None] = {}     # every open one, oldest first
        self.unauthenticated: Dict[_TunnelConnection, None] = {}  # not past TLS or credential yet
        self.admitted = collections.Counter({"tls": 0, "plain": 0})   # connections opened
        self.on_adapters: Optional[Callable[[], None]] = None   # called when a load or unload was answered
        self.tracer: Optional[SpanExporter] = None   # --otlp-endpoint: each request's spans (node_spans)

    def cut_all(self) -> None:
        for connection in list(self.connections):
            connection.cut()

    async def accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await asyncio.sleep(0.1)        # out of descriptors: the caps below free some
                    continue
                return                              # the listening socket was closed (stop)
            self.admit(conn)

    def admit(self, conn: Union[socket.socket, _MuxTunnel]) -> None:
        """Rule 1: the cap on all connections, then on strangers (the oldest is cut). `conn`:
        an accepted (or punched, or dialled-back) socket, or a tunnel stream on a relay link."""
        cfg = self.config
        stream = isinstance(conn, _MuxTunnel)
        if not stream:
            conn.setblocking(False)
        if len(self.connections) >= cfg.max_tunnel_connections:
            self.refused["busy"] += 1
            try:
                (conn.write if stream else conn.send)(BUSY_ANSWER)
            except OSError:
                pass
            conn.close()
            return
        if not stream:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        connection = _TunnelConnection(self)
        self.connections[connection] = None
        self.unauthenticated[connection] = None
        if len(self.unauthenticated) > cfg.max_unauthenticated:
            self.refused["cut"] += 1
            oldest = next(iter(self.unauthenticated))
            del self.unauthenticated[oldest]       # counted out now; its task closes it next
            oldest.cut()
        connection.arm(cfg.head_timeout)
        connection.task = self.spawn(self._open(conn, connection))
        connection.task.add_done_callback(functools.partial(self._opened, connection, conn))

    async def _open(self, conn: Union[socket.socket, _MuxTunnel], connection: _TunnelConnection) -> None:
        """Rule 3 and the handshake: the connection's protocol takes it over from there."""
        try:
            await self._handshake(conn, connection)
        except OSError:
            pass

    async def _handshake(self, conn: Union[socket.socket, _MuxTunnel], connection: _TunnelConnection) -> None:
        if isinstance(conn, _MuxTunnel):            # its first byte decides, its handshake in memory
            mode = await conn.ready
            if mode is None:
                self.refused["handshake"] += 1
                return
            connection.tls = mode == "tls"
            connection.take_over(conn)
            return
        ctx = self.tls
        if ctx is not None:                         # rule 3: a ClientHello, or plain HTTP?
            await _wait_readable(conn)
            first = conn.recv(1, socket.MSG_PEEK)
            if first and first[0] != TLS_RECORD_HANDSHAKE:
                ctx = None
        connection.tls = ctx is not None
        kwargs = {"ssl": ctx, "ssl_handshake_timeout": self.config.head_timeout} if ctx is not None else {}
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: connection, conn, **kwargs)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ValueError):
            self.refused["handshake"] += 1          # no certificate, the wrong one, a replay

    def _opened(self, connection: _TunnelConnection, conn: Union[socket.socket, _MuxTunnel],
                task: asyncio.Task) -> None:
        """A connection whose protocol was never made (refused, cut, or failed before it) is
        forgotten and closed here, whether its task ran or was cancelled before it could."""
        connection.task = None
        if connection.transport is None:
            connection.cut()
            self.forget(connection)
            conn.close()

    def forget(self, connection: _TunnelConnection) -> None:
        self.connections.pop(connection, None)
        self.unauthenticated.pop(connection, None)

    def authenticated(self, connection: _TunnelConnection) -> None:
        connection.authenticated = True
        self.unauthenticated.pop(connection, None)

    def refusal(self, head: MessageHead, connection: _TunnelConnection):
        """Rule 2, on the head: None when this request may be served (its body read), else the
        (status, error body) to answer before closing."""
        if head.method in (b"GET", b"HEAD") and head.target.split(b"?", 1)[0] in OPEN_PATHS:
            return None
        if connection.tls:
            return None                             # the handshake showed the cluster certificate
        if self.tls is not None:
            self.refused["credential"] += 1
            return 403, error_body(403, "this node's tunnel is TLS with the cluster certificate; plain requests "
                                        "are not forwarded", "tls_required")
        given = head.fields.get(TUNNEL_HEADER.encode(), b"")
        if not any(hmac.compare_digest(given, v) for v in self.credentials):
            self.refused["credential"] += 1
            return 403, error_body(403, "missing or bad tunnel credential", "forbidden")
        self.authenticated(connection)
        return None


# =============================================================================================
# NAT traversal and relay: reachability, relay links, relayed gossip, tunnel streams multiplexed on a link (or spliced)
# =============================================================================================
# Theory of operation. A worker asks each seed (ingress or relay) it bootstraps to, over TCP,
# to dial it back ("rq"); the seed answers ("rs") with the address it saw (`seen`) and whether
# its own TCP connect to the worker's gossip port worked (`back`). A worker no seed could dial
# is private: it keeps outbound TCP links to `relay_links` relays (any dialable member that
# relays; its own site's first, by measured round trip, then standalone relays and the ingress:
# Reach.rank_relays) and advertises
# "relay/<link id>" as its gossip and tunnel address, with its relays' gossip addresses in its
# record's "relay" (comma-separated; "relaying": true marks a member that relays). Rules:
#   1. Gossip: a private member sends everything over a link, each message inside an envelope
#      (FORWARD | destination | sealed message); the relay checks the inner HMAC (never work
#      for a stranger) and sends it on by UDP, or down the destination's link. Others reach a
#      relayed address through the first of its relays that is not suspected. Only what is
#      fresh (sealed within the replay window), new (no copy passed on before) and for a member
#      goes on: from outside, only down our own links; from a link, only to members (or one hop
#      on to a relayed member's relay). A captured datagram, replayed by anyone, reaches no
#      address of the replayer's choice (RelayServer._refusal).
#   2. Tunnel: the dialer (the ingress) opens TCP to a relay and asks for a splice with an
#      authentic hello (a fresh nonce: not replayable); the relay opens a stream on the private
#      member's link (relay_mux, the default) and bridges the dialer's connection to it. The
#      link carries numbered streams (MUX frames: OPEN, DATA, CREDIT, CLOSE) beside gossip:
#      each side may have MUX_WINDOW bytes of a stream in flight that the other has not
#      credited back, and credits only what its local side has drained, so a slow reader holds
#      up its own stream and never the link, and no stream holds more than MUX_WINDOW in memory;
#      at most max_link_streams per link (an OPEN over it is answered CLOSE; each stream is a
#      tunnel connection at the member, under that port's caps on strangers); a link that dies
#      cuts every stream at once, and the dialer retries an unanswered request elsewhere. The
#      member serves a stream as an admitted tunnel connection with no socket (_MuxTunnel):
#      TLS runs end to end, its server side in memory (SSLContext.wrap_bio, the tunnel port's
#      context), fed by the link's DATA frames; the relay forwards only ciphertext, and no
#      connection, descriptor or system call is added per stream (a socketpair per stream, or
#      asyncio's SSLProtocol over an in-memory transport, cost the member's node more CPU per
#      request than the direct path: tests/bench_node.py, nat_phase). relay_mux 0 (at the relay, or at the member:
#      its link hello says "mux": 0): the relay asks the member over its link to dial back, and
#      splices the two connections byte for byte. A dialer that holds the member's link itself
#      (the ingress as its relay) asks for the dial-back and takes that connection as it is, in
#      either mode: there is no relay hop to save, and streams on its link would cost the busy
#      dialer's loop a bridge per chunk.
#      A forwarded request's cost at a relay is mostly its writes, so a link's reads are parsed
#      in place (a mux frame is a view of the bytes read, its DATA written on as it is), and
#      what the streams send goes out once per read of the link or per loop turn (_MuxLink.flush).
#   3. A link that ends is replaced at the next check (relay_check_interval) and the record's
#      relays rewritten: same session, a new version, so a dead relay costs no eviction.
#   4. Hole punching, coordinated through a relay: of two private members, the one with the
#      smaller link id asks ("pq", through the relay) with a fresh UDP socket's mapping (as a
#      seed saw it, "ob"/"os"); the peer answers ("pr") with its own; both probe ("pp"/"pa")
#      each other's mapping, one side punch_delay after the other (attempt 1 the peer first,
#      attempt 2 the asker first: a leaky gateway remaps a port that an early packet touched, so
#      its side must send first). A path whose probe is acked carries their gossip from then on
#      ("reach": "punched"); a symmetric NAT or blocked UDP fails cleanly and the relay stays;
#      a punched path silent for punch_idle, or whose socket is gone, falls back to the relay.
#      What the Overlay sends over TCP (the third probe path, push-pull, answers to what came
#      relayed) takes the relay even then: a path that silently broke must not blind all three
#      probe paths at once for punch_idle.
#   5. Tunnel punching (TCP simultaneous open), for a private dialer and a private member (a
#      private ingress; a public dialer already gets the member's own outbound dial-back, rule 2):
#      once their UDP punch worked (both NATs keep a mapping per source port), each new tunnel
#      connection is tried punched first. Both sides bind a fresh port (SO_REUSEADDR/REUSEPORT),
#      learn its TCP mapping from a seed ("rq" without a dial-back), swap mappings through the
#      relay ("tq"/"tr") and connect() to each other from that port, a fresh SYN every
#      tunnel_syn_interval; the side that goes first alternates per attempt (a leaky gateway
#      remaps a port an early SYN touched, so its side must send first) until one order works,
#      which the pair keeps until it fails. The second side waits punch_delay for the first's
#      SYN to leave, except the dialer in a kept member-first order: the member connected as it
#      sent its mapping, so tunnel_reply_margin is enough (a new pooled connection then costs ~2
#      relay RTTs, not 0.3 s more). The dialer is the TLS
#      client; the member admits the socket as if accepted (TLS server, rule 1 of "Tunnel
#      security"). Within tunnel_punch_timeout or not at all: then the splice, and after two
#      failures in a row the pair goes straight to the relay for punch_retry.
#   6. A broken punched path (a NAT that lost its mapping, a firewall rule, a route change)
#      fails no request that has not started: punched connections carry TCP_USER_TIMEOUT and
#      keepalive (punched_tcp_timeout), so a dead one errors within seconds instead of TCP's
#      ~15 min; the ingress resends a request whose pooled connection died before any answer
#      on a fresh connection, whose punch fails within tunnel_punch_timeout and which is
#      spliced through the relay (a stream already answering is cut with an SSE error event).
#      Two failed punches in a row and new connections go straight to the relay. Every relay
#      check after punch_retry, a dialer whose tunnel to a peer is relayed while their UDP
#      path is punched probes a punch in the background; when it works the connection is kept
#      for the next dial (a spare, used within half the member's head_timeout) and the dialer's
#      listeners retire the relayed connections, so the tunnel goes punched again.
#   7. A seed that does not relay (an ingress with --no-relay) still names the relays it knows
#      in its "rs" ("relaying": false, "relays": their gossip addresses, members that relay and
#      are neither suspected nor relayed), so a private member whose only seed it is links to
#      them: it cannot learn of a relay through gossip before it holds a link. A member with no
#      link asks its seeds again every relay check (an "rq" without a dial-back) and says
#      NO_RELAY_TEXT once on stderr until it holds one. A member that waited for its first link
#      rejoins as a new session once it holds one: its first record (a dialable address, as it
#      thought) reached the seed with its join, was suspected and evicted while nothing could
#      carry a refutation, and an evicted session never comes back. (One that loses every link
#      later keeps its session: rule 3.) The old session goes LEFT with its first record: a
#      LEFT record naming our relayed address would make every member forget how to reach it.
#   8. A worker is not SERVING before its reach is known: until a seed dialled it back, or its
#      relayed address is in its record, its SERVING waits (Node.update holds it). Its first
#      record names the --listen address it binds, which for a private worker no dialer can
#      reach: an ingress that routed to it then would wait out a connect timeout per request,
#      and count those failures against a session that is fine once its record says "relay/…".
#      Nor does a member whose reach is checked offer to relay ("relaying") before a seed dialled
#      it back: a private worker started beside it would be named that address (rule 7) and
#      wait out tcp_timeout on a link that cannot open (5 s more before its own SERVING).
RELAYED_PREFIX = "relay/"           # the gossip/tunnel address of a member reached through relays
NAMED_RELAYS = 8                    # relays a seed names in its "rs": a few spares beyond relay_links,
                                    # and the answer stays one small frame (under max_datagram)
NO_RELAY_TEXT = ("no relay reachable: start `otela_node.py relay` or drop --no-relay on the ingress "
                 "(retrying every relay check)")
FORWARD = b"oR"                     # envelope: FORWARD | dest length (1 byte) | dest | sealed message


def is_relayed(addr: str) -> bool:
    return addr.startswith(RELAYED_PREFIX)


def envelope(dest: str, sealed: bytes) -> bytes:
    raw = dest.encode()
    return FORWARD + bytes((len(raw),)) + raw + sealed


def open_envelope(data: bytes) -> Optional[Tuple[str, bytes]]:
    if len(data) < 4 or data[:2] != FORWARD:
        return None
    end = 3 + data[2]
    try:
        return data[3:end].decode("ascii"), data[end:]
    except UnicodeDecodeError:
        return None


def frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


async def _read_frame(reader: asyncio.StreamReader, limit: int, timeout: Optional[float]) -> Optional[bytes]:
    """One length-prefixed frame (None at a clean end); ValueError when over `limit`."""
    try:
        head = await asyncio.wait_for(reader.readexactly(4), timeout)
    except asyncio.IncompleteReadError:
        return None
    (length,) = struct.unpack(">I", head)
    if length > limit:
        raise ValueError("oversized")
    return await asyncio.wait_for(reader.readexactly(length), timeout)


_FRAME_LENGTH = struct.Struct(">I")


class _LinkFrames(asyncio.Protocol):
    """A relay link read in its transport's callbacks once its hello is through (both ends):
    the frames complete after each read go to `on_frame` there and then, so a tunnel stream's
    DATA costs no task wake-up per read or per frame on the relay's hop or at the member.
    A mux frame goes as a memoryview of the bytes read (no copy; its DATA payload is written on
    as a view of it), any other frame as bytes. `mux`, the link's streams: what the read's
    frames send to the link and to each stream's local side goes out at the end of the read,
    one write each (_MuxLink.flush). `on_frame(data) -> bool`: False when the peer broke the
    protocol (the link goes). Flow control and the end go on to the link's _Stream
    (its writer, drained as before)."""

    def __init__(self, inner: asyncio.BaseProtocol, on_frame: Callable[[Any], bool], limit: int,
                 mux: Optional[_MuxLink] = None):
        self.inner, self.on_frame, self.limit, self.mux = inner, on_frame, limit, mux
        self.buf = bytearray()                      # a frame's start, until its rest arrives
        self.transport: Optional[asyncio.Transport] = None
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf:                                     # a frame's rest: whole yet?
            if len(buf) >= 4 and len(buf) + len(data) < 4 + _FRAME_LENGTH.unpack_from(buf)[0]:
                buf += data                         # no: keep gathering (no copy of the whole per read)
                return
            buf += data
            data = bytes(buf)                       # bytes, so views of it stay valid
            buf.clear()
        view = memoryview(data)
        pos, end = 0, len(data)
        mux, on_frame, limit = self.mux, self.on_frame, self.limit
        if mux is not None:
            mux.batching = True
        try:
            while end - pos >= 4:
                (length,) = _FRAME_LENGTH.unpack_from(data, pos)
                if length > limit:
                    raise ValueError("oversized")
                start = pos + 4
                if end - start < length:
                    break
                pos = start + length
                if not on_frame(view[start:pos] if data.startswith(MUX, start) else data[start:pos]):
                    raise ValueError("broken")
        except (OSError, ValueError):
            self.transport.abort()
            return
        finally:
            if mux is not None:
                mux.flush()
        if pos < end:
            buf += view[pos:]

    def eof_received(self) -> bool:
        return False                                # the transport closes: connection_lost

    def connection_lost(self, exc) -> None:
        self.inner.connection_lost(exc)
        if not self.done.done():
            self.done.set_result(None)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def _link_frames(stream: _Stream, on_frame: Callable[[Any], bool], limit: int,
                       mux: Optional[_MuxLink] = None) -> None:
    """Read the rest of a link through _LinkFrames (what the stream read already first) until
    it ends."""
    transport = stream.transport
    frames = _LinkFrames(stream, on_frame, limit, mux)
    frames.transport = transport
    early = stream.hand_over()
    if stream.eof or transport.is_closing():
        return
    transport.set_protocol(frames)
    if early:
        frames.data_received(early)
    if hasattr(transport, "is_reading") and not transport.is_reading() and not transport.is_closing():
        transport.resume_reading()                  # the stream reader had paused it (its limit)
    await frames.done


def _keepalive(conn: _Stream, timeout: float) -> None:
    """A long-lived relay link errors once nothing it sent is acked for `timeout` seconds
    (relay_link_timeout), or its keepalive probes go unanswered when idle: a vanished peer or a
    broken path is noticed by the kernel in seconds, and the link is replaced (rule 1): the watch
    a punched connection has (_watch_punched)."""
    sock = conn.get_extra_info("socket")
    if sock is not None:
        _watch_punched(sock, timeout)


def _no_delay(conn: _Stream) -> None:
    try:
        conn.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass


async def _pump(source: _Stream, sink: _Stream) -> None:
    """One way of a splice, byte for byte, until the source ends."""
    try:
        while True:
            data = await source.read(RELAY_READ)
            if not data:
                break
            sink.write(data)
            if sink.transport.get_write_buffer_size() > RELAY_HIGH_WATER:
                await sink.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        sink.close()


# -- Reach: the rules above as a pure object (no I/O; times passed in), like Overlay ----------
class PeerReach:
    """What this member knows of reaching one relayed address (one private process): its
    relays (from its record), when it became a member, and how its tunnel connections went."""

    __slots__ = ("relays", "since", "punch_tried", "tunnel", "attempts", "order", "failures", "given_up",
                 "probing")

    def __init__(self):
        self.relays: List[str] = []                 # its record's relays, best first
        self.since: Optional[float] = None          # first seen as a member (monotonic)
        self.punch_tried = -math.inf                # our last UDP punch towards it (wall clock)
        self.tunnel: Optional[str] = None           # how our last tunnel connection went: "punched"/"relayed"
        self.attempts = 0                           # tunnel punches tried (the orders alternate)
        self.order: Optional[bool] = None           # the order that worked (True: the member first), kept
                                                    # until it fails
        self.failures = 0                           # tunnel punches failed in a row
        self.given_up = -math.inf                   # the last failure (wall clock)
        self.probing = False                        # a re-punch probe is on (rule 6)


class Reach:
    """Per peer, one PeerReach; the rules of "NAT traversal and relay" that decide a path, as
    functions of that record, our own state and the time (`now`: wall clock, unless named
    monotonic). Node does the I/O they ask for.

    How a tunnel connection to a relayed address goes (RelayClient.open), first rule that holds:

        rule  when                                                         path
        6     a probe's punched connection is waiting, younger than       "spare"
              half the member's head_timeout
        5     both private, their UDP path punched, and under 2 tunnel    "punch" (then the
              punch failures in a row (or punch_retry since the last)     next rule if it fails)
        2     we hold the member's link ourselves                          "dial-back"
        2     otherwise                                                    "splice"

    How gossip reaches it (reach_of): "punched" while a punched UDP path is on record (rule 4),
    else "relayed"; a dialable member's address is "direct".

    Whether this member is dialable (--reach auto, from its seeds' answers to "rq": `seen`, the
    address a seed saw it connect from, and `back`, whether its dial-back to our address worked;
    RelayClient._dialled_back), first rule that holds:

        when                                                               judged
        a seed dialled us back and saw us at an address of this host      public ("direct")
        (no NAT translates our address on the way to it)
        a seed dialled us back but saw another address (a NAT's)          private: it reached us
                                                                           around the NAT, over a
                                                                           LAN (a login host on our
                                                                           site's); a member beyond
                                                                           the NAT, at another
                                                                           site, could not
        no seed dialled us back                                           private

    A seed of a release that says no `seen` is believed as before (its dial-back decides)."""

    TUNNEL_RULES = (("spare", "spare_fresh"), ("punch", "may_punch"), ("dial-back", "holds_link"),
                    ("splice", None))
    DIALABLE_RULES = ((True, "dialled_untranslated"), (False, None))

    def __init__(self, config: Config):
        self.config = config                        # punch_retry, max_punched
        self.peers: Dict[str, PeerReach] = {}

    def peer(self, addr: str) -> PeerReach:
        """Its record, made on first use."""
        peer = self.peers.get(addr)
        if peer is None:
            peer = self.peers[addr] = PeerReach()
        return peer

    def relays(self, addr: str) -> List[str]:
        peer = self.peers.get(addr)
        return peer.relays if peer is not None else []

    def learned(self, addr: str, relays: List[str], since: float) -> bool:
        """A live record of `addr` names `relays`; True the first time it does (then it is a
        member since `since`, monotonic, unless it was one before)."""
        peer = self.peer(addr)
        new = not peer.relays
        peer.relays = relays
        if new:
            self.member(addr, since)
        return new

    def member(self, addr: str, since: float) -> None:
        peer = self.peer(addr)
        if peer.since is None:
            peer.since = since

    def member_since(self, addr: str, default: float) -> float:
        peer = self.peers.get(addr)
        return peer.since if peer is not None and peer.since is not None else default

    def forget(self, addr: str) -> None:
        """Its record went LEFT (or away): a relayed address names one process, gone for good."""
        self.peers.pop(addr, None)

    @classmethod
    def dialable(cls, answers: Iterable[Mapping[str, Any]], ours: Callable[[str], bool]) -> bool:
        """Whether the seeds' `answers` make us dialable by every member (the table above);
        `ours(host)`: whether an address is this host's own."""
        facts = {"dialled_untranslated": lambda: any(a.get("back") and cls._untranslated(a.get("seen"), ours)
                                                     for a in answers)}
        return next(judged for judged, fact in cls.DIALABLE_RULES if fact is None or facts[fact]())

    @staticmethod
    def _untranslated(seen: Any, ours: Callable[[str], bool]) -> bool:
        """Whether a seed saw us at our own address (`seen`, HOST:PORT; none said: as if it did)."""
        if not isinstance(seen, str) or not seen:
            return True
        host = seen.rpartition(":")[0].strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return True                             # not an address we can judge: the dial-back decides
        mapped = getattr(ip, "ipv4_mapped", None)   # a dual-stack seed's view of an IPv4 asker
        return ours(str(mapped or ip))

    NEAR_RELAY_S = 0.005            # a relay this close (round trip) is at our own site: a LAN is
                                    # under a millisecond, and sites are rarely under 5 ms apart
    HELD_MARGIN = 1.5               # a relay we hold a link to is judged this much closer: a round
                                    # trip that wavers at a band's edge does not swap links (a link
                                    # dropped cuts the tunnel streams on it)
    ROLE_RANK = {"relay": 0, "ingress": 1}   # standalone relays exist for it, then ingresses, then
                                             # dialable workers

    @classmethod
    def rank_relays(cls, offers: Iterable[Tuple[str, str, Optional[float]]], held: Container[str] = ()) -> List[str]:
        """The relays `offers` names ((gossip address, role, our measured round trip or None)),
        best first: by distance band (our own site's, under NEAR_RELAY_S; then those not measured
        yet; then farther ones in bands a factor of two apart), within a band by role, then those
        we hold a link to (`held`), then address. So a private member gossips through its own site's relay, not through another
        site's (whose relay sends it back across the WAN), and among far ones the nearest."""
        def band(gossip: str, rtt: Optional[float]) -> int:
            if rtt is None:
                return 1
            if gossip in held:
                rtt /= cls.HELD_MARGIN
            if rtt < cls.NEAR_RELAY_S:
                return 0
            return 2 + int(math.log2(rtt / cls.NEAR_RELAY_S))
        ranked = sorted((band(gossip, rtt), cls.ROLE_RANK.get(role, 2), gossip not in held, gossip)
                        for gossip, role, rtt in offers)
        return [gossip for *_, gossip in ranked]

    LINK_RTOS = 16                  # a relay link's give-up time in its peer's srtt + 4 rttvar:
                                    # TCP resends after 1, 2, 4 and 8 RTOs, so the fourth resend of
                                    # a segment lost four times in a row is acked after ~16

    @classmethod
    def link_timeout(cls, setting: float, rto: Optional[float]) -> float:
        """How long a relay link may leave what it sent unacked before it is dead: the setting
        (relay_link_timeout), or LINK_RTOS of its peer's measured ack timeout when that is longer
        (a relay 1 s away at loss: its link is not cut in the middle of TCP's resends), in
        whole seconds (a new estimate at every ack does not set the socket again each time)."""
        if rto is None or cls.LINK_RTOS * rto <= setting:
            return setting
        return float(math.ceil(cls.LINK_RTOS * rto))

    def tunnel_reach(self, addr: str) -> str:
        peer = self.peers.get(addr)
        return (peer.tunnel if peer is not None else None) or "relayed"

    # -- rule 4: UDP hole punching ---------------------------------------------------------
    def punches_due(self, mine: str, punched: Any, now: float) -> List[str]:
        """The peers to punch towards now (marked tried): relayed, not punched, ours the smaller
        link id (that side asks), not tried within punch_retry, under max_punched paths."""
        due = []
        for addr, peer in self.peers.items():
            if not peer.relays or addr == mine or addr in punched or len(punched) >= self.config.max_punched:
                continue
            if mine[len(RELAYED_PREFIX):] > addr[len(RELAYED_PREFIX):] or now - peer.punch_tried < self.config.punch_retry:
                continue
            peer.punch_tried = now
            due.append(addr)
        return due

    # -- rules 5 and 6: the tunnel ---------------------------------------------------------
    def tunnel_path(self, addr: str, private: bool, punched: bool, holds_link: bool, spare_age: Optional[float],
                    head_timeout: float, now: float) -> str:
        """The path of a new tunnel connection to `addr` (the table above)."""
        facts = {"spare_fresh": lambda: spare_age is not None and spare_age < head_timeout / 2,
                 "may_punch": lambda: self.may_punch(addr, private, punched, now), "holds_link": lambda: holds_link}
        return next(path for path, fact in self.TUNNEL_RULES if fact is None or facts[fact]())

    def may_punch(self, addr: str, private: bool, punched: bool, now: float) -> bool:
        """Rule 5: both private, their UDP punch worked (cone NATs), and not given up on lately
        (after punch_retry the failed tries' conntrack entries are gone: the count starts over)."""
        if not (private and punched):
            return False
        peer = self.peers.get(addr)
        if peer is None or peer.failures < 2:
            return True
        if now - peer.given_up >= self.config.punch_retry:
            peer.failures = 0
            return True
        return False

    def punch_plan(self, addr: str, now: float) -> Tuple[bool, Optional[bool]]:
        """A tunnel punch starts: (the member first?, the kept order or None)."""
        peer = self.peer(addr)
        peer.attempts += 1
        kept = peer.order
        return (kept if kept is not None else peer.attempts % 2 == 1), kept   # odd attempts the member first

    def punch_failed(self, addr: str, kept: Optional[bool], now: float) -> None:
        peer = self.peer(addr)
        if kept is not None and peer.order is kept:
            peer.order = None                       # the kept order failed: alternate again
        peer.failures += 1
        peer.given_up = now

    def punch_worked(self, addr: str, peer_first: bool, now: float) -> None:
        peer = self.peer(addr)
        peer.order, peer.failures, peer.tunnel = peer_first, 0, "punched"

    def went(self, addr: str, path: str, now: float) -> None:
        """A tunnel connection to `addr` went `path` ("punched" or "relayed")."""
        self.peer(addr).tunnel = path

    def probes_due(self, punched: Any, spares: Any, private: bool, now: float) -> List[str]:
        """Rule 6: the peers whose tunnel went relayed after two failed punches while their UDP
        path is punched: a punch is probed in the background (marked probing)."""
        due = []
        for addr in list(punched):
            peer = self.peers.get(addr)
            if peer is not None and peer.tunnel == "relayed" and not peer.probing and addr not in spares \
                    and peer.failures >= 2 and self.may_punch(addr, private, True, now):
                peer.probing = True
                due.append(addr)
        return due

    def probe_done(self, addr: str, worked: bool, now: float) -> None:
        peer = self.peer(addr)
        peer.probing = False
        if not worked:
            peer.failures = max(2, peer.failures)   # still broken


# -- tunnel streams multiplexed on a relay link (rule 2) ----------------------------------
MUX = b"oS"                         # a mux frame on a link: MUX | kind (1) | stream id (4) | payload
MUX_OPEN, MUX_DATA, MUX_CREDIT, MUX_CLOSE = 1, 2, 3, 4
MUX_WINDOW = 262144                 # bytes in flight per stream each way: one LLM stream is KB/s,
                                    # a 16 MiB body moves at 256 KiB per RTT (~128 MB/s at 2 ms);
                                    # a stream's memory on either side never exceeds it
MUX_CHUNK = 65536                   # the largest DATA payload: under max_frame, and one SSL read
_MUX_HEAD = struct.Struct(">2sBI")
_MUX_FRAMED = struct.Struct(">I2sBI")   # the frame's length, then the mux head: packed at once


def mux_frame(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return _MUX_FRAMED.pack(_MUX_HEAD.size + len(payload), MUX, kind, stream) + payload


class _MuxCredit:
    """The flow control of one stream on a link, the same at both ends: the peer may send at
    most MUX_WINDOW bytes we have not credited back (more breaks the link), and we credit half
    a window at a time once our local side has taken it; our bytes beyond our credit wait in
    `held` and go out as DATA frames when credit comes."""

    def _start_credit(self, link: _MuxLink, sid: int) -> None:
        self.link, self.sid = link, sid
        self.credit = MUX_WINDOW                    # bytes we may still send
        self.window = MUX_WINDOW                    # bytes the peer may still send us
        self.owed = 0                               # bytes the local side took, not credited back yet
        self.held = bytearray()                     # local bytes waiting for credit
        self.closed = False                         # CLOSE sent or received: no more frames
        self.stalled = False                        # the local side takes nothing now: no credit back

    def _within_window(self, data: bytes) -> bool:
        if len(data) > self.window:                 # beyond its credit: a broken or hostile peer
            return False
        self.window -= len(data)
        return True

    def on_credit(self, amount: int) -> None:
        self.credit += amount
        self._send_held()

    def _send_held(self) -> None:
        held = self.held
        while held and self.credit > 0 and not self.closed:
            n = min(len(held), self.credit, MUX_CHUNK)
            self.link.send_data(self.sid, bytes(held[:n]))
            del held[:n]
            self.credit -= n

    def _send_or_hold(self, data: bytes) -> None:
        """Local bytes for the peer: one DATA frame when credit allows (the usual case, no
        copy), else held until credit comes."""
        if not self.held and len(data) <= self.credit and len(data) <= MUX_CHUNK:
            self.link.send_data(self.sid, data)
            self.credit -= len(data)
            return
        self.held += data
        self._send_held()

    def _taken(self, amount: int) -> None:
        """The local side took `amount` of the peer's bytes: credited back unless it stalls."""
        self.owed += amount
        if not (self.stalled or self.closed) and self.owed >= MUX_WINDOW // 2:
            self._credit_back()

    def _stall(self) -> None:
        self.stalled = True

    def _unstall(self) -> None:
        self.stalled = False
        self._taken(0)

    def _credit_back(self) -> None:
        if self.owed >= MUX_WINDOW // 2:            # half a window at a time: no frame per request,
            self.window += self.owed                # and never a stall (the peer stops at a whole one)
            self.link.send(mux_frame(MUX_CREDIT, self.sid, struct.pack(">I", self.owed)))
            self.owed = 0


class _MuxStream(_MuxCredit, asyncio.Protocol):
    """One tunnel stream on a link, bridged to a local stream (the dialer's connection, at the
    relay; the member serves its end as a _MuxTunnel), all in the transports' callbacks: no
    task and no copy queue per chunk. The peer may send at most MUX_WINDOW bytes we have not credited
    back; we credit what the local side has taken (its transport's buffer drained), so a slow
    reader holds up its own stream only. What we may not send yet for want of credit stops
    the local side's reading."""

    def __init__(self, link: _MuxLink, sid: int):
        self._start_credit(link, sid)               # held: one local read at most
        self.pending: List[bytes] = []              # the peer's bytes before the local side is attached
        self.local: List[bytes] = []                # the peer's bytes of this read of the link, written
                                                    # to the local side at its end (_MuxLink.flush)
        self.transport: Optional[asyncio.Transport] = None
        self.peer_closed = False
        self._paused = False                        # local reading stopped for want of credit
        self.done = asyncio.get_running_loop().create_future()

    # -- the link's side --------------------------------------------------------------------
    def on_data(self, data: bytes) -> bool:
        if not self._within_window(data):
            return False
        if self.transport is None:
            self.pending.append(data)
        elif not self.transport.is_closing():
            if not self.local:
                self.link.touch(self)
            self.local.append(data)
        return True

    def flush_local(self) -> None:
        """This read's DATA from the peer to the local side in one write, then credited."""
        local, transport = self.local, self.transport
        if not local:
            return
        self.local = []
        if transport is None or transport.is_closing():
            return
        if len(local) == 1:
            transport.write(local[0])
            self._taken(len(local[0]))
        else:
            transport.writelines(local)
            self._taken(sum(map(len, local)))

    def on_close(self) -> None:
        """The peer is done: what it sent reaches the local side, then the local side closes."""
        self.flush_local()
        self.closed = self.peer_closed = True
        self.link.streams.pop(self.sid, None)
        if self.transport is not None:
            self.transport.close()

    def cut(self) -> None:
        self.closed = True
        self.local = []
        if self.transport is not None:
            self.transport.abort()
        self._finish()

    # -- the local side (asyncio.Protocol) ---------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=0)   # pause_writing whenever a byte waits: credit
        for data in self.pending:                   # goes back only for what the kernel took
            transport.write(data)
            self._taken(len(data))
        self.pending.clear()
        if self.peer_closed:
            transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.closed:
            self._send_or_hold(data)

    def eof_received(self) -> bool:
        self.close()
        return False

    def connection_lost(self, exc) -> None:
        self.close()
        self._finish()

    pause_writing = _MuxCredit._stall               # the local side's write buffer is not empty:
    resume_writing = _MuxCredit._unstall            # no credit back until it drained

    # -- both ----------------------------------------------------------------------------------
    def _send_held(self) -> None:
        super()._send_held()
        held = self.held
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if held and not self._paused:
            self._paused = True
            transport.pause_reading()
        elif not held and self._paused:
            self._paused = False
            transport.resume_reading()

    def buffered(self) -> int:
        """Bytes of the peer's this side holds in memory (the local transport's buffer)."""
        pending = sum(len(d) for d in self.pending) + sum(len(d) for d in self.local)
        return pending + (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    def close(self) -> None:
        self.flush_local()
        if not self.closed:
            self.closed = True
            self.link.send(mux_frame(MUX_CLOSE, self.sid))
        self.link.streams.pop(self.sid, None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def bridge(self, local: _Stream) -> None:
        """Take over the local stream's transport (bytes it already read come first) and wait
        for the end of the stream."""
        transport = local.transport
        early = local.hand_over()                   # what arrived before the hand-over
        at_eof = local.eof
        transport.set_protocol(self)
        self.connection_made(transport)
        if not at_eof and hasattr(transport, "is_reading") and not transport.is_reading():
            transport.resume_reading()              # the stream reader had paused it (its limit)
        if early:
            self.data_received(early)
        if at_eof:
            self.close()
        try:
            await self.done
        finally:
            if not transport.is_closing():
                transport.close()


class _MuxLink:
    """The tunnel streams of one relay link: the relay (or a dialer holding the link) opens
    them, the member answers each as an admitted tunnel connection (`answer` makes the stream
    for a peer's OPEN: a _MuxTunnel at the member). Frames other than mux frames on the link
    (gossip, dial requests) are not ours."""

    def __init__(self, writer: _Stream, max_streams: int,
                 answer: Optional[Callable[[_MuxLink, int], Any]] = None):
        self.writer, self.max_streams = writer, max_streams
        self.answer = answer or _MuxStream
        self.streams: Dict[int, Any] = {}           # _MuxStream or _MuxTunnel
        self._next = 1
        self._drain_lock = asyncio.Lock()           # one drain at a time on the shared writer
        self.refused = 0                            # OPENs over max_streams, answered CLOSE
        self.dial_back = False                      # at a relay: the member said "mux": 0 (rule 2)
        self.watched = 0.0                          # the link's give-up time as set (watch)
        # What the streams send goes out once per read of the link (_LinkFrames), or else once
        # per turn of the loop: one write for every frame of a turn (the streams' DATA, their
        # credit, CLOSEs), and one per stream to its local side, not one per frame. Measured at
        # the relay, a write was most of a forwarded request's cost (see rule 2).
        self._loop = asyncio.get_running_loop()
        self._out: List[bytes] = []                 # frames for the link, written at the flush
        self._touched: List[Any] = []               # streams with bytes for their local side
        self.batching = False                       # in a read of the link: its end flushes
        self._soon = False                          # a flush is scheduled (call_soon)

    def watch(self, timeout: float) -> None:
        """The link errors once nothing it sent is acked for `timeout` seconds, or its keepalive
        probes go unanswered when idle (_keepalive); set again only when it changed."""
        if timeout != self.watched:
            self.watched = timeout
            _keepalive(self.writer, timeout)

    def send(self, data: bytes) -> None:
        self._out.append(data)
        if not (self.batching or self._soon):
            self._soon = True
            self._loop.call_soon(self.flush)

    def send_data(self, sid: int, payload) -> None:
        """A DATA frame: its head and the payload as they are (no join; one writev)."""
        self._out.append(_MUX_FRAMED.pack(_MUX_HEAD.size + len(payload), MUX, MUX_DATA, sid))
        self.send(payload)

    def touch(self, stream: Any) -> None:
        """`stream` holds bytes for its local side: they go at the flush."""
        self._touched.append(stream)
        if not (self.batching or self._soon):
            self._soon = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Each touched stream's bytes to its local side (what that credits back joins the
        link's frames), then the link's frames in one write."""
        self._soon = False
        self.batching = True
        touched = self._touched
        while touched:
            touched.pop().flush_local()
        self.batching = False
        out = self._out
        if not out:
            return
        self._out = []
        transport = self.writer.transport
        if transport.is_closing():
            return
        if len(out) == 1:
            transport.write(out[0])
        else:
            transport.writelines(out)

    async def drain(self) -> None:
        if self.writer.transport.get_write_buffer_size() > RELAY_HIGH_WATER:
            async with self._drain_lock:
                await self.writer.drain()

    def open(self) -> Optional[_MuxStream]:
        """A new stream, its OPEN sent; None over max_streams or on a closing link."""
        if len(self.streams) >= self.max_streams or self.writer.transport.is_closing():
            return None
        sid = self._next
        self._next = self._next % 0xFFFFFFFF + 1
        stream = self.streams[sid] = _MuxStream(self, sid)
        self.send(mux_frame(MUX_OPEN, sid))
        return stream

    def on_frame(self, data: bytes, accept: Optional[Callable[[Any], None]] = None) -> bool:
        """One mux frame from the link; False when the peer broke the protocol (the link goes)."""
        if len(data) < _MUX_HEAD.size:
            return False
        _, kind, sid = _MUX_HEAD.unpack_from(data)
        stream = self.streams.get(sid)
        if kind == MUX_DATA:
            return stream is None or stream.on_data(data[_MUX_HEAD.size:])   # after our CLOSE: dropped
        if kind == MUX_CREDIT:
            if stream is not None and len(data) == _MUX_HEAD.size + 4:
                stream.on_credit(struct.unpack_from(">I", data, _MUX_HEAD.size)[0])
            return True
        if kind == MUX_CLOSE:
            if stream is not None:
                stream.on_close()                   # no CLOSE back: the peer is done with it
            return True
        if kind == MUX_OPEN and accept is not None:
            if stream is not None:
                return False
            if len(self.streams) >= self.max_streams:
                self.refused += 1
                self.send(mux_frame(MUX_CLOSE, sid))
                return True
            stream = self.streams[sid] = self.answer(self, sid)
            accept(stream)
            return True
        return False

    def cut(self) -> None:
        """The link died: every stream's local side is cut at once (an unanswered request is
        retried by the ingress elsewhere)."""
        self._out, self._touched = [], []
        for stream in list(self.streams.values()):
            stream.cut()
        self.streams.clear()


class _MuxTunnel(_MuxCredit, asyncio.Transport):
    """At the member: one stream a relay opened on our link, served as a tunnel connection
    with no socket (rule 2). The dialer's TLS ends here, in memory: ssl.MemoryBIO in and out
    under the tunnel port's own server context (the same pinned certificate, required), fed by
    the link's DATA frames; this is the transport the tunnel code reads its plaintext from and
    writes its answers to, each write encrypted and sent as DATA at once. The stream's first
    byte tells a ClientHello from plain HTTP, as on the port (rule 3 of "Tunnel security").
    Credit as _MuxCredit says: the peer may send MUX_WINDOW bytes we have not credited back, and
    none is credited while the tunnel code has paused our reading; what we may not send for
    want of credit waits here, the tunnel code's writing paused above RELAY_HIGH_WATER, so a
    slow dialer holds up its own stream and at most about a window of its answer."""

    def __init__(self, link: _MuxLink, sid: int, ctx: Optional[ssl.SSLContext]):
        super().__init__()
        self._start_credit(link, sid)
        self.ctx = ctx
        self.tls: Optional[ssl.SSLObject] = None    # from the first byte, when it is a ClientHello
        self._in = self._out = None                 # the TLS object's ciphertext, each way
        loop = asyncio.get_running_loop()
        self.ready = loop.create_future()           # "tls" or "plain" once the tunnel code may read,
                                                    # None when refused or ended before that
        self.stream = _Stream(limit=RELAY_READ)     # the tunnel code's reader and writer
        self.protocol: asyncio.BaseProtocol = self.stream
        self._closing = False                       # close(): CLOSE once what is held went out
        self._lost = False                          # the tunnel code was told (connection_lost)
        self._write_paused = False
        self._plain: List[bytes] = []               # written, not yet encrypted (see write)
        self._plain_size = 0                        # ... their bytes
        self.protocol.connection_made(self)

    # -- the link's side ----------------------------------------------------------------------
    def on_data(self, data: bytes) -> bool:
        if not self._within_window(data):
            return False
        if self._lost or not data:
            return True
        tls = self.tls
        if tls is None and not self.ready.done():   # the first byte: a ClientHello, or plain HTTP?
            if self.ctx is not None and data[0] == TLS_RECORD_HANDSHAKE:
                self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
                tls = self.tls = self.ctx.wrap_bio(self._in, self._out, server_side=True)
            else:
                self.ready.set_result("plain")
        if tls is None:
            self.protocol.data_received(bytes(data))
        else:
            self._in.write(data)
            if self.ready.done() or self._handshake():
                self._decrypt()
        self._taken(len(data))
        return True

    def on_close(self) -> None:
        """The peer is done (the dialer went): the tunnel code sees its stream end."""
        self.closed = True
        self._lose(None)

    def cut(self) -> None:
        """The link died."""
        self.closed = True
        self._lose(ConnectionResetError("the relay link ended"))

    def buffered(self) -> int:
        """Bytes of the peer's this side holds (read, not yet taken by the tunnel code)."""
        return len(self.stream.buffer) + (self._in.pending if self._in is not None else 0)

    # -- TLS in memory ------------------------------------------------------------------------
    def _handshake(self) -> bool:
        """Another step of the server handshake; True once it is done."""
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return False
        except (ssl.SSLError, ValueError):           # garbage, no certificate, the wrong one
            self._flush()                            # the alert says why
            self.abort()
            return False
        self._flush()
        self.ready.set_result("tls")
        return True

    def _decrypt(self) -> None:
        tls, incoming, protocol = self.tls, self._in, self.protocol
        while incoming.pending or tls.pending():
            try:
                data = tls.read(MUX_CHUNK)
            except ssl.SSLWantReadError:
                break                                # a record's rest is still on its way
            except ssl.SSLZeroReturnError:
                data = b""
            except ssl.SSLError:
                self.abort()
                return
            if not data:                             # the dialer's close_notify
                protocol.eof_received()
                return
            protocol.data_received(data)
            if self._lost:
                return
        if self._out.pending:                        # a key update or ticket of TLS 1.3's own
            self._flush()

    def _flush(self) -> None:
        data = self._out.read()
        if data and not self.closed:
            self._send(data)

    # -- the tunnel code's side (asyncio.Transport) -------------------------------------------
    def write(self, data) -> None:
        if self._closing or not data:
            return
        if self.tls is None:
            self._send(bytes(data))
            return
        # Encrypted at the link's flush (the end of this read of the link, or of this turn of
        # the loop): the writes of one turn (an SSE stream's chunks, a head and its body) become
        # one TLS record and one DATA frame, not one each, which the relay and the dialer then
        # forward and decrypt once.
        plain = self._plain
        if not plain:
            self.link.touch(self)
        plain.append(bytes(data))
        self._plain_size += len(data)
        if len(plain) > 1 and self._plain_size >= MUX_CHUNK:   # a big answer: now, so that
            self.flush_local()                      # the credit and the high-water mark hold it

    def writelines(self, list_of_data) -> None:
        self.write(b"".join(list_of_data))

    def flush_local(self) -> None:
        """The tunnel code's writes since the last flush, encrypted at once and sent (_MuxLink.flush)."""
        plain = self._plain
        if not plain or self._lost:
            return
        self._plain, self._plain_size = [], 0
        self.tls.write(plain[0] if len(plain) == 1 else b"".join(plain))
        self._send(self._out.read())

    def _send(self, data: bytes) -> None:
        self._send_or_hold(data)
        if len(self.held) > RELAY_HIGH_WATER and not self._write_paused and not self._lost:
            self._write_paused = True
            self.protocol.pause_writing()

    def _send_held(self) -> None:
        super()._send_held()
        held = self.held
        if self._write_paused and len(held) <= RELAY_HIGH_WATER // 4 and not self._lost:
            self._write_paused = False
            self.protocol.resume_writing()
        if self._closing and not held:
            self._end()

    pause_reading = _MuxCredit._stall               # the tunnel code paused our reading: nothing
    resume_reading = _MuxCredit._unstall            # is credited back until it resumes

    def is_reading(self) -> bool:
        return not (self.stalled or self._lost)

    def get_write_buffer_size(self) -> int:
        return len(self.held) + self._plain_size

    def get_write_buffer_limits(self) -> Tuple[int, int]:
        return RELAY_HIGH_WATER // 4, RELAY_HIGH_WATER

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass                                        # the marks are RELAY_HIGH_WATER's (see _send)

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing

    def get_protocol(self):
        return self.protocol

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def get_extra_info(self, name, default=None):
        tls = self.tls if self.ready.done() else None
        if name == "peername":                      # the relay's address: the stream came through it
            return self.link.writer.get_extra_info("peername", default)
        if name == "ssl_object":
            return tls or default
        if name == "sslcontext":
            return self.ctx if tls is not None else default
        if name == "peercert":
            return tls.getpeercert() if tls is not None else default
        return default

    def close(self) -> None:
        """What was written goes out (as credit allows), then CLOSE."""
        if self._closing:
            return
        self.flush_local()                          # what was written goes before the close_notify
        self._closing = True
        if self.tls is not None and self.ready.done() and not self.closed:
            try:
                self.tls.unwrap()                   # our close_notify: the dialer sees a clean end
            except (ssl.SSLError, ValueError):      # (SSLWantReadError: we do not wait for theirs)
                pass
            data = self._out.read()
            if data:
                self.held += data
        self._send_held()

    def abort(self) -> None:
        self._closing = True
        self.held.clear()
        self._plain, self._plain_size = [], 0
        self._end()

    def _end(self) -> None:
        if not self.closed:
            self.closed = True
            self.link.send(mux_frame(MUX_CLOSE, self.sid))
        self._lose(None)

    def _lose(self, exc: Optional[Exception]) -> None:
        if self.link.streams.get(self.sid) is self:
            del self.link.streams[self.sid]
        if self._lost:
            return
        self._lost = self._closing = True
        self.held.clear()
        self._plain, self._plain_size = [], 0
        if not self.ready.done():
            self.ready.set_result(None)
        asyncio.get_running_loop().call_soon(self.protocol.connection_lost, exc)


class _PunchSocket(asyncio.DatagramProtocol):
    """A fresh UDP socket for one hole punch with one peer, and then its punched path: gossip
    with that peer goes in and out here. Its own socket, so a failed attempt's NAT and
    conntrack state never touches the gossip port or the next attempt. `deliver(msg, peer)`
    takes the peer's gossip, `lost(path)` hears that the socket is gone."""

    OWN = {t: row.handler for t, row in MESSAGE_TYPES.items() if row.part == "path"}   # read here, not routed

    def __init__(self, peer: str, deliver: Callable[[Dict[str, Any], str], None],
                 lost: Callable[[_PunchSocket], None], wire: Wire, traffic: collections.Counter,
                 address: Callable[[], str]):
        self.peer, self.deliver, self.lost = peer, deliver, lost
        self.wire, self.traffic, self.address = wire, traffic, address   # `address()`: where we gossip
        self.transport: Optional[asyncio.DatagramTransport] = None
        self.seen: Optional[asyncio.Future] = None   # the answer to our "ob"
        self.hit: Optional[asyncio.Future] = None    # an ack of our probe arrived
        self.peer_addr: Optional[tuple] = None       # where the peer's packets really come from
        self.last_rx = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def error_received(self, exc) -> None:          # ICMP from a NAT that dropped a probe: expected
        pass

    def datagram_received(self, data: bytes, addr) -> None:
        self.traffic["received"] += len(data)
        now = time.time()
        msg = self.wire.open(data, now, sender=f"{addr[0]}:{addr[1]}")
        if msg is None:
            return
        own = self.OWN.get(msg["t"])
        if own is not None:
            getattr(self, own)(msg, addr, now)
        elif msg.pop("ra", None) == self.peer:      # only the peer we punched for talks here
            self.last_rx = now
            self.deliver(msg, self.peer)

    def _on_seen(self, msg: Dict[str, Any], addr: tuple, now: float) -> None:
        """A seed's answer to our "ob": where it sees this socket."""
        if self.seen is not None and not self.seen.done():
            self.seen.set_result(str(msg.get("seen", "")))

    def _on_probe(self, msg: Dict[str, Any], addr: tuple, now: float) -> None:
        if msg.get("ra") == self.peer:
            self.last_rx = now
            self.peer_addr = addr                   # peer-reflexive: answer where it came from
            self.send(self.wire.seal({"t": "pa", "ra": self.address()}, now), addr)

    def _on_probe_ack(self, msg: Dict[str, Any], addr: tuple, now: float) -> None:
        if msg.get("ra") == self.peer:
            self.last_rx = now
            self.peer_addr = addr
            if self.hit is not None and not self.hit.done():
                self.hit.set_result(addr)

    def send(self, data: bytes, addr) -> bool:
        """False once the socket is closing: asyncio's unconnected datagram transport, its socket
        gone, raises from sendto (AttributeError) out of whatever timer or task called it."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        try:
            transport.sendto(data, addr)
        except OSError:                             # asyncio's gives it to error_received; uvloop's may not
            return False
        return True

    def connection_lost(self, exc) -> None:         # the socket vanished: back to the relays now
        self.lost(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# -- TCP simultaneous open (rule 5): sockets sharing one port, SYNs both ways -------------
def _bound_tcp(local: tuple) -> socket.socket:
    """A TCP socket on `local`, sharing the port with the other sockets of one punch."""
    family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setblocking(False)
        sock.bind(local[:2])
    except OSError:
        sock.close()
        raise
    return sock


def _watch_punched(sock: socket.socket, timeout: float) -> None:
    """Rule 6: a punched connection whose path breaks errors within punched_tcp_timeout:
    unacked data (TCP_USER_TIMEOUT), or keepalive probes when idle (which also keep the
    NATs' mappings of an idle pooled connection alive)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_USER_TIMEOUT", int(timeout * 1000)), ("TCP_KEEPIDLE", max(1, int(timeout / 2))),
                        ("TCP_KEEPINTVL", max(1, int(timeout / 4))), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):               # Linux; elsewhere keepalive at the system's pace
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass


def _from_peer(accepting: asyncio.Future, remote: tuple) -> Optional[socket.socket]:
    """The accepted connection if it came from the peer's address (anyone else: closed)."""
    try:
        conn, addr = accepting.result()
    except OSError:
        return None
    if addr[0] != remote[0]:
        conn.close()
        return None
    return conn


async def simultaneous_open(cfg: Config, resolve: Callable[[str], tuple], local: tuple, target: str, first: bool,
                            deadline: float, extra: Optional[Callable[[socket.socket], None]] = None,
                            head_start: Optional[float] = None) -> Optional[socket.socket]:
    """connect() from `local` to the peer's mapping while it connects to ours: a connected
    socket, or None by the deadline. A SYN the peer's NAT dropped or reset is replaced by a
    fresh socket's every tunnel_syn_interval; a listener on the same port takes the peer's
    SYN that arrives between two of ours (a reset of ours came back at once). Connections
    beyond the first (both SYNs got through) go to `extra`, or are closed. Going second, we
    give the first side `head_start` (punch_delay unless told)."""
    loop = asyncio.get_running_loop()
    try:
        remote = resolve(target)
        listener = _bound_tcp(local)
        listener.listen(8)
    except (OSError, ValueError):
        return None

    def spare(conn: socket.socket) -> None:
        if extra is None:
            conn.close()
            return
        _watch_punched(conn, cfg.punched_tcp_timeout)
        extra(conn)
    accepting: Optional[asyncio.Future] = asyncio.ensure_future(loop.sock_accept(listener))
    won: Optional[socket.socket] = None
    try:
        if not first:                           # the first side's NAT gets its mapping first
            wait = cfg.punch_delay if head_start is None else head_start
            await asyncio.wait([accepting], timeout=min(wait, max(deadline - time.monotonic(), 0)))
        while won is None and time.monotonic() < deadline:
            if accepting.done():
                won = _from_peer(accepting, remote)
                accepting = asyncio.ensure_future(loop.sock_accept(listener)) if won is None else None
                continue
            won = await _syn(local, remote, accepting, min(cfg.tunnel_syn_interval,
                                                           max(deadline - time.monotonic(), 0.01)))
    except OSError:
        pass
    finally:
        won = _after_race(listener, remote, accepting, won, spare)
    if won is not None:
        won.setblocking(False)
        won.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _watch_punched(won, cfg.punched_tcp_timeout)
    return won


async def _syn(local: tuple, remote: tuple, accepting: asyncio.Future, timeout: float) -> Optional[socket.socket]:
    """One SYN of ours from a fresh socket: connected within `timeout`, or None (closed)."""
    sock = _bound_tcp(local)
    connecting = asyncio.ensure_future(asyncio.get_running_loop().sock_connect(sock, remote))
    await asyncio.wait([connecting, accepting], timeout=timeout)
    if connecting.done() and connecting.exception() is None:
        return sock
    connecting.cancel()
    sock.close()
    if not accepting.done():
        await asyncio.sleep(0.02)               # a reset came at once: not a busy loop
    return None


def _after_race(listener: socket.socket, remote: tuple, accepting: Optional[asyncio.Future],
                won: Optional[socket.socket], spare: Callable[[socket.socket], None]) -> Optional[socket.socket]:
    """The end of a simultaneous open: the peer's accepted connection wins if ours did not; every
    other one from the peer (both SYNs got through) goes to `spare`; the listener is closed."""
    if accepting is not None and accepting.done() and not accepting.cancelled():
        conn = _from_peer(accepting, remote)
        if conn is not None and won is None:
            won = conn
        elif conn is not None:
            spare(conn)
    elif accepting is not None:
        accepting.cancel()
    while True:
        try:
            conn, addr = listener.accept()
        except OSError:
            break
        if addr[0] == remote[0]:
            conn.setblocking(False)
            spare(conn)
        else:
            conn.close()
    listener.close()
    return won


class Spare:
    """A tunnel connection a probe punched (rule 6), waiting for the next dial, and when it was made
    (time.monotonic)."""

    __slots__ = ("sock", "made")

    def __init__(self, sock: socket.socket, made: float):
        self.sock, self.made = sock, made


class HolePunch:
    """Rules 4 to 6 of "NAT traversal and relay" for one node: the UDP punches towards private
    peers and the punched paths their gossip takes (one _PunchSocket per peer), and the TCP
    simultaneous opens that punch a tunnel connection. It asks and answers through the relays
    (its RelayClient sends its "pq"/"pr"/"tq"/"tr"), learns mappings from the seeds that
    answered our reach check, and keeps per peer what Reach decides from (our
    Reach). `listeners(addr)` hear that a path to `addr` is punched: the ingress's pool retires
    its relayed connections to it."""

    def __init__(self, config: Config, wire: Wire, reach: Reach, client: RelayClient, traffic: collections.Counter,
                 *, spawn: Callable[[Any], asyncio.Task], resolve: Callable[[str], tuple],
                 address: Callable[[], str], deliver: Callable[..., None],
                 sendto: Callable[[bytes, tuple], None], admit: Callable[[socket.socket], None],
                 serving: Callable[[], bool]):
        """`address()`: our gossip address; `deliver(msg, src, via)`: a punched path's gossip in
        (Node.deliver); `sendto`: a datagram out of the gossip port; `admit`: a punched tunnel
        connection in, while `serving()` says the tunnel port is open."""
        self.config, self.wire, self.reach, self.traffic = config, wire, reach, traffic
        self.client = client                        # our relays carry the asking and answering
        self.spawn, self.resolve, self.address, self.deliver = spawn, resolve, address, deliver
        self.sendto, self.admit, self.serving = sendto, admit, serving
        self.paths: Dict[str, _PunchSocket] = {}    # relayed address -> its punched path
        self.waiting: Dict[tuple, asyncio.Future] = {}   # (peer, attempt or token) -> its "pr"/"tr"
        self.punches = collections.Counter({"ok": 0, "failed": 0, "fell_back": 0, "answered": 0})
        self.punch_ms: List[float] = []             # how long each successful punch took
        self.punch_after_join_ms: List[float] = []  # ... counted from when both were members
        self.tunnel_punches = collections.Counter({"ok": 0, "failed": 0})   # TCP simultaneous opens, both sides
        self.tunnel_punch_ms: List[float] = []      # how long each punched tunnel connect took
        self.answering = 0                          # simultaneous opens we answer right now
        self.spares: Dict[str, Spare] = {}          # a probe's punched connection (rule 6)
        self.listeners: List[Callable[[str], None]] = []

    def stats(self) -> Dict[str, Any]:
        return {"punches": dict(self.punches), "punch_ms": self.punch_ms[-8:],
                "punch_after_join_ms": self.punch_after_join_ms[-8:], "punched": sorted(self.paths),
                "tunnel_punches": dict(self.tunnel_punches), "tunnel_punch_ms": self.tunnel_punch_ms[-8:]}

    def take_spare(self, addr: str) -> Optional[Spare]:
        """A probe's punched connection to `addr` and when it was made, handed to the caller."""
        return self.spares.pop(addr, None)

    def forget(self, addr: str) -> None:
        """`addr` went LEFT: a connection punched for it has no one to serve."""
        spare = self.spares.pop(addr, None)
        if spare is not None:
            spare.sock.close()

    def close(self) -> None:
        paths = list(self.paths.values())
        self.paths.clear()                          # closing: no path "falls back"
        for path in paths:
            path.close()
        for spare in self.spares.values():
            spare.sock.close()
        self.spares.clear()

    def _on_observe(self, msg: Dict[str, Any], src: str, via: Via) -> None:
        """A seed's side of "ob": say where the datagram came from (its NAT mapping)."""
        try:
            self.sendto(self.wire.seal({"t": "os", "n": msg.get("n"), "seen": src}, time.time()),
                        self.resolve(src))
        except (OSError, ValueError, AttributeError):
            pass

    async def _punch_socket(self, peer: str) -> Tuple[Optional[_PunchSocket], str]:
        """A fresh UDP socket and its mapping as a seed sees it; ("" when UDP does not pass)."""
        loop = asyncio.get_running_loop()
        host = split_addr(self.config.gossip)[0]
        try:
            _, sock = await loop.create_datagram_endpoint(
                lambda: _PunchSocket(peer, self._punched_gossip, self.lost, self.wire, self.traffic, self.address),
                local_addr=(host, 0))
        except OSError:
            return None, ""
        seeds = [a for a in self.client.seeds if not is_relayed(a)]
        sock.seen = loop.create_future()
        nonce = os.urandom(4).hex()
        deadline = time.monotonic() + 1.0
        while seeds and not sock.seen.done() and time.monotonic() < deadline:
            for seed in seeds[:2]:
                try:
                    sock.send(self.wire.seal({"t": "ob", "n": nonce}, time.time()), self.resolve(seed))
                except ValueError:
                    pass
            await asyncio.wait([sock.seen], timeout=0.2)
        if not sock.seen.done():
            sock.close()
            return None, ""                         # UDP blocked on our side: the relay it is
        return sock, sock.seen.result()

    async def _spray(self, sock: _PunchSocket, seen: str, first: bool) -> bool:
        """Probe the peer's mapping every 50 ms (after punch_delay unless we go first) until an
        ack arrives or punch_timeout passes."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        sock.hit = loop.create_future()
        try:
            target = self.resolve(seen)
        except ValueError:
            return False
        if not first:
            await asyncio.wait([sock.hit], timeout=cfg.punch_delay)
        deadline = time.monotonic() + cfg.punch_timeout
        while not sock.hit.done() and time.monotonic() < deadline:
            sock.send(self.wire.seal({"t": "pp", "ra": self.address()}, time.time()), sock.peer_addr or target)
            await asyncio.wait([sock.hit], timeout=0.05)
        return sock.hit.done()

    def tend(self) -> None:
        """Each relay check: start a punch towards private peers we only reach relayed (the
        smaller link id asks, through the relay); drop punched paths gone silent (back to the
        relay, rule 4); keep live ones' NAT mappings open."""
        cfg = self.config
        now = time.time()
        for path in list(self.paths.values()):
            if now - path.last_rx > cfg.punch_idle:
                self.lost(path, "went silent")
            elif path.peer_addr is not None and now - path.last_rx > cfg.punch_keepalive:
                path.send(self.wire.seal({"t": "pp", "ra": self.address()}, now), path.peer_addr)
        for peer in self.reach.punches_due(self.address(), self.paths, now):
            self.spawn(self._punch(peer))
        if self.client.private and self.listeners:   # rule 6: a dialer back to punched when it works
            for peer in self.reach.probes_due(self.paths, self.spares, self.client.private, now):
                self.spawn(self._probe_tunnel(peer))

    async def _punch(self, peer: str) -> None:
        """The asking side: two attempts on fresh sockets, the peer first, then us first (one
        of the orders works behind a leaky gateway on either side)."""
        started = time.monotonic()
        for attempt, peer_first in ((1, True), (2, False)):
            sock, seen = await self._punch_socket(peer)
            if sock is None:
                break
            theirs = await self._ask(peer, attempt, {"t": "pq", "a": attempt, "seen": seen, "first": peer_first}, 3.0)
            if theirs and await self._spray(sock, theirs, first=not peer_first):
                self._punched_path(peer, sock, started)
                return
            sock.close()
        self.punches["failed"] += 1
        log.info("hole punch to %s failed: it stays relayed", peer)

    def _on_punch_request(self, msg: Dict[str, Any], src: str, via: Via) -> None:
        if is_relayed(src) and self.client.private and src not in self.paths:
            self.spawn(self._answer_punch(src, msg))

    async def _answer_punch(self, peer: str, msg: Dict[str, Any]) -> None:
        started = time.monotonic()
        sock, seen = await self._punch_socket(peer)
        self.client.send(peer, {"t": "pr", "a": msg.get("a"), "seen": seen}, time.time())
        if sock is None:
            return
        if seen and msg.get("seen") and await self._spray(sock, str(msg["seen"]), first=bool(msg.get("first"))):
            self._punched_path(peer, sock, started)
        else:
            sock.close()
        self.punches["answered"] += 1

    async def _ask(self, peer: str, key: Any, msg: Dict[str, Any], timeout: float) -> str:
        """`msg` to `peer` through its relays; the mapping its answer ("pr"/"tr", `key` its
        attempt or token) names, or "" by the timeout."""
        waiter = self.waiting[(peer, key)] = asyncio.get_running_loop().create_future()
        self.client.send(peer, msg, time.time())
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            return ""
        finally:
            self.waiting.pop((peer, key), None)

    def _on_reply(self, msg: Dict[str, Any], src: str, via: Via) -> None:
        waiter = self.waiting.get((src, msg.get("a" if msg["t"] == "pr" else "n")))
        if waiter is not None and not waiter.done():
            waiter.set_result(str(msg.get("seen") or ""))

    def _punched_gossip(self, msg: Dict[str, Any], peer: str) -> None:
        self.deliver(msg, peer, Via(False, peer))

    def lost(self, path: _PunchSocket, why: str = "closed") -> None:
        """A punched path that went silent or whose socket is gone: its peer goes back to its
        relays (rule 4). Only the path on record counts; a replaced or failed attempt's socket
        closing is nothing."""
        if self.paths.get(path.peer) is not path:
            return
        del self.paths[path.peer]
        path.close()
        self.punches["fell_back"] += 1
        log.info("punched path to %s %s: back to its relays", path.peer, why)

    def _punched_path(self, peer: str, sock: _PunchSocket, started: float) -> None:
        old = self.paths.pop(peer, None)
        if old is not None and old is not sock:
            old.close()
        self.paths[peer] = sock
        self.punches["ok"] += 1
        if self.client.private:                     # our next tunnel connections to it may punch
            for listener in self.listeners:
                listener(peer)
        self.punch_ms.append(round((time.monotonic() - started) * 1000, 1))
        both = max(self.reach.member_since(peer, started), self.reach.member_since(self.address(), started))
        self.punch_after_join_ms.append(round((time.monotonic() - both) * 1000, 1))
        log.info("punched a direct path to %s (%s) in %.0f ms", peer, sock.peer_addr, self.punch_ms[-1])

    # -- tunnel punching: TCP simultaneous open (rule 5) --------------------------------------
    async def _tcp_mapping(self, deadline: float) -> Tuple[Optional[tuple], str]:
        """A fresh local port and its TCP mapping as a seed saw it ((None, "") when none answers).
        The seed's connection is reset, not closed: no TIME_WAIT holds the 4-tuple."""
        loop = asyncio.get_running_loop()
        host = split_addr(self.config.gossip)[0] or "0.0.0.0"
        seeds = [a for a in self.client.seeds if not is_relayed(a)]
        seeds += [a for a in self.client.links if a not in seeds]
        local: Optional[tuple] = None
        for seed in seeds[:2]:
            try:
                sock = _bound_tcp(local or (host, 0))
            except OSError:
                return None, ""
            local = sock.getsockname()
            try:
                remaining = deadline - time.monotonic()
                await asyncio.wait_for(loop.sock_connect(sock, self.resolve(seed)), max(remaining, 0.01))
                nonce = os.urandom(4).hex()
                await loop.sock_sendall(sock, frame(self.wire.seal({"t": "rq", "n": nonce}, time.time())))
                reader, writer = await asyncio.open_connection(sock=sock)
                try:
                    data = await _read_frame(reader, self.config.max_datagram, max(deadline - time.monotonic(), 0.01))
                    answer = self.wire.open(data, time.time(), tcp=True) if data else None
                finally:
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
                    writer.transport.abort()
                if answer is not None and answer.get("t") == "rs" and answer.get("n") == nonce and answer.get("seen"):
                    return local, str(answer["seen"])
            except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError):
                sock.close()
        return None, ""

    async def punch_tunnel(self, peer: str) -> Optional[socket.socket]:
        """The dialer's side of rule 5: a punched connection to `peer`, or None (then the relay)."""
        started = time.monotonic()
        deadline = started + self.config.tunnel_punch_timeout
        peer_first, kept = self.reach.punch_plan(peer, time.time())   # the order that worked, or alternate
        sock = None
        local, seen = await self._tcp_mapping(deadline)
        if local is not None:
            token = os.urandom(8).hex()
            theirs = await self._ask(peer, token, {"t": "tq", "n": token, "seen": seen, "first": peer_first},
                                     max(deadline - time.monotonic(), 0.01))
            if theirs:
                margin = None if kept is None else self.config.tunnel_reply_margin   # kept: its SYN has left
                sock = await simultaneous_open(self.config, self.resolve, local, theirs, not peer_first, deadline,
                                               head_start=margin)
        if sock is None:
            self.tunnel_punches["failed"] += 1
            self.reach.punch_failed(peer, kept, time.time())
            return None
        self.tunnel_punches["ok"] += 1
        self.reach.punch_worked(peer, peer_first, time.time())
        self.tunnel_punch_ms.append(round((time.monotonic() - started) * 1000, 1))
        return sock

    async def _probe_tunnel(self, peer: str) -> None:
        """Rule 6: one punch in the background while the tunnel to `peer` is relayed; the
        connection it makes is the next dial's, and the relayed ones are retired."""
        sock = None
        try:
            sock = await self.punch_tunnel(peer)
        finally:
            self.reach.probe_done(peer, sock is not None, time.time())
        if sock is None:
            return
        old = self.spares.pop(peer, None)
        if old is not None:
            old.sock.close()
        self.spares[peer] = Spare(sock, time.monotonic())
        log.info("tunnel to %s punches again: its relayed connections are retired", peer)
        for listener in self.listeners:
            listener(peer)

    def _on_tunnel_punch(self, msg: Dict[str, Any], src: str, via: Via) -> None:
        if is_relayed(src) and self.client.private and self.serving() \
                and self.answering < self.config.max_punched:
            self.spawn(self._answer_tunnel_punch(src, msg))

    async def _answer_tunnel_punch(self, peer: str, msg: Dict[str, Any]) -> None:
        """The member's side of rule 5: our mapping back, then connect; the socket is admitted
        as a tunnel connection (the dialer's TLS handshake comes next)."""
        self.answering += 1
        try:
            deadline = time.monotonic() + self.config.tunnel_punch_timeout
            local, seen = await self._tcp_mapping(deadline)
            self.client.send(peer, {"t": "tr", "n": msg.get("n"), "seen": seen}, time.time())
            if local is None or not msg.get("seen"):
                return
            sock = await simultaneous_open(self.config, self.resolve, local, str(msg["seen"]),
                                           bool(msg.get("first")), deadline, extra=self.admit)
        finally:
            self.answering -= 1
        self.tunnel_punches["ok" if sock is not None else "failed"] += 1
        if sock is not None:
            if not self.serving():
                sock.close()
                return
            self.admit(sock)



class RelayServer:
    """A node's side as a relay (rules 1, 2 and 7 of "NAT traversal and relay"): the links
    private members hold to us, one _MuxLink each (its tunnel streams, and whether its member
    wants dial-backs instead), the envelopes passed on for them and to them, the splices of a
    dialer's connection onto a member's stream or dial-back, and a seed's answer to a reach
    check. `relayed` counts what it did (the node's, shared with its RelayClient)."""

    def __init__(self, config: Config, wire: Wire, reach: Reach, relayed: collections.Counter,
                 traffic: collections.Counter, *, spawn: Callable[[Any], asyncio.Task],
                 resolve: Callable[[str], tuple], address: Callable[[], str], deliver: Callable[..., Any],
                 sendto: Callable[[bytes, tuple], None], send_frame: Callable[[tuple, bytes], None],
                 relaying: Callable[[], bool], knows: Callable[[str], bool],
                 relays_offered: Callable[..., List[str]], ack_timeout_at: Callable[[str], Optional[float]]):
        """`address()`: our gossip address ("" before the overlay starts); `deliver(msg, src, via)`:
        gossip for us in (Node.deliver); `sendto` a datagram and `send_frame` a frame too big for
        one out of the gossip port; `relaying()`: whether we relay now (not private);
        `knows(addr)`: a member or a remembered address; `relays_offered(leave_out)`: the
        members offering to relay, best first; `ack_timeout_at(addr)`: the measured srtt + 4
        rttvar of the member at a gossip address (None: not measured)."""
        self.config, self.wire, self.reach, self.relayed, self.traffic = config, wire, reach, relayed, traffic
        self.spawn, self.resolve, self.address, self.deliver = spawn, resolve, address, deliver
        self.sendto, self.send_frame, self.relaying, self.knows = sendto, send_frame, relaying, knows
        self.relays_offered, self.ack_timeout_at = relays_offered, ack_timeout_at
        self.linked: Dict[str, _MuxLink] = {}       # link id -> the member's link and its streams
        self.splices: Dict[str, asyncio.Future] = {}   # token -> the dialer waiting for a dial-back
        self.forwarded: Dict[bytes, float] = {}     # envelopes passed on (nonce and destination) ->
                                                    # until when a copy is refused

    async def on_link(self, msg: Dict[str, Any], conn: _Stream) -> None:
        """A member's link hello on our gossip port: held (replacing its older link) and served
        until it ends; refused when we do not relay or hold max_relay_links."""
        cfg = self.config
        if not self.relaying() or len(self.linked) >= cfg.max_relay_links:
            self.relayed["refused"] += 1
            return
        link = str(msg["link"])
        old = self.linked.pop(link, None)
        if old is not None:
            old.writer.close()
            old.cut()
        mux = self.linked[link] = _MuxLink(conn, cfg.max_link_streams)
        mux.dial_back = not msg.get("mux", 1)
        mux.watch(cfg.relay_link_timeout)
        try:
            await self._serve_link(link, conn)
        finally:
            if self.linked.get(link) is mux:
                del self.linked[link]
            mux.cut()

    def on_accept(self, token: str, conn: _Stream) -> bool:
        """A member's dial-back for a splice we asked for: True when a dialer takes it."""
        waiter = self.splices.pop(token, None)
        if waiter is None or waiter.done():
            return False
        waiter.set_result(conn)
        return True

    def close(self) -> None:
        for mux in self.linked.values():
            mux.writer.close()

    async def _serve_link(self, link: str, conn: _Stream) -> None:
        """A relay's side of a member's link, read in the transport's callbacks (_LinkFrames):
        its tunnel streams' frames, envelopes to pass on (rule 1), and its own gossip."""
        mux = self.linked.get(link)

        def on_frame(data: bytes) -> bool:
            self.traffic["received"] += len(data) + 4
            if data[:2] == MUX:                     # a tunnel stream's frame from the member (rule 2)
                return self.linked.get(link) is mux and mux.on_frame(data)
            if data[:2] == FORWARD:
                return self.forward_envelope(data, from_link=True, sender=RELAYED_PREFIX + link)
            msg = self.wire.open(data, time.time(), tcp=True, sender=RELAYED_PREFIX + link)
            if msg is None:
                return False
            if msg["t"] != "h":                     # its hello came first (GossipTCP.serve)
                if mux is not None:                 # our probes' acks come this way: its watch
                    mux.watch(Reach.link_timeout(self.config.relay_link_timeout,   # follows them
                                                 self.ack_timeout_at(RELAYED_PREFIX + link)))
                src = msg.pop("ra", None)
                answer = self.deliver(msg, src if isinstance(src, str) else None,
                                      Via(True, RELAYED_PREFIX + link, conn))
                if answer is not None:              # a reach check, answered down the link
                    self.spawn(answer)
            return True
        if mux is not None and mux.writer is conn:
            await _link_frames(conn, on_frame, self.config.max_frame, mux)

    def forward_envelope(self, data: bytes, from_link: bool, sender: str = "") -> bool:
        """A relay passes an envelope on (after checking the inner tag); for us, it is delivered
        (`sender`: where it came from, for the replay cache). False when it was forged or is
        not ours to pass on."""
        opened = open_envelope(data)
        if opened is None or not self.address():
            self.wire.dropped["malformed"] += 1
            return False
        dest, inner = opened
        if not self.wire.authentic(inner, self.config.max_frame):
            return False
        if dest == self.address():
            return self._take_envelope(inner, sender)
        if not self.relaying():
            self.relayed["refused"] += 1
            return False
        refusal = self._refusal(dest, inner, from_link)
        if refusal:
            self.relayed[refusal] += 1
            return from_link                        # a member's link stays; a stranger's connection goes
        self.relayed["forwarded"] += 1
        if is_relayed(dest):
            self._pass_relayed(dest, data, inner, from_link)
            return True
        try:
            target = self.resolve(dest)
        except ValueError:
            return False
        if len(inner) > self.config.max_datagram:
            self.send_frame(target, inner)
            return True
        try:
            self.sendto(inner, target)
        except OSError:
            pass
        return True

    def _take_envelope(self, inner: bytes, sender: str) -> bool:
        """An envelope for us: its message delivered as having come over TCP from `sender`."""
        msg = self.wire.open(inner, time.time(), tcp=True, sender=sender)
        src = msg.pop("ra", None) if msg is not None else None
        if isinstance(src, str):
            self.deliver(msg, src, Via(True, sender.rsplit(":", 1)[0] if sender.count(":") == 1 else sender))
        return msg is not None

    def _pass_relayed(self, dest: str, data: bytes, inner: bytes, from_link: bool) -> None:
        """An envelope for a relayed member: down its link if it is ours, else one hop on to its
        relay, never more (no loops)."""
        link = self.linked.get(dest[len(RELAYED_PREFIX):])
        if link is not None:
            link.writer.write(frame(inner))
            return
        if not from_link:
            return
        for relay in self.reach.relays(dest):
            if relay != self.address():
                self.send_frame(self.resolve(relay), data)
                return

    def _refusal(self, dest: str, inner: bytes, from_link: bool) -> str:
        """Why an authentic envelope is not passed on ("" when it is): sealed outside the replay
        window ("stale"), a copy of one passed on already ("replayed"), or not for a member
        ("not_member"): what comes from outside goes only down our own links, and what our
        linked members send only to members (or one hop on to a relayed member's relay). A
        captured datagram is worth nothing to a stranger: it reaches no address it chooses, and
        each copy at most once."""
        now = time.time()
        _, sent, nonce = _HEAD.unpack_from(inner)
        if abs(now - sent) > self.wire.window + 1:
            return "stale"
        if is_relayed(dest):
            if dest[len(RELAYED_PREFIX):] not in self.linked and not (from_link and self.reach.relays(dest)):
                return "not_member"
        elif not from_link or not self.knows(dest):
            return "not_member"
        seen = self.forwarded
        key = nonce + dest.encode()
        if key in seen:
            return "replayed"
        if len(seen) >= self.config.nonce_cache:     # oldest first: expiry is insertion order
            for old in list(itertools.islice(seen, len(seen) // 2)):
                del seen[old]
        seen[key] = now + 2 * self.wire.window + 2
        while seen:
            oldest = next(iter(seen))
            if seen[oldest] > now:
                break
            del seen[oldest]
        return ""

    def _on_reach(self, msg: Dict[str, Any], src: Optional[str], via: Via) -> Optional[Awaitable[None]]:
        """A reach check ("rq"): its answer, to be awaited on the connection it came on; a
        datagram has none to answer on."""
        if via.conn is None:
            self.traffic["malformed"] += 1
            return None
        return self.answer_reach(msg, via.conn)

    async def answer_reach(self, msg: Dict[str, Any], writer: _Stream) -> None:
        """A seed's side of the reachability check: dial the asker back, say what we saw."""
        peer = writer.get_extra_info("peername") or ("", 0)
        back = False
        try:                                        # the asker's nonce proves we reached *it*
            target = self.resolve(str(msg["a"]))
            dialled = await asyncio.wait_for(open_stream(*target), self.config.dialback_timeout)
            try:
                dialled.write(frame(self.wire.seal({"t": "h", "back": str(msg.get("n"))}, time.time())))
                await asyncio.wait_for(dialled.drain(), self.config.dialback_timeout)
                back = True
            finally:
                dialled.close()
        except (OSError, ValueError, KeyError, asyncio.TimeoutError):
            pass
        answer = self.wire.seal({"t": "rs", "n": msg.get("n"), "seen": f"{peer[0]}:{peer[1]}", "back": back,
                                 "relaying": self.relaying(),
                                 "relays": self.known_relays(str(msg.get("a", "")))}, time.time())
        writer.write(frame(answer))
        await writer.drain()

    def known_relays(self, asker: str = "") -> List[str]:
        """The relays a seed names in its "rs" (rule 7), best first (Node.relays_offered), and not the
        asker (its first record says it relays: it did not know yet that it is private); our
        own "relaying" speaks for us."""
        return self.relays_offered((asker,))[:NAMED_RELAYS]

    async def splice(self, link_id: str, conn: _Stream) -> None:
        """Rule 2, the relay's side: ask the member to dial back, then splice byte for byte."""
        link = self.linked.get(link_id)
        if link is None or not self.config.relay:
            self.relayed["refused"] += 1
            return
        if self.config.relay_mux and not link.dial_back:   # a stream on the member's link
            stream = link.open()
            if stream is None:
                self.relayed["refused"] += 1
                return
            self.relayed["muxed"] += 1
            _no_delay(conn)
            await stream.bridge(conn)
            return
        try:
            other = await self._ask_dial_back(link)
        except asyncio.TimeoutError:
            self.relayed["refused"] += 1
            return
        self.relayed["spliced"] += 1
        _no_delay(conn)
        _no_delay(other)
        await asyncio.gather(_pump(conn, other), _pump(other, conn))

    async def _ask_dial_back(self, link: _MuxLink) -> _Stream:
        """Ask the member on `link` to dial us back (rule 2) and wait for its connection;
        asyncio.TimeoutError after splice_timeout."""
        token = os.urandom(8).hex()
        waiter = asyncio.get_running_loop().create_future()
        self.splices[token] = waiter
        link.writer.write(frame(self.wire.seal({"t": "h", "dial": token}, time.time())))
        try:
            return await asyncio.wait_for(waiter, self.config.splice_timeout)
        finally:
            self.splices.pop(token, None)

    async def take_dial_back(self, link: _MuxLink) -> socket.socket:
        """We are the dialer and hold the member's link ourselves (the ingress relaying): its
        dial-back connection is handed over as it is, no splice, no second hop."""
        try:
            conn = await self._ask_dial_back(link)
        except asyncio.TimeoutError:
            raise OSError("the private member did not dial back") from None
        if conn.buffer:                             # it sends nothing before our ClientHello
            conn.close()
            raise OSError("unexpected bytes on a dial-back")
        conn.transport.pause_reading()
        sock = socket.socket(fileno=os.dup(conn.get_extra_info("socket").fileno()))
        conn.transport.abort()                      # closes its descriptor only: ours stays open
        sock.setblocking(False)
        self.relayed["handed_over"] += 1
        return sock


class RelayClient:
    """A node's side as a private member, and as a dialer of private members (rules 1, 2, 3, 7
    and 8 of "NAT traversal and relay"): the reach check with the seeds, the links we hold to
    relays (one _MuxLink each, relay gossip address -> link: the relay opens tunnel streams on
    it), gossip sent to and from relayed addresses, the dial-backs a relay asks for, and a
    tunnel connection to a relayed member (`open`: punched, a spare, a dial-back or a splice,
    as Reach decides)."""

    def __init__(self, config: Config, wire: Wire, reach: Reach, relayed: collections.Counter,
                 traffic: collections.Counter, server: RelayServer, *, spawn: Callable[[Any], asyncio.Task],
                 resolve: Callable[[str], tuple], address: Callable[[], str],
                 set_address: Callable[[str], None], record: Callable[[], Dict[str, Any]],
                 suspected_at: Callable[[str], bool], is_member: Callable[[str], bool],
                 relays_offered: Callable[..., List[str]], reach_known: Callable[..., None],
                 ack_timeout_at: Callable[[str], Optional[float]],
                 deliver: Callable[..., None], send_datagram: Callable[[bytes, tuple], None],
                 send_frame: Callable[[tuple, bytes], None], admit: Callable[[Any], None],
                 serving: Callable[[], bool], server_ssl: Optional[ssl.SSLContext]):
        """`server`: our RelayServer (a link a member holds to us carries its dial-backs);
        `address()`/`set_address(addr)`: our gossip address, relayed once we are private;
        `record()`: our own record; `suspected_at(addr)`, `is_member(addr)`: whether the member at a
        gossip address is suspected, or live; `relays_offered()`: the members offering to relay,
        best first; `reach_known(rejoin, **fields)`: our reach is known; `ack_timeout_at(addr)`:
        a member's measured srtt + 4 rttvar (None: not measured), which a link's watch follows; `deliver(msg, src, via)`:
        a link's gossip in (Node.deliver); `send_datagram`, `send_frame`: out of the gossip port;
        `admit`: a tunnel connection in (a stream, a dial-back) while `serving()`; `server_ssl`:
        the tunnel's TLS, for the streams a relay opens. `punch` (HolePunch) is set once both exist."""
        self.config, self.wire, self.reach, self.relayed, self.traffic = config, wire, reach, relayed, traffic
        self.linked, self.take_dial_back = server.linked.get, server.take_dial_back
        self.spawn, self.resolve, self.address, self.set_address = spawn, resolve, address, set_address
        self.record, self.suspected_at, self.is_member = record, suspected_at, is_member
        self.relays_offered, self.reach_known, self.deliver = relays_offered, reach_known, deliver
        self.ack_timeout_at = ack_timeout_at
        self.send_datagram, self.send_frame, self.admit, self.serving = send_datagram, send_frame, admit, serving
        self.server_ssl = server_ssl
        self.punch: Optional[HolePunch] = None
        self.link_id = os.urandom(8).hex()          # names our relayed address, for this process
        self.private = False                        # no seed could dial us: reached through relays
        self.observed = ""                          # our address as a seed saw it
        self.links: Dict[str, _MuxLink] = {}        # relay gossip address -> our link to it
        self.seeds: List[str] = []                  # seeds that answered our "rq" (they tell a punch
                                                    # socket's mapping)
        self.seed_relays: List[str] = []            # ... those of them that relay
        self.named_relays: List[str] = []           # relays those seeds named (rule 7)
        self.no_relay_said = False                  # NO_RELAY_TEXT logged, no link since
        self.dialable_gossip = ""                   # our gossip address before we went private
        self.dialled_back: Set[str] = set()         # nonces of seeds' dial-backs that reached us

    def close(self) -> None:
        for link in self.links.values():
            link.writer.close()

    def send(self, dest: str, msg: Dict[str, Any], now: float, tcp: bool = False) -> None:
        """Rule 1: a private member sends everything over a link; anyone sends to a relayed
        address through its first relay that is not suspected (or down its link, if ours).
        A punched path, when there is one, goes first for datagrams; what the Overlay sends
        over TCP stays on the links, a probe path apart from the punched one (rule 4)."""
        data = self.wire.seal(dict(msg, ra=self.address()), now)
        path = None if tcp else self.punch.paths.get(dest)
        if path is not None and path.peer_addr is not None and len(data) <= self.config.max_datagram:
            if path.send(data, path.peer_addr):
                self.traffic["sent"] += len(data)
                return
            self.punch.lost(path)              # closed under us: this one goes relayed
        if self.private:
            self._send_private(dest, data)
            return
        mine = self.linked(dest[len(RELAYED_PREFIX):])
        if mine is not None:                        # we are its relay
            mine.writer.write(frame(data))
            self.traffic["sent"] += len(data) + 4
            return
        for relay in self.reach.relays(dest):
            if relay == self.address() or self.suspected_at(relay):
                continue
            wrapped = envelope(dest, data)
            try:
                target = self.resolve(relay)
            except ValueError:
                continue
            if len(wrapped) <= self.config.max_datagram:
                self.send_datagram(wrapped, target)
            else:
                self.send_frame(target, wrapped)
            return

    def _send_private(self, dest: str, data: bytes) -> None:
        """A private member's send: to one of our relays down its own link (through another
        relay it would cross to that relay's site and back: with sites 40 ms apart, 41 ms for a
        LAN path, and our own site's ingress, timing its probes, would judge us as far away as
        the other site's engines); else over our first open link; with none yet, straight out
        (a cone NAT passes it) unless `dest` is relayed."""
        own = self.links.get(dest)
        for link in ((own,) if own is not None else ()) + tuple(self.links.values()):
            if not link.writer.transport.is_closing():
                link.writer.write(frame(envelope(dest, data)))
                self.traffic["sent"] += len(data) + 4
                return
        if is_relayed(dest):
            return
        try:
            self.send_datagram(data, self.resolve(dest))
        except ValueError:
            pass

    async def ask_reach(self, seed: str, dial_back: bool = True) -> Optional[Dict[str, Any]]:
        """Our side: ask one seed to dial us back (or, without `dial_back`, only for what it
        sees and the relays it knows); its answer, or None."""
        cfg = self.config
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.resolve(seed)), cfg.tcp_timeout)
        except (OSError, ValueError, asyncio.TimeoutError):
            return None
        try:
            nonce = os.urandom(4).hex()
            ask = {"t": "rq", "n": nonce, "a": self.record()["gossip"]} if dial_back else {"t": "rq", "n": nonce}
            writer.write(frame(self.wire.seal(ask, time.time())))
            data = await _read_frame(reader, cfg.max_datagram, cfg.dialback_timeout + cfg.tcp_timeout)
            answer = self.wire.open(data, time.time(), tcp=True) if data else None
            if answer is not None and answer.get("t") == "rs" and answer.get("n") == nonce:
                deadline = time.monotonic() + cfg.dialback_timeout
                while answer.get("back") and nonce not in self.dialled_back and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)       # its dial-back frame may still be on its way
                answer["back"] = nonce in self.dialled_back
                self.dialled_back.discard(nonce)
                return answer
        except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
        return None

    async def keep_reach(self, bootstrap: List[str]) -> None:
        """Learn whether we can be dialled; if not, keep `relay_links` links to relays."""
        cfg = self.config
        self.dialable_gossip = self.record()["gossip"]
        if cfg.reach == "auto":
            if await self._dialled_back(bootstrap):
                return
        else:                                       # told we are private: the seeds that relay, and
            self.seeds = self.seed_relays = list(bootstrap)   # those they name (until they answer: every seed)
            await self._ask_seeds_for_relays(bootstrap)
        log.info("private (seen as %s): reached through relays", self.observed or "?")
        self.private = True
        waited = False                              # a check passed before our first link (rule 7)
        while True:
            waited = await self._tend_links(bootstrap, waited)
            self.punch.tend()
            await asyncio.sleep(cfg.relay_check_interval)

    async def _dialled_back(self, bootstrap: List[str]) -> bool:
        """Ask the seeds until one answers: True when one dialled us back (we are reachable);
        False when they answered but none could (the relays they named are kept)."""
        cfg, delay = self.config, self.config.join_retry_min
        while True:
            answers = [(seed, await self.ask_reach(seed)) for seed in bootstrap]
            heard = [(seed, a) for seed, a in answers if a is not None]
            if heard:
                break
            await asyncio.sleep(delay)              # no seed answered yet: the join's backoff
            delay = min(delay * 2, cfg.join_retry_max)
        self.observed = str(heard[0][1].get("seen", ""))
        if Reach.dialable([a for _, a in heard], own_address):
            log.info("reachable: a seed dialled us back (seen as %s)", self.observed)
            self.reach_known(relaying=bool(cfg.relay))
            return True
        if any(a.get("back") for _, a in heard):
            log.info("a seed dialled us back but saw us as %s, through a NAT: other sites could not dial "
                     "us (--reach public says otherwise)", self.observed)
        self._heard_seeds(heard)
        return False

    async def _tend_links(self, bootstrap: List[str], waited: bool) -> bool:
        """One round of a private member's links: broken or suspected ones go, the best
        relay_links are opened, our record names them. Returns `waited`: a check passed while
        we had no link yet, so our first record must be replaced by a new session."""
        cfg = self.config
        relayed = RELAYED_PREFIX + self.link_id
        for relay, link in list(self.links.items()):
            if link.writer.transport.is_closing() or self.suspected_at(relay):
                link.writer.close()
                del self.links[relay]
            else:                               # the relay's round trip, as measured by now
                link.watch(Reach.link_timeout(cfg.relay_link_timeout, self.ack_timeout_at(relay)))
        candidates = self._relay_candidates()
        for i, relay in enumerate(candidates):  # the best relay_links, or the next ones up
            if relay not in self.links and (i < cfg.relay_links or len(self.links) < cfg.relay_links):
                await self._open_link(relay)
        if self.links:
            self.no_relay_said = False
        else:                                   # rule 7: say it once, ask the seeds again
            waited = waited or not is_relayed(self.record().get("gossip", ""))
            if not self.no_relay_said:
                self.no_relay_said = True
                log.warning("%s", NO_RELAY_TEXT)
            await self._ask_seeds_for_relays(bootstrap)
        rank = {relay: i for i, relay in enumerate(candidates)}
        while len(self.links) > cfg.relay_links:   # a better relay came: the worst link goes
            worst = max(self.links, key=lambda r: (rank.get(r, len(rank)), r))
            self.links.pop(worst).writer.close()
        relays = ",".join(sorted(self.links, key=lambda r: (rank.get(r, len(rank)), r)))
        record = self.record()
        if relays and (record.get("relay") != relays or record.get("gossip") != relayed):
            self.set_address(relayed)
            self.reach.member(relayed, time.monotonic())
            if waited:                          # our first record (dialable, it said) was suspected
                waited = False                  # and evicted with no way to refute it: start over,
                log.info("first relay link after a wait: rejoining as a reachable session")
                self.reach_known(rejoin=True, gossip=relayed, addr=relayed, relay=relays,
                                 relaying=False)   # the old session never named our relayed address
            else:
                self.reach_known(gossip=relayed, addr=relayed, relay=relays, relaying=False)
        return waited

    def _relay_candidates(self) -> List[str]:
        """Members offering to relay, best first (Node.relays_offered); then the seeds that answered
        us and are not in the registry yet."""
        out = self.relays_offered()
        out += [seed for seed in self.seed_relays if seed not in out and not self.is_member(seed)]
        return out + [relay for relay in self.named_relays if relay not in out and not self.is_member(relay)]

    def _heard_seeds(self, heard: List[Tuple[str, Dict[str, Any]]]) -> None:
        """Rule 7: of the seeds that answered our "rq", those that relay (a seed of an older
        version says nothing: it relays), and the relays they named."""
        self.seeds = [seed for seed, _ in heard]
        self.seed_relays = [seed for seed, a in heard if a.get("relaying", True)]
        named: List[str] = []
        for _, answer in heard:
            relays = answer.get("relays")
            for relay in relays if isinstance(relays, list) else ():
                if isinstance(relay, str) and not is_relayed(relay) and relay not in named \
                        and relay != self.dialable_gossip:     # our own first record, at an old seed
                    named.append(relay)
        self.named_relays = named[:NAMED_RELAYS]

    async def _ask_seeds_for_relays(self, bootstrap: List[str]) -> None:
        """With no link: the seeds' relays again, without a dial-back (a relay may have started
        since, or the one they named died)."""
        answers = [(seed, await self.ask_reach(seed, dial_back=False)) for seed in bootstrap]
        heard = [(seed, a) for seed, a in answers if a is not None]
        if heard:
            self._heard_seeds(heard)

    async def _open_link(self, relay: str) -> None:
        try:
            conn = await asyncio.wait_for(open_stream(*self.resolve(relay)), self.config.tcp_timeout)
        except (OSError, ValueError, asyncio.TimeoutError):
            return
        conn.write(frame(self.wire.seal({"t": "h", "link": self.link_id, "mux": int(bool(self.config.relay_mux))},
                                          time.time())))
        self.links[relay] = link = _MuxLink(conn, self.config.max_link_streams, self._answer_stream)
        link.watch(Reach.link_timeout(self.config.relay_link_timeout, self.ack_timeout_at(relay)))
        self.spawn(self._read_link(relay, conn))
        log.info("relay link to %s", relay)

    async def _read_link(self, relay: str, conn: _Stream) -> None:
        """What a relay sends down our link, read in the transport's callbacks (_LinkFrames):
        gossip for us, tunnel streams and dial-back requests (rule 2)."""
        mux = self.links.get(relay)

        def on_frame(data: bytes) -> bool:
            if data[:2] == MUX:                     # a tunnel stream the relay opened for a dialer
                return self.links.get(relay) is mux and mux.on_frame(data, self._accept_stream)
            msg = self.wire.open(data, time.time(), tcp=True, sender=relay)
            if msg is None:
                return True
            if msg["t"] == "h" and "dial" in msg:
                self.spawn(self.dial_back(relay, str(msg["dial"])))
                return True
            src = msg.pop("ra", None)
            if isinstance(src, str):
                self.deliver(msg, src, Via(True, relay))
            return True
        try:
            if mux is not None and mux.writer is conn:
                await _link_frames(conn, on_frame, self.config.max_frame, mux)
        except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            conn.close()
            if mux is not None and self.links.get(relay) is mux:
                del self.links[relay]
            if mux is not None:
                mux.cut()
            log.info("relay link to %s ended", relay)

    def _answer_stream(self, link: _MuxLink, sid: int) -> _MuxTunnel:
        return _MuxTunnel(link, sid, self.server_ssl)

    def _accept_stream(self, stream: _MuxTunnel) -> None:
        """Rule 2 multiplexed, our side: a stream the relay opened is admitted as a tunnel
        connection of ours, its TLS in memory (the dialer's handshake arrives on the link)."""
        if not self.serving():
            stream.abort()
            return
        self.relayed["streams"] += 1
        self.admit(stream)

    async def dial_back(self, relay: str, token: str) -> None:
        """Rule 2, our side: a new outbound connection to the relay, admitted as a tunnel
        connection of ours (the dialer's TLS handshake arrives through the splice)."""
        try:
            sock = await self._connect(relay, {"t": "h", "accept": token})
        except (OSError, ValueError, asyncio.TimeoutError):
            return
        if not self.serving():
            sock.close()
            return
        self.relayed["dialed_back"] += 1
        self.admit(sock)

    async def open(self, addr: str) -> socket.socket:
        """A connected socket to the private member at `addr`: punched (rule 5) when both of us
        are private and it may work, else through one of its relays, its splice asked for (rule
        2). The caller starts TLS on it. Raises OSError when no relay answers."""
        now = time.time()
        spare = self.punch.take_spare(addr)         # a probe's (rule 6), if the member still waits on it
        path = self._tunnel_path(addr, spare, addr in self.punch.paths, now)
        if path == "spare":
            self.reach.went(addr, "punched", now)
            return spare.sock
        if spare is not None:
            spare.sock.close()
        if path == "punch":
            sock = await self.punch.punch_tunnel(addr)
            if sock is not None:
                return sock
            path = self._tunnel_path(addr, None, False, time.time())   # the next rule, as it is now:
                                                                    # the punch took a while
        self.reach.went(addr, "relayed", time.time())
        link_id = addr[len(RELAYED_PREFIX):]
        if path == "dial-back":                     # no relay hop to save: see rule 2
            return await self.take_dial_back(self.linked(link_id))
        for relay in self.reach.relays(addr):       # "splice"
            try:
                return await self._connect(relay, {"t": "h", "splice": link_id})
            except (OSError, ValueError, asyncio.TimeoutError):
                continue
        raise OSError(f"no relay of {addr} answers")

    def _tunnel_path(self, addr: str, spare: Optional[Spare], punched: bool,
                     now: float) -> str:
        """Reach.tunnel_path for a new tunnel connection to `addr`, from what we hold now."""
        link = self.linked(addr[len(RELAYED_PREFIX):])
        return self.reach.tunnel_path(addr, self.private, punched,
                                      link is not None and not link.writer.transport.is_closing(),
                                      None if spare is None else time.monotonic() - spare.made,
                                      self.config.head_timeout, now)

    async def _connect(self, addr: str, hello: Dict[str, Any]) -> socket.socket:
        """A socket connected to `addr` within tcp_timeout that has sent `hello`; OSError,
        ValueError (a bad address) or asyncio.TimeoutError when not."""
        loop = asyncio.get_running_loop()
        host, port = self.resolve(addr)
        family, kind, proto, _, target = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, target), self.config.tcp_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_sendall(sock, frame(self.wire.seal(hello, time.time())))
        except BaseException:
            sock.close()
            raise
        return sock


# =============================================================================================
# The asyncio node: moves bytes between sockets and the Overlay
# =============================================================================================
class _GossipProtocol(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, Any], None]):
        self.datagram_received = on_datagram        # (data, addr): the node's, called directly

    def error_received(self, exc) -> None:          # ICMP unreachable from a dead peer: expected
        pass


def owner_name() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


# The otela files each role runs, all of them: a session's code_hash covers these (the engine,
# Python and its packages are not covered; see the ingress's --require-code-hash).
ROLE_FILES = {
    "worker": ("otela_node.py", "crdt.py"),
    "relay": ("otela_node.py", "crdt.py"),
    "ingress": ("otela_ingress.py", "otela_node.py", "crdt.py"),
}


def code_hash(role: str = "worker", directory: Optional[str] = None) -> str:
    """sha256 of the otela files `role` runs, as found in `directory` (default: beside this
    file), so mixed or modified versions are visible and can be pinned. A missing file hashes
    as its name alone: such a checkout never matches a whole one."""
    directory = directory or os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in ROLE_FILES.get(role, ROLE_FILES["worker"]):
        h.update(name.encode() + b"\0")
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
        except OSError:
            pass
    return h.hexdigest()[:16]


REFUSALS = ("busy", "cut", "handshake", "credential", "gossip_busy",   # Node.refused
            "gossip_evicted",   # a gossip TCP stranger cut for a newcomer (full, or its address's share)
            "gossip_slow",      # ... closed with no authentic frame by gossip_auth_timeout
            "frame_budget",     # a big frame refused: max_frame_bytes were being read already
            "join_limited",     # a join answered with no state: its source asked too often
            "join_misdirected")  # ... or it named an address it did not come from


class _GossipConnection:
    """One gossip TCP connection being read (GossipTCP.serve): its peer's IP address, by when it
    must send an authentic frame, how big its next frame may be, the bytes of max_frame_bytes
    its frame holds, and whether a splice kept it."""

    __slots__ = ("conn", "peer", "due", "limit", "reserved", "kept")

    def __init__(self, conn: _Stream, peer: str, due: float, limit: int):
        self.conn, self.peer, self.due, self.limit = conn, peer, due, limit
        self.reserved, self.kept = 0, False


def _join_source(src: str, peer: str, here: bool) -> str:
    """Whom a join's answer is counted against (join_answer_rate), or "" when it may not be sent:
    its own connection's address, a link's member, or `src` where the join came from there."""
    if here:
        return address_group(peer)
    if is_relayed(peer):                            # down one of our links: its member only
        return src if src == peer else ""
    if is_relayed(src):
        return src
    try:
        return address_group(peer) if split_addr(src)[0] == peer else ""
    except ValueError:
        return ""


class GossipTCP:
    """The gossip port's TCP side: what does not fit a datagram (a join and its answer, the
    pieces of a state transfer) and the hellos that make a connection a relay link, a splice
    or a dial-back (handed to the node's RelayServer and RelayClient). Admission before any
    work (max_gossip_connections, strangers per address, gossip_auth_timeout), a byte budget
    for big frames, and a token bucket per source on join answers (join_answer_rate)."""

    def __init__(self, config: Config, wire: Wire, refused: collections.Counter, traffic: collections.Counter,
                 relay: RelayServer, *, dialled_back: Callable[[str], None], address: Callable[[], str],
                 receive: Callable[..., List[Out]], send: Callable[[List[Out]], None],
                 schedule: Callable[[], None], deliver: Callable[..., Any], to_overlay: Callable[..., None]):
        """`relay`: our RelayServer (links, splices, dial-backs and envelopes arrive here);
        `dialled_back(nonce)`: a seed's dial-back reached us; `address()`: our gossip address
        ("" before the overlay starts); `receive(msg, src, now, tcp)`: the Overlay's answer to
        a join; `send(outs)`, `schedule()`: out and the timer; `deliver(msg, src, via)`: any
        other message in (Node.deliver; `to_overlay`: straight to the Overlay)."""
        self.config, self.wire, self.refused, self.traffic, self.relay = config, wire, refused, traffic, relay
        self.dialled_back, self.address, self.receive, self.send_outs = dialled_back, address, receive, send
        self.schedule, self.deliver, self.to_overlay = schedule, deliver, to_overlay
        self.strangers: Dict[_Stream, str] = {}     # no authentic frame yet, oldest first ->
                                                    # the address group (the ones cut first)
        self.members: Dict[_Stream, bool] = {}      # authenticated (links apart), oldest
                                                    # first -> waiting for its next frame (idle)
        self.frame_bytes = 0                        # big gossip frames being read (max_frame_bytes)
        self.join_budget: Dict[str, Tuple[float, float]] = {}  # join source -> (answers left, when)

    @property
    def connections(self) -> int:
        return len(self.strangers) + len(self.members)

    async def send(self, target: tuple, msgs: List[Dict[str, Any]], addr: str = "") -> None:
        """Messages on one new TCP connection, in order (a state transfer's pieces: many
        connections at once would take the receiver's slots for strangers, and the pieces over
        them would be lost until the next exchange); each big frame after an authentic hello. A
        join ("rc") then reads its answer there, from `addr` (an older member answers by a
        connection of its own instead)."""
        now = time.time()
        frames = b"".join(self._framed(msg, now) for msg in msgs)
        await self._send(target, frames, len(msgs), addr if msgs[0].get("rc") else "")

    async def send_frame(self, target: tuple, sealed: bytes) -> None:
        """A sealed message (or an envelope of one) too big for a datagram, after a hello."""
        await self._send(target, frame(self.wire.seal({"t": "h"}, time.time())) + frame(sealed), 1)

    async def _send(self, target: tuple, frames: bytes, pieces: int, join_from: str = "") -> None:
        """`frames` on a new connection to `target`; then, for a join, its answer from `join_from`."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*target), self.config.tcp_timeout)
        except (OSError, asyncio.TimeoutError):
            return
        try:
            writer.write(frames)
            # the receiver merges each piece before it reads the next: a timeout per piece
            await asyncio.wait_for(writer.drain(), self.config.tcp_timeout * pieces)
            self.traffic["sent"] += len(frames)
            if join_from:
                writer.write_eof()                  # an older member closes at once: no wait
                await self._read_join_answer(reader, target, join_from)
        except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _read_join_answer(self, reader: asyncio.StreamReader, target: tuple, addr: str) -> None:
        cfg = self.config
        limit = cfg.max_datagram
        while True:
            data = await _read_frame(reader, limit, cfg.tcp_timeout * 4)
            if data is None:
                return
            self.traffic["received"] += len(data) + 4
            answer = self.wire.open(data, time.time(), tcp=True, sender=target[0])
            if answer is None:
                return
            if answer["t"] == "h":
                limit = cfg.max_frame               # the state follows
                continue
            limit = cfg.max_datagram
            answer.pop("ra", None)
            self.deliver(answer, addr, Via(True))   # until the seed closes (or tcp_timeout * 4 of silence)

    def answer_join(self, msg: Dict[str, Any], src: str, via: Via) -> None:
        """A join: the joiner's record is merged, and our state goes back only where the join
        came from: on its own connection when it asks ("rc", over TCP), else to `src` only when
        that is where it came from (the address of `peer`, or a relayed member, answered through
        its relays; on one of our links, that link's member), and at most join_answer_rate per
        source (a flood of joins is answered by no more). What is not sent is counted. One read
        on a join's own connection (`via.peer` None) is the Overlay's like any other message."""
        if via.peer is None:
            self.to_overlay(msg, src, via)
            return
        now, peer, writer = time.time(), via.peer, via.conn
        here = writer is not None and msg.pop("rc", None) == 1
        try:
            outs = self.receive(msg, src, now, True)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            self.traffic["malformed"] += 1
            return
        answers = [o for o in outs if o.addr == src]   # the state, in whatever messages it takes
        self.send_outs([o for o in outs if o.addr != src])
        self.schedule()
        if not answers:
            return
        source = _join_source(src, peer, here)
        if not source:
            self.refused["join_misdirected"] += 1
            return
        if not self._join_allowed(source, now):
            self.refused["join_limited"] += 1
            return
        if not here:
            self.send_outs(answers)
            return
        for o in answers:
            frames = self._framed(dict(o.msg, ra=self.address()), now)
            writer.write(frames)
            self.traffic["sent"] += len(frames)

    def _framed(self, msg: Dict[str, Any], now: float) -> bytes:
        """`msg` sealed as a frame; a big one (over a datagram) after an authentic hello."""
        data = self.wire.seal(msg, now)
        if len(data) > self.config.max_datagram:
            return frame(self.wire.seal({"t": "h"}, now)) + frame(data)
        return frame(data)

    def _join_allowed(self, source: str, now: float) -> bool:
        """A token bucket per join source: join_answer_burst, refilled at join_answer_rate."""
        cfg = self.config
        budget = self.join_budget
        left, since = budget.get(source, (float(cfg.join_answer_burst), now))
        left = min(float(cfg.join_answer_burst), left + (now - since) * cfg.join_answer_rate)
        if source not in budget and len(budget) >= cfg.max_remembered:   # forget the full buckets
            self.join_budget = budget = {k: (answers, when) for k, (answers, when) in budget.items()
                                          if answers + (now - when) * cfg.join_answer_rate < cfg.join_answer_burst}
            if len(budget) >= cfg.max_remembered:
                return False
        if left < 1.0:
            budget[source] = (left, now)
            return False
        budget[source] = (left - 1.0, now)
        return True

    async def serve(self, conn: _Stream) -> None:
        """TCP gossip frames. No work before authentication: at most max_gossip_connections at
        once, of which strangers (no authentic frame yet) hold at most max_gossip_strangers per
        address and are cut oldest first for a newcomer (_admit), and must send an
        authentic frame within gossip_auth_timeout. A frame may be no bigger than a datagram,
        so a stranger's length field never makes us read more than 8 KiB, and neither does a
        member's, but for the one frame after a hello (a state transfer: up to max_frame,
        within max_frame_bytes for all connections together). The first bad frame closes the
        connection. A hello may turn the connection into a relay link, a spliced tunnel
        stream, or a private member's dial-back (see "NAT traversal and relay")."""
        if not self._admit(conn):
            return
        reading = _GossipConnection(conn, (conn.get_extra_info("peername") or ("", 0))[0],
                                    asyncio.get_running_loop().time() + self.config.gossip_auth_timeout,
                                    self.config.max_datagram)   # the first authentic frame by `due`, or it goes
        try:
            while await self._take_frame(reading, await self._read(reading)):
                pass
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                self.wire.dropped["truncated"] += 1
        except asyncio.TimeoutError:
            if conn in self.strangers:
                self.refused["gossip_slow"] += 1
        except OSError:
            pass
        finally:
            self.frame_bytes -= reading.reserved
            self.strangers.pop(conn, None)
            self.members.pop(conn, None)
            if not reading.kept:
                conn.close()

    async def _read(self, reading: _GossipConnection) -> Optional[bytes]:
        """The connection's next frame, within its size limit, the frame budget and the time it
        has (a stranger: until `due`); None when it may not be read."""
        cfg, conn = self.config, reading.conn
        loop = asyncio.get_running_loop()
        stranger = conn in self.strangers
        timeout = max(0.0, reading.due - loop.time()) if stranger else cfg.tcp_timeout
        if conn in self.members:
            self.members[conn] = True               # idle until a frame begins
        head = await asyncio.wait_for(conn.readexactly(4), timeout)
        if conn in self.members:
            self.members[conn] = False
        (length,) = struct.unpack(">I", head)
        if length > reading.limit:
            self.wire.dropped["oversized"] += 1
            return None
        if length > cfg.max_datagram:               # a state transfer after its hello
            if self.frame_bytes + length > cfg.max_frame_bytes:
                self.refused["frame_budget"] += 1
                return None
            self.frame_bytes += length
            reading.reserved = length
        reading.limit = cfg.max_datagram
        timeout = max(0.0, reading.due - loop.time()) if stranger else cfg.tcp_timeout * 4
        data = await asyncio.wait_for(conn.readexactly(length), timeout)
        self.frame_bytes -= reading.reserved
        reading.reserved = 0
        self.traffic["received"] += length + 4
        return data

    async def _take_frame(self, reading: _GossipConnection, data: Optional[bytes]) -> bool:
        """One frame: an envelope to pass on (relay rule 1), a hello, or a message for
        Node.deliver; whether the connection reads on. The first bad frame closes it."""
        if data is None:
            return False
        if data[:2] == FORWARD:
            if not self.relay.forward_envelope(data, from_link=False, sender=reading.peer):
                return False
            self._authenticated(reading.conn)
            return True
        msg = self.wire.open(data, time.time(), tcp=True, sender=reading.peer)
        if msg is None:
            return False
        self._authenticated(reading.conn)
        if msg["t"] == "h":
            return await self._hello(msg, reading)
        src = msg.pop("ra", None)
        answer = self.deliver(msg, src if isinstance(src, str) else None, Via(True, reading.peer, reading.conn))
        if answer is not None:                      # a reach check: answered before the next frame
            await answer
        return True

    async def _hello(self, msg: Dict[str, Any], reading: _GossipConnection) -> bool:
        """A hello may turn the connection into a relay link, a spliced tunnel stream, a private
        member's dial-back or a seed's (see "NAT traversal and relay"); a bare one says a state
        transfer follows. Whether the connection reads on."""
        conn, relay = reading.conn, self.relay
        if "link" in msg:
            self.members.pop(conn, None)            # open as long as its member lives
            await relay.on_link(msg, conn)
            return False
        if "splice" in msg:
            self.members.pop(conn, None)
            await relay.splice(str(msg["splice"]), conn)
            return False
        if "back" in msg:                           # a seed's dial-back (see RelayServer.answer_reach)
            self.dialled_back(str(msg["back"]))
            return False
        if "accept" in msg:
            reading.kept = relay.on_accept(str(msg["accept"]), conn)   # the splice owns it now
            return False
        reading.limit = self.config.max_frame       # a bare hello: the next frame is a state transfer
        return True

    def _admit(self, writer: _Stream) -> bool:
        """Room for a new gossip TCP connection: a stranger from an address holding its share
        cuts that address's oldest; at the cap, the oldest stranger anywhere is cut, or else the
        oldest member's connection idle between frames; only when every slot is a member's
        connection busy with a frame is the newcomer refused."""
        cfg = self.config
        peer = writer.get_extra_info("peername")
        group = address_group(peer[0]) if peer else ""
        strangers = self.strangers
        mine = [w for w, g in strangers.items() if g == group]    # bounded: max_gossip_connections
        if len(mine) >= cfg.max_gossip_strangers:
            self._cut_stranger(mine[0])
        elif self.connections >= cfg.max_gossip_connections:
            idle = next((w for w, waiting in self.members.items() if waiting), None)
            if strangers:
                self._cut_stranger(next(iter(strangers)))
            elif idle is not None:                  # a member's connection between frames: it
                del self.members[idle]      # sends again on a new one when it needs to
                self.refused["gossip_evicted"] += 1
                idle.transport.abort()
            else:
                self.refused["gossip_busy"] += 1
                writer.transport.abort()
                return False
        strangers[writer] = group
        return True

    def _cut_stranger(self, writer: _Stream) -> None:
        del self.strangers[writer]
        self.refused["gossip_evicted"] += 1
        writer.transport.abort()

    def _authenticated(self, writer: _Stream) -> None:
        """The connection sent an authentic frame: a member's, never cut for a stranger."""
        if self.strangers.pop(writer, None) is not None:
            self.members[writer] = False


class Node:
    """One overlay member with its sockets: UDP gossip, TCP gossip frames on the same port, and
    (workers) the HTTP/tunnel port that forwards to the engine; its timer ticks the Overlay, and
    its lifecycle holds SERVING until the reach is known (rule 8). It wires the parts: Tunnel
    (the tunnel port), GossipTCP (the gossip port's TCP side), RelayServer and RelayClient (a
    relay's side, a private member's and a dialer's), HolePunch, and Reach (their rules), and
    routes every message (`deliver`, by `routes`, from MESSAGE_TYPES). No part holds the node
    (Tunnel apart): each is given at construction the siblings and call-backs it uses. Those
    are `deliver`, `spawn`, `resolve`; out: `send` (the Overlay's Outs), `schedule`,
    `send_datagram`, `send_frame`, `_sendto`; the Overlay's side: `receive`, `_to_overlay`,
    `address`/`set_address`, `own_record`, `suspected_at`, `is_member`, `knows`,
    `relays_offered`; our reach: `relaying`, `reach_known`; the tunnel port: `serving_tunnel`,
    Tunnel.admit. They share the counters `traffic`, `relayed` and `refused`."""

    def __init__(self, config: Config, role: str = "worker", models=None, hardware=None, labels=None,
                 engine_url: Optional[str] = None):
        self.config = config
        self.role = role
        self.wire = Wire(config.key, config)
        self.models = list(models or [])
        self.hardware = dict(hardware or {})
        self.labels = dict(config.labels)
        self.labels.update(labels or {})
        self.engine = EngineClient(engine_url) if engine_url else None
        self.overlay: Optional[Overlay] = None
        self.draining = False
        self.inflight = 0
        # what the engine was sent, published as `prefixes` (the ingresses' routing; a worker's)
        self.prefixes = PrefixSummary() if self.engine is not None else None
        self.speed = EngineSpeed() if self.engine is not None else None   # published as `speed`
        self.traffic = collections.Counter({"sent": 0, "received": 0,   # bytes, every part's
                                            "malformed": 0})   # authentic messages that made no sense
        self._callbacks: List[Callable[[str, Optional[dict]], None]] = []
        self.udp = None
        self._tcp_server = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_at = math.inf
        self._tasks: set = set()
        self._addr_cache: Dict[str, tuple] = {}
        self._pending_id = crdt.new_session_id()    # the id we will join with
        self._unresolved: List[str] = []            # bootstrap host names that did not resolve yet
        self._warned: set = set()                   # warnings already logged
        self._start_warnings: List[str] = []        # a gossip address others cannot reach, a plain tunnel
        self._joined_said = False                   # "joined" is logged once a member has answered
        self._health_timer: Optional[asyncio.TimerHandle] = None
        self.tunnel_header = (TUNNEL_HEADER, tunnel_credential(config.key))
        self.tunnel_server_ssl, self.tunnel_client_ssl = tunnel_tls(config)
        self.tunnel_sock: Optional[socket.socket] = None   # the tunnel port's listening socket
        self.refused = collections.Counter({r: 0 for r in REFUSALS})
        self.tunnel = Tunnel(config, self.tunnel_server_ssl, self.engine, self.spawn, self.refused,   # the tunnel
                             pages={b"/v1/registry": lambda: (200, crdt.dumps(self.registry_view())),   # port
                                    b"/healthz": self.health_page},
                             started=lambda: self.overlay is not None, draining=lambda: self.draining,
                             inflight=self.count_inflight, prefixes=self.prefixes, speed=self.speed)
        # NAT traversal and relay (see that section): the rules, and the parts that act on them
        self.reach = Reach(config)                  # per relayed address: its relays, punches, tunnels
        self.reach_pending = False                  # a worker's reach check is not done: SERVING waits
        self._held_state: Optional[int] = None      # ... the SERVING it holds meanwhile (rule 8)
        self.relayed = collections.Counter({"forwarded": 0, "spliced": 0, "handed_over": 0, "refused": 0,
                                            "stale": 0, "not_member": 0, "replayed": 0,   # envelopes
                                            # not passed on (RelayServer._refusal)
                                            "muxed": 0,          # streams opened on links, as relay/dialer
                                            "dialed_back": 0, "streams": 0})   # as a private member
        common = dict(spawn=self.spawn, resolve=self.resolve, address=self.address, deliver=self.deliver)
        self.relay_server = RelayServer(config, self.wire, self.reach, self.relayed, self.traffic, **common,
                                        sendto=self._sendto, send_frame=self.send_frame, relaying=self.relaying,
                                        knows=self.knows, relays_offered=self.relays_offered,
                                        ack_timeout_at=self.ack_timeout_at)
        self.relay_client = RelayClient(config, self.wire, self.reach, self.relayed, self.traffic, self.relay_server,
                                        **common, set_address=self.set_address, record=self.own_record,
                                        suspected_at=self.suspected_at, is_member=self.is_member,
                                        relays_offered=self.relays_offered, reach_known=self.reach_known,
                                        ack_timeout_at=self.ack_timeout_at, send_datagram=self.send_datagram, send_frame=self.send_frame,
                                        admit=self.tunnel.admit, serving=self.serving_tunnel,
                                        server_ssl=self.tunnel_server_ssl)
        self.punch = HolePunch(config, self.wire, self.reach, self.relay_client, self.traffic, **common,
                               sendto=self._sendto, admit=self.tunnel.admit, serving=self.serving_tunnel)
        self.relay_client.punch = self.punch        # each asks the other: wired once both exist
        # the gossip port's TCP side: joins, state transfers, and the hellos of links and splices
        self.gossip_tcp = GossipTCP(config, self.wire, self.refused, self.traffic, self.relay_server,
                                    dialled_back=self.relay_client.dialled_back.add, address=self.address,
                                    receive=self.receive, send=self.send, schedule=self.schedule,
                                    deliver=self.deliver, to_overlay=self._to_overlay)
        self.routes = self._routes()                # the one dispatch of a message: Node.deliver

    # -- public API -------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self.overlay.sid if self.overlay else self._pending_id

    @property
    def registry(self) -> crdt.GMap:
        return self.overlay.map

    def count_inflight(self, step: int) -> int:
        """Add `step` to the count of requests at the engine (the tunnel's); return the count before."""
        before = self.inflight
        self.inflight = before + step
        return before

    def health_page(self) -> Tuple[int, bytes]:
        """GET /healthz: 200 while this node serves, 503 while it drains."""
        warnings = self.health_warnings()
        status = "draining" if self.draining else "isolated" if not self.overlay.members and warnings else "ok"
        return 503 if self.draining else 200, crdt.dumps({
            "status": status, "session": self.session_id, "state": crdt.STATE_NAMES[self.overlay.record["state"]],
            "members": len(self.overlay.members), "warnings": warnings, "gossip": self.stats()})

    def is_suspected(self, sid: str) -> bool:
        return self.overlay is not None and self.overlay.is_suspected(sid)

    def round_trip(self, sid: str) -> Optional[float]:
        """This member's measured round trip to a session (FailureDetector.rtt), read only."""
        return self.overlay.rtt(sid) if self.overlay is not None else None

    @property
    def bytes_sent(self) -> int:
        return self.traffic["sent"]

    @property
    def bytes_received(self) -> int:
        return self.traffic["received"]

    def evicted_here(self, sid: str) -> bool:
        """Whether this member wrote the eviction of `sid` itself (its own failure detector's)."""
        return self.overlay is not None and sid in self.overlay.retired

    def on_change(self, callback: Callable[[str, Optional[dict]], None]) -> None:
        """callback(sid, record) after each registry change or change of suspicion."""
        self._callbacks.append(callback)

    def registry_view(self) -> Dict[str, Any]:
        sessions = []
        for sid, record in self.registry.items():
            view = dict(record)
            view.update(session=sid, state=crdt.STATE_NAMES[record["state"]], suspected=self.is_suspected(sid),
                        site=(record.get("labels") or {}).get(crdt.SITE_LABEL),
                        reach="direct" if sid == self.session_id else self.reach_of(record),
                        tunnel="direct" if sid == self.session_id else self.tunnel_reach_of(record))
            sessions.append(view)
        sessions.sort(key=lambda v: (v["state"] != "SERVING", v.get("started", 0)))
        return {"self": self.session_id, "sessions": sessions}

    def reach_of(self, record: Dict[str, Any]) -> str:
        """How this member reaches a session: "direct", "punched" or "relayed"."""
        gossip = record.get("gossip", "")
        if gossip in self.punch.paths:
            return "punched"
        return "relayed" if is_relayed(gossip) else "direct"

    def tunnel_reach_of(self, record: Dict[str, Any]) -> str:
        """How this member's last tunnel connection to a session went: "direct", "punched" (TCP
        simultaneous open, rule 5) or "relayed" (a dial-back or a relay's splice)."""
        addr = record.get("addr", "")
        if not is_relayed(addr):
            return "direct"
        return self.reach.tunnel_reach(addr)

    def stats(self) -> Dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "accepted": self.wire.accepted, "dropped": dict(self.wire.dropped),
                "flooded_by": dict(self.wire.flooders.most_common(8)),
                "malformed": self.traffic["malformed"], "sent": dict(self.overlay.sent if self.overlay else {}),
                "refused": dict(self.refused), "admitted": dict(self.tunnel.admitted), "tunnel_connections": len(self.tunnel.connections),
                "unauthenticated": len(self.tunnel.unauthenticated),
                "gossip_connections": self.gossip_tcp.connections, "gossip_strangers": len(self.gossip_tcp.strangers),
                "private": self.relay_client.private, "observed": self.relay_client.observed,
                "relay_links": sorted(self.relay_client.links), "linked": len(self.relay_server.linked),
                "relayed": dict(self.relayed), **self.punch.stats()}

    async def start(self, serve_http: bool = True, state: int = crdt.SERVING) -> None:
        """Bind the sockets and join the overlay (a new one if there is no bootstrap)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        host, port = await self._bind_gossip()
        gossip_addr = cfg.advertise_gossip or advertise(f"{host}:{port}")
        listen_addr = self._bind_tunnel() if serve_http else cfg.listen_addr
        now = time.time()
        record = {"owner": owner_name(), "state": state, "version": 0, "started": now, "role": self.role,
                  "addr": listen_addr, "gossip": gossip_addr, "models": self.models,
                  "hardware": self.hardware, "labels": self.labels, "code_hash": code_hash(self.role),
                  "relaying": bool(cfg.relay)}
        ends = job_end(os.environ, cfg.grant)
        if ends is not None:                        # the ingress sends nothing new in its last minutes
            record["ends_at"] = ends
        checks_reach = (cfg.reach == "private" and self.role != "relay") or \
            (self.role not in SEED_ROLES and cfg.reach == "auto" and bool(cfg.bootstrap))
        if checks_reach:                            # rule 8: no relaying offered before we are dialable
            record["relaying"] = False
        if checks_reach and self.role == "worker" and state == crdt.SERVING:
            record["state"], self._held_state = crdt.JOIN, state
        self.reach_pending = checks_reach and self.role == "worker"
        self.overlay = Overlay(cfg, self._pending_id, record, now)
        self.overlay.listeners.append(self._changed)
        self.overlay.rejoin_listeners.append(
            lambda old, new: log.warning("session %s was evicted or replaced; rejoined as %s", old, new))
        bootstrap, self._unresolved = await resolve_hosts(await resolve_bootstrap(cfg.bootstrap))
        # Said at the first health check, once the rest of the start (the ingress's API) is up.
        if _is_loopback(host) and (self.role == "ingress" or any(not _is_loopback(split_addr(a)[0])
                                                                  for a in bootstrap)):
            self._start_warnings.append(f"gossip binds {cfg.gossip}, loopback only: members on other hosts cannot "
                                        f"reach this {self.role} (bind all interfaces with --gossip 0.0.0.0:{port})")
        elif not _is_loopback(host) and _is_loopback(split_addr(gossip_addr)[0]):
            self._start_warnings.append(f"gossip binds {cfg.gossip} but advertises {gossip_addr}, where peers on other "
                                        "hosts cannot reach it (this host name resolves to loopback): pass --advertise HOST")
        self.send(self.overlay.join(bootstrap, now))
        self.schedule()
        # An ingress is a seed and dialable, unless told it is not (OTELA_REACH=private: an ingress
        # inside a cluster's private network, whose tunnels to private nodes punch, rule 5).
        if checks_reach:
            self.spawn(self.relay_client.keep_reach(bootstrap))
        self._health_timer = loop.call_later(cfg.join_warn_after, self._check_health)
        # "joined" only once a member has answered (_changed): before that we are alone.
        log.info("session %s started (gossip %s, listen %s); %s", self.session_id, gossip_addr, listen_addr,
                 f"joining through {len(bootstrap)} bootstrap peers" if bootstrap else "no bootstrap: the first member")
        for name in self._unresolved:
            log.warning("bootstrap %s does not resolve; trying again every %.0f s", name, cfg.join_warn_after)

    async def _bind_gossip(self) -> Tuple[str, int]:
        """The gossip sockets, UDP and TCP on one port (port 0: one free for both); the host and
        port bound."""
        loop = asyncio.get_running_loop()
        host, wanted = split_addr(self.config.gossip)
        for _attempt in range(20):                  # port 0: a port free for UDP *and* TCP
            try:
                self.udp, _ = await loop.create_datagram_endpoint(lambda: _GossipProtocol(self._on_datagram),
                                                                   local_addr=(host, wanted))
            except OSError as exc:
                raise OSError(f"cannot bind the gossip address {self.config.gossip}: {exc.strerror or exc}") from None
            port = self.udp.get_extra_info("sockname")[1]
            try:
                self._tcp_server = await loop.create_server(lambda: _Stream(self._on_gossip_connection), host, port,
                                                            reuse_address=True)
                return host, port
            except OSError as exc:
                self.udp.close()
                self.udp = None
                failure = exc
                if wanted:
                    break
        raise OSError(f"cannot bind the gossip address {host}:{port} (TCP): {failure.strerror or failure}")

    def _bind_tunnel(self) -> str:
        """The tunnel's listening socket, accepting; the address the record advertises."""
        cfg = self.config
        lhost, lport = split_addr(cfg.listen)
        try:
            self.tunnel_sock = _listen(lhost, lport)
        except OSError as exc:
            self._tcp_server.close()
            self.udp.close()
            self._tcp_server = self.udp = None
            raise OSError(f"cannot bind the listen address {cfg.listen}: {exc.strerror or exc}") from None
        lport = self.tunnel_sock.getsockname()[1]
        self.spawn(self.tunnel.accept(self.tunnel_sock))
        if self.tunnel_server_ssl is None:
            self._start_warnings.append(
                "the data tunnel is plain HTTP with a static credential (no cluster certificate beside "
                "the key: run keygen where openssl is installed)")
        return cfg.advertise_listen or advertise(f"{lhost}:{lport}")

    def health_warnings(self) -> List[str]:
        """What /healthz and the log say is wrong with our place in the overlay."""
        if self.overlay is None:
            return []
        warnings = self.overlay.health(time.time())
        warnings += [f"bootstrap {name} does not resolve" for name in self._unresolved]
        return warnings

    def _check_health(self) -> None:
        """Every join_warn_after seconds: log each new warning once, and resolve the bootstrap
        names that did not resolve before (DNS may come up after us)."""
        self._health_timer = asyncio.get_running_loop().call_later(self.config.join_warn_after, self._check_health)
        for text in self._start_warnings:
            log.warning("%s", text)
        self._start_warnings = []
        warnings = self.health_warnings()
        for text in warnings:
            if text.split(" has not answered")[0] not in self._warned:
                self._warned.add(text.split(" has not answered")[0])
                log.warning("%s", text)
        if not warnings:
            self._warned.clear()
        if self._unresolved:
            task = asyncio.ensure_future(self._resolve_again())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resolve_again(self) -> None:
        found, self._unresolved = await resolve_hosts(self._unresolved)
        now = time.time()
        for addr in found:
            log.info("bootstrap resolved: %s", addr)
            if addr not in self.overlay.bootstrap:
                self.overlay.bootstrap.append(addr)
            self.overlay.remember(addr, now, seed=True)
            self.send([self.overlay.digest_to(addr)])
        self.schedule()

    def update(self, **fields) -> None:
        """Owner write to our own record (state, models, labels, capacity…). A worker's SERVING
        waits for its reach check (rule 8 of "NAT traversal and relay")."""
        if "state" in fields:
            self._held_state = None
            if fields["state"] == crdt.SERVING and self.reach_pending:
                self._held_state = fields.pop("state")
                log.info("session %s SERVING once its reach is known", self.session_id)
                if not fields:
                    return
        self.send(self.overlay.update(time.time(), **fields))
        self.schedule()

    def reach_known(self, rejoin: bool = False, **fields) -> None:
        """Our reach is known (dialable, or our relayed address is ready in `fields`): the record
        says so, with the SERVING held meanwhile; with `rejoin`, as a new session (rule 7)."""
        self.reach_pending = False
        held, self._held_state = self._held_state, None
        if rejoin:
            self.rejoin(state=self.overlay.record["state"] if held is None else held, **fields)
            return
        if held is not None:
            fields["state"] = held
        if fields:
            self.update(**fields)
        if held is not None:
            log.info("session %s SERVING: its reach is known (%s)", self.session_id,
                     "relayed" if self.relay_client.private else "direct")

    def set_state(self, state: int) -> None:
        self.update(state=state)

    def publish(self, entry_id: str, record: Dict[str, Any]) -> None:
        """Write a replicated key record or usage slot (see Overlay.publish)."""
        self.send(self.overlay.publish(entry_id, record, time.time()))
        self.schedule()

    def adopt(self, entries: List[Tuple[str, Dict[str, Any]]]) -> None:
        """Take back the ingress plane's entries kept in this ingress's --db (see Overlay.adopt)."""
        self.send(self.overlay.adopt(entries, time.time()))
        self.schedule()

    def rejoin(self, **fields) -> None:
        """Leave this session and join again as a new one (engine restart)."""
        self.send(self.overlay.rejoin(time.time(), **fields))
        self.schedule()

    async def stop(self, leave: bool = True) -> None:
        """LEFT (gossiped for `leave_linger` seconds), then close every socket."""
        if self.overlay is not None and leave and not self.overlay.leaving:
            self.send(self.overlay.leave(time.time()))
            self.schedule()
            await asyncio.sleep(self.config.leave_linger)
        for timer in (self._timer, self._health_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._health_timer = None
        if self._tcp_server is not None:
            self._tcp_server.close()
        if self.udp is not None:
            self.udp.close()
        for task in list(self._tasks):
            task.cancel()
        self.tunnel.cut_all()
        self.relay_client.close()
        self.relay_server.close()
        self.punch.close()
        if self.tunnel_sock is not None:
            self.tunnel_sock.close()
        if self.engine is not None:
            self.engine.close()
        self._tcp_server = self.udp = self.tunnel_sock = None

    # -- overlay plumbing -------------------------------------------------------------------
    def _on_gossip_connection(self, stream: _Stream) -> None:
        self.spawn(self.gossip_tcp.serve(stream))

    def _changed(self, sid: str, record: Optional[dict]) -> None:
        if not self._joined_said and sid != self.session_id and self.overlay.members:
            self._joined_said = True
            log.info("session %s joined the overlay (%d members besides it)", self.session_id,
                     len(self.overlay.members))
        gossip = (record or {}).get("gossip", "")
        if is_relayed(gossip):
            if record.get("state", crdt.LEFT) < crdt.LEFT and record.get("relay"):
                if self.reach.learned(gossip, record["relay"].split(","), time.monotonic()) \
                        and self.relay_client.private and is_relayed(self.overlay.addr):
                    self.punch.tend()            # punch now, not at the next relay check
            else:
                self.reach.forget(gossip)           # a relayed address names one process: gone for good
                self.punch.forget(gossip)
        for cb in self._callbacks:
            try:
                cb(sid, record)
            except Exception:
                log.exception("on_change callback failed")

    def schedule(self) -> None:
        if self.overlay is None or self.udp is None:
            return
        when = self.overlay.next_wakeup()
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = asyncio.get_running_loop().call_later(max(0.0, when - time.time()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        try:
            self.send(self.overlay.tick(time.time()))
        finally:                                    # whatever a send raised, the overlay ticks on
            self.schedule()

    def _routes(self) -> Dict[str, Tuple[Callable[[Dict[str, Any], Optional[str], Via], Any], bool]]:
        """MESSAGE_TYPES as one table: type -> (its part's bound handler, whether anyone may
        send it). The Overlay's types go in through Overlay.receive, a join after the check of
        where its answer may go (GossipTCP.answer_join); a reader's type is not routed."""
        parts = {"gossip_tcp": self.gossip_tcp, "relay_server": self.relay_server, "punch": self.punch}
        routes = {}
        for t, row in MESSAGE_TYPES.items():
            if row.part == "overlay":
                routes[t] = (self._to_overlay, row.anyone)
            elif row.part in parts:
                routes[t] = (getattr(parts[row.part], row.handler), row.anyone)
        routes["j"] = (self.gossip_tcp.answer_join, False)
        return routes

    def deliver(self, msg: Dict[str, Any], src: Optional[str], via: Via) -> Optional[Awaitable[None]]:
        """The one dispatch of an authentic message, by its type (Node.routes). `src`: the
        sender's gossip address (None when it named none: only a reach check may come from
        anyone); `via`: where it came in. What the handler has still to do on `via.conn` (a
        reach check's answer) is returned, for the reader to await or spawn."""
        route = self.routes.get(msg["t"])
        if route is None:                           # a reader's type, out of place
            self.traffic["malformed"] += 1
            return None
        handler, anyone = route
        if not anyone:
            if self.overlay is None:                # not started: nothing to say yet
                return None
            if src is None:
                self.traffic["malformed"] += 1
                return None
        return handler(msg, src, via)

    def _to_overlay(self, msg: Dict[str, Any], src: str, via: Via) -> None:
        """The Overlay's message: its answers sent, the timer set for what it started."""
        try:
            outs = self.overlay.receive(msg, src, time.time(), via.tcp)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            self.traffic["malformed"] += 1           # authentic but nonsensical: drop, count
            return
        self.send(outs)
        self.schedule()

    def _on_datagram(self, data: bytes, addr) -> None:
        self.traffic["received"] += len(data)
        if self.overlay is None:
            return
        if data[:2] == FORWARD:
            self.relay_server.forward_envelope(data, from_link=False, sender=f"{addr[0]}:{addr[1]}")
            return
        msg = self.wire.open(data, time.time(), sender=f"{addr[0]}:{addr[1]}")
        if msg is not None:
            src = msg.pop("ra", None)               # relayed: the sender's own gossip address
            self.deliver(msg, src if isinstance(src, str) else f"{addr[0]}:{addr[1]}", Via(False, addr[0]))

    def resolve(self, addr: str) -> tuple:
        cached = self._addr_cache.get(addr)
        if cached is None:
            cached = self._addr_cache[addr] = split_addr(addr)
        return cached

    def send(self, outs: List[Out]) -> None:
        if self.udp is None:
            return
        now = time.time()
        sealed: Dict[int, bytes] = {}
        by_target: Dict[tuple, List[Dict[str, Any]]] = {}
        for o in outs:
            if self.relay_client.private or is_relayed(o.addr):
                self.relay_client.send(o.addr, o.msg, now, o.tcp)
                continue
            try:
                target = self.resolve(o.addr)
            except ValueError:
                continue
            # One rumour goes to several peers as the same bytes: a nonce must be unique per
            # receiver, not per datagram, so sealing once per message is enough.
            data = sealed.get(id(o.msg))
            if data is None:
                data = sealed[id(o.msg)] = self.wire.seal(o.msg, now)
            if o.tcp or len(data) > self.config.max_datagram:
                msg = dict(o.msg, ra=self.overlay.addr)
                if msg["t"] == "j":
                    msg["rc"] = 1                   # answer on this connection (GossipTCP.answer_join)
                    self.spawn(self.gossip_tcp.send(target, [msg], o.addr))
                else:                               # the pieces of one state transfer: one connection
                    by_target.setdefault(target, []).append(msg)
                continue
            self.send_datagram(data, target)
        for target, msgs in by_target.items():
            self.spawn(self.gossip_tcp.send(target, msgs))

    def send_datagram(self, data: bytes, target: tuple) -> None:
        """One datagram out of the gossip port, counted; an error sending it is a datagram lost."""
        try:
            self.udp.sendto(data, target)
            self.traffic["sent"] += len(data)
        except OSError:
            pass


    def send_frame(self, target: tuple, sealed: bytes) -> None:
        """A sealed message (or an envelope) too big for a datagram, on a TCP connection of its own."""
        self.spawn(self.gossip_tcp.send_frame(target, sealed))

    def _sendto(self, data: bytes, target: tuple) -> None:
        """A datagram out of the gossip port as it is (what a relay passes on, a mapping it tells)."""
        self.udp.sendto(data, target)

    def receive(self, msg: Dict[str, Any], src: str, now: float, tcp: bool) -> List[Out]:
        return self.overlay.receive(msg, src, now, tcp)

    # -- what the parts ask of the Overlay ---------------------------------------------------
    def address(self) -> str:
        """Our gossip address ("" before the overlay starts)."""
        return self.overlay.addr if self.overlay is not None else ""

    def set_address(self, addr: str) -> None:
        """Our gossip address is now `addr` (a private member's relayed address)."""
        self.overlay.addr = addr

    def own_record(self) -> Dict[str, Any]:
        return self.overlay.record

    def suspected_at(self, addr: str) -> bool:
        """Whether the live member at gossip address `addr` is suspected."""
        sid = self.overlay.by_addr.get(addr)
        return sid is not None and self.overlay.is_suspected(sid)

    def ack_timeout_at(self, addr: str) -> Optional[float]:
        """How long an ack from the live member at gossip address `addr` may take (its srtt + 4
        rttvar, FailureDetector), None before its first ack or when no member is there."""
        sid = self.overlay.by_addr.get(addr) if self.overlay is not None else None
        return None if sid is None or sid not in self.overlay.round_trips else self.overlay._rto(sid)

    def is_member(self, addr: str) -> bool:
        """Whether a live member is at gossip address `addr`."""
        return addr in self.overlay.by_addr

    def knows(self, addr: str) -> bool:
        """A live member's address, or one we dial again (Overlay.remember)."""
        return addr in self.overlay.by_addr or addr in self.overlay.remembered

    def relaying(self) -> bool:
        """Whether we relay for private members now (configured, and dialable ourselves)."""
        return bool(self.config.relay) and not self.relay_client.private

    def serving_tunnel(self) -> bool:
        """Whether the tunnel port is open (a tunnel connection punched or dialled back to us has
        somewhere to go)."""
        return self.tunnel_sock is not None

    def relays_offered(self, leave_out: Tuple[str, ...] = ()) -> List[str]:
        """The gossip addresses of the members offering to relay, best first (Reach.rank_relays:
        the nearest by our measured round trip, then by role); never ourselves, a suspected or
        relayed member, or one at an address in `leave_out`."""
        offers = []
        for sid, record in self.registry.items() if self.overlay is not None else ():
            gossip = record.get("gossip", "")
            if sid == self.session_id or record.get("state", crdt.LEFT) >= crdt.LEFT or not record.get("relaying") \
                    or is_relayed(gossip) or self.is_suspected(sid) or gossip in leave_out:
                continue
            offers.append((gossip, str(record.get("role", "")), self.overlay.rtt(sid)))
        return Reach.rank_relays(offers, held=self.relay_client.links)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def resolve_bootstrap(specs: List[str]) -> List[str]:
    """HOST:PORT entries, files holding them (one or more per line, commas allowed), or http(s)
    URLs returning the same text or a JSON list."""
    out: List[str] = []
    for spec in specs:
        for item in (s.strip() for s in spec.split(",")):
            if item:
                out += await _bootstrap_entries(item)
    good = []
    for addr in out:
        try:
            split_addr(addr)
            good.append(addr)
        except ValueError:
            log.warning("ignoring bad bootstrap address %r", addr)
    return good


async def _bootstrap_entries(item: str) -> List[str]:
    """One --bootstrap item read: itself (HOST:PORT), or what its URL or file lists."""
    if item.startswith(("http://", "https://")):
        try:
            text = await asyncio.get_running_loop().run_in_executor(None, _fetch_text, item)
        except OSError as exc:
            log.warning("bootstrap URL %s failed: %s", item, exc)
            return []
    elif os.path.isfile(item):
        with open(item) as fh:
            text = fh.read()
    else:
        return [item]
    try:
        entries = crdt.loads(text)
        if not isinstance(entries, list):
            raise ValueError
    except ValueError:
        entries = text.replace(",", " ").split()
    return [str(e) for e in entries]


async def resolve_hosts(addrs: List[str]) -> Tuple[List[str], List[str]]:
    """HOST:PORT entries with host names resolved to an address (IPv4 first), so that a peer's
    answer, which comes from its address, is recognised as the bootstrap's; and the entries
    whose name does not resolve."""
    loop = asyncio.get_running_loop()
    found, missing = [], []
    for addr in addrs:
        host, port = split_addr(addr)
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
            found.append(addr)
            continue
        except OSError:
            pass
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except (OSError, UnicodeError):
            missing.append(addr)
            continue
        infos.sort(key=lambda info: info[0] != socket.AF_INET)
        ip = infos[0][4][0]
        found.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return found, missing


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read(1 << 20).decode()


# =============================================================================================
# Prompt prefixes: what an engine's prefix cache may hold, as a chain of keyed hashes
# =============================================================================================
# A request's prompt is rendered in order (every message: role, then content; or the completion
# prompt) and cut into blocks of PREFIX_BLOCK_CHARS bytes; block i's hash covers blocks 0..i
# (one keyed BLAKE2b over the prompt, read out at each block's end: about 1 us a block, 40 us
# for a 10 KB prompt), so two prompts share hash i exactly when they share
# their first i+1 blocks: the part an engine's prefix cache can reuse. The ingress's `ttft`
# policy matches a request's chain against what it sent where; a node publishes the hashes of
# what its engine was sent (PrefixSummary), so every ingress sees traffic it did not route. The
# hashes are keyed by the ingress tier's secret (the cluster key where there is none), and the
# ingress sends a node each prompt's anchors with it (PREFIX_HEADER): a compute job learns the
# anchors of the prompts it is sent, and cannot compute those of a prompt it never saw (an
# application's system prompt) to claim it; a reader of the registry cannot test a guessed prompt.
PREFIX_BLOCK_CHARS = 256      # about 50-64 tokens: a few of vLLM's 16-token blocks
PREFIX_MAX_BLOCKS = 1024      # 256 KiB of prompt: deeper than that, no more hashes
PREFIX_HASH_BYTES = 8
PREFIX_MAX_ANCHORS = 12       # a chain's anchors: depths 1, 2, 4, ..., 1024 and its end
PREFIX_PUBLISHED = 64         # hashes a node publishes in its record (each 11 characters)
PREFIX_REMEMBERED = 4096      # ... chosen among this many it remembers
ANSWER_TAIL = 1024            # the bytes of an answer's end a node keeps (its usage is there)
PUBLISH_VIEW_S = 2.0          # a worker publishes its prefixes and load at most this often
LOAD_STEP = 2                 # ... its load when it moved by this many requests (or a quarter)


# The usage an answer reports (a whole body, or the SSE event that carries it): the ingress's
# ledger and policy read it, and a node its engine's speed (EngineSpeed).
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_INPUT_TOKENS = re.compile(rb'"input_tokens"\s*:\s*(\d+)')     # the Responses API's names
_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*(\d+)')


def usage_of(body: bytes, start: int = 0) -> Tuple[int, int]:
    """(prompt, completion) tokens of the last usage object in a response body or SSE event: the
    chat and completion routes' prompt_tokens and completion_tokens, or the Responses API's
    input_tokens and output_tokens (in `usage`, and in its stream's response.completed event)."""
    at = body.rfind(b'"usage"', start)
    if at < 0:
        return 0, 0
    prompt = _count_after(body, b'"prompt_tokens"', _PROMPT_TOKENS, at)
    completion = _count_after(body, b'"completion_tokens"', _COMPLETION_TOKENS, at)
    if prompt or completion or body.find(b'"input_tokens"', at) < 0:
        return prompt, completion
    return _count_after(body, b'"input_tokens"', _INPUT_TOKENS, at), \
        _count_after(body, b'"output_tokens"', _OUTPUT_TOKENS, at)


def cached_of(body: bytes) -> Optional[int]:
    """The cached prompt tokens the engine reported in its last usage (vLLM, SGLang:
    usage.prompt_tokens_details.cached_tokens) or timings (llama.cpp: cache_n); None when it
    reported neither."""
    at = body.rfind(b'"cached_tokens"')
    key, pattern = b'"cached_tokens"', _CACHED_TOKENS
    if at < 0:
        at = body.rfind(b'"cache_n"')
        key, pattern = b'"cache_n"', _CACHE_N
        if at < 0:
            return None
    return _count_after(body, key, pattern, at)


def _count_after(body: bytes, key: bytes, pattern: re.Pattern, at: int) -> int:
    """The count `pattern` finds after `at`: the common `"key":123` (or `"key": 123`) read with no
    regex (at 16 requests/s the CPU is cold, and the regex engine is code a request would run only
    for this), anything else (more spaces, no digits) by the pattern."""
    i = body.find(key, at)
    if i < 0:
        return 0
    i += len(key)
    if body[i:i + 1] == b":":
        start = i + 2 if body[i + 1:i + 2] == b" " else i + 1   # Python's json.dumps writes '": "'
        digits = body[start:start + 19]
        n = len(digits) - len(digits.lstrip(b"0123456789"))
        if 0 < n < len(digits):
            return int(digits[:n])
    match = pattern.search(body, i - len(key))
    if match is None:
        return 0
    digits = match.group(1)
    # more digits than 2^63 has is no honest count: read as 10^19 (the ingress books it at its
    # bound), never parsed (Python refuses past 4,300 digits, and the work grows as their square)
    return int(digits) if len(digits) <= 19 else 10 ** 19


def prefix_key(key: bytes) -> bytes:
    """The key of the prefix hashes, from the ingress tier's secret (every ingress derives the same)."""
    return hmac.new(key, b"prompt prefix", hashlib.sha256).digest()[:32]


def prompt_text(request: Dict[str, Any]) -> str:
    """The prompt as an engine's chat template would see it, in order: each message's role and
    content (the text of content parts; other parts as their JSON), or a completion's prompt.
    "" when there is none to match (a batch of prompts, token ids)."""
    messages = request.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str)
                                  else crdt.dumps(p).decode() for p in content)
            elif not isinstance(content, str):
                content = "" if content is None else crdt.dumps(content).decode()
            parts += (str(message.get("role", "")), "\x1f", content, "\x1e")
        return "".join(parts)
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def prompt_chain(text: str, key: bytes) -> List[bytes]:
    """The chain of block hashes of `text` (full blocks only, at most PREFIX_MAX_BLOCKS)."""
    data = text.encode("utf-8", "surrogatepass")
    end = min(len(data) // PREFIX_BLOCK_CHARS, PREFIX_MAX_BLOCKS) * PREFIX_BLOCK_CHARS
    running = hashlib.blake2b(digest_size=PREFIX_HASH_BYTES, key=key)   # one MAC over the prompt so far
    chain: List[bytes] = []
    update, copy, append = running.update, running.copy, chain.append
    for at in range(0, end, PREFIX_BLOCK_CHARS):
        update(data[at:at + PREFIX_BLOCK_CHARS])
        append(copy().digest())
    return chain


def prefix_anchors(chain: List[bytes]) -> List[bytes]:
    """The hashes a summary keeps of a chain: at depths 1, 2, 4, 8, … blocks and the last, so a
    match is known to within a factor of two of its length from a handful of hashes."""
    anchors, depth = [], 1
    while depth <= len(chain):
        anchors.append(chain[depth - 1])
        depth *= 2
    if chain and depth // 2 != len(chain):
        anchors.append(chain[-1])
    return anchors


def encode_prefixes(hashes: List[bytes]) -> str:
    return base64.b64encode(b"".join(hashes)).decode()


def decode_prefixes(text: Any) -> Dict[bytes, None]:
    """A record's published prefixes as a set of hashes; {} for anything malformed."""
    if not isinstance(text, str) or len(text) > 4 * PREFIX_PUBLISHED * PREFIX_HASH_BYTES:
        return {}
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:
        return {}
    n = PREFIX_HASH_BYTES
    return dict.fromkeys(data[at:at + n] for at in range(0, len(data) - n + 1, n))


class SpeedFit:
    """How fast one kind of engine (a model on a hardware weight) gets to a first token, as this
    ingress learns it from the answers of every session of that kind:
    ttft = base + per_token x prefill + per_stream x streams, where prefill is the prompt tokens
    it had to compute first (the uncached part of this prompt and of those sent ahead of it, not
    yet answered) and streams the requests it was decoding meanwhile. Least squares with
    exponential forgetting (each answer weighs DECAY of the next one), pulled towards a prior
    from the hardware (the ingress's GPU weights) as much as PRIOR_ANSWERS answers would pull it,
    so a few answers of one size do not tilt it. One fit per kind, not per session: sessions
    of one kind are the same hardware, and their differences now are their queues."""

    DECAY = 0.98
    PRIOR_ANSWERS = 0.5
    SCALE = (1.0, 1000.0, 10.0)   # a feature's usual size, where answers have not shown it yet

    __slots__ = ("prior", "theta", "sums", "targets", "answers", "ceiling")

    def __init__(self, weight: float, prefill: Optional[float] = None):
        """`prefill`: prompt tokens/s measured elsewhere (the engine's node publishes its own)."""
        weight = max(weight, 0.01)
        # an H100 (weight 3.35): ~30 ms floor, ~20k prompt tokens/s, ~0.2 ms more per stream
        per_token = 1.0 / prefill if prefill and prefill > 0 else 1.0 / (6000.0 * weight)
        self.prior = (0.1 / weight, per_token, 0.0007 / weight)
        self.theta = list(self.prior)
        self.sums = [[0.0] * 3 for _ in range(3)]
        self.targets = [0.0] * 3
        self.answers = 0.0
        self.ceiling = math.inf   # seconds per prompt token whole answers have shown at most (bound)

    def per_token(self) -> float:
        """Seconds per prompt token: the fit's, or less where whole answers showed less."""
        return min(self.theta[1], self.ceiling)

    def bound(self, prefill: float, seconds: float) -> None:
        """A whole answer (no first token seen) came `seconds` after it went, with `prefill`
        tokens to compute first: the engine prefills at least that fast. The ceiling rises by
        1/DECAY per answer that does not renew it, so an engine that slowed is believed again."""
        if prefill >= 1.0:
            self.ceiling = min(seconds / prefill, self.ceiling / self.DECAY)

    def predict(self, prefill: float, streams: float) -> float:
        base, per_token, per_stream = self.theta
        return base + per_token * prefill + per_stream * streams

    def learn(self, prefill: float, streams: float, ttft: float) -> None:
        d, x = self.DECAY, (1.0, prefill, streams)
        sums, targets = self.sums, self.targets
        for i in range(3):
            targets[i] = targets[i] * d + x[i] * ttft
            row = sums[i]
            for j in range(3):
                row[j] = row[j] * d + x[i] * x[j]
        self.answers = answers = self.answers * d + 1.0
        # (sums + ridge) theta = targets + ridge x prior, by Gaussian elimination
        m = []
        for i in range(3):
            ridge = self.PRIOR_ANSWERS * max(sums[i][i] / answers, self.SCALE[i] ** 2)
            m.append([sums[i][j] + (ridge if i == j else 0.0) for j in range(3)] +
                     [targets[i] + ridge * self.prior[i]])
        for col in range(3):
            pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
            m[col], m[pivot] = m[pivot], m[col]
            if abs(m[col][col]) < 1e-300:
                return
            for r in range(3):
                if r != col:
                    f = m[r][col] / m[col][col]
                    m[r] = [a - f * b for a, b in zip(m[r], m[col])]
        base, per_token, per_stream = (m[i][3] / m[i][i] for i in range(3))
        self.theta = [max(base, 0.0), max(per_token, self.prior[1] * 0.01), max(per_stream, 0.0)]


class _AnswerWatch:
    """One answer through the tunnel as EngineSpeed reads it: when its first body byte came, and
    its last bytes (where the usage is)."""

    __slots__ = ("first_at", "tail")

    def __init__(self):
        self.first_at: Optional[float] = None
        self.tail = b""

    def seen(self, data: bytes) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.tail = (self.tail + data)[-ANSWER_TAIL:]


class EngineSpeed:
    """The engine's speed as its streamed answers through this node show it, from every ingress:
    its time to first token fitted on the prompt tokens it computed (usage less cached) and the
    requests it held meanwhile (SpeedFit), and its seconds per output token. Published in the
    session's record as `speed` ({"prefill", "decode"}: tokens/s, two significant digits), so
    every ingress, and anyone reading the registry (the placer), sees what each engine does."""

    MIN_ANSWERS = 8      # answers before a speed is published
    CHANGE = 0.15        # ... and a change smaller than this share is not published again

    def __init__(self):
        self.fit = SpeedFit(1.0)
        self.itl = 0.0
        self.answers = 0
        self.published: Optional[Dict[str, float]] = None

    @staticmethod
    def watch() -> _AnswerWatch:
        return _AnswerWatch()

    def answered(self, watch: _AnswerWatch, sent: float, others: int) -> None:
        """A streamed answer ended well: learn from it (one that reports no usage teaches nothing)."""
        prompt, completion = usage_of(watch.tail)
        if not prompt or watch.first_at is None:
            return
        cached = cached_of(watch.tail) or 0
        now = time.monotonic()
        self.fit.learn(max(prompt - cached, 0), others, max(watch.first_at - sent, 0.0))
        if completion > 1 and now > watch.first_at:
            itl = (now - watch.first_at) / (completion - 1)
            self.itl = itl if not self.itl else self.itl + (itl - self.itl) * 0.1
        self.answers += 1

    def changed(self) -> Optional[Dict[str, float]]:
        """The speed to publish, when there is one and it moved by CHANGE since the last."""
        if self.answers < self.MIN_ANSWERS or not self.itl:
            return None
        view = {"prefill": _two_digits(1.0 / self.fit.theta[1]), "decode": _two_digits(1.0 / self.itl)}
        last = self.published
        if last is not None and all(abs(view[k] - last[k]) <= self.CHANGE * last[k] for k in view):
            return None
        self.published = view
        return view


def _two_digits(x: float) -> float:
    return float(f"{x:.2g}")


class PrefixSummary:
    """What a node's engine was sent lately, as prefix anchors (prefix_anchors): the ones seen
    most often and most lately go in the session's record (`prefixes`), so that every ingress
    knows which prefixes this engine holds, whoever routed them. The last anchor of each prompt
    is its end: a conversation that comes back continues from there, so the latest ends go
    first, counted in `prefix_ends` (an ingress credits a conversation continued where its last
    turn ended, as it does for its own traffic). Bounded: PREFIX_REMEMBERED anchors and ends,
    least recently seen dropped first."""

    def __init__(self):
        self.seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()   # anchor -> count
        self.ends: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # prompts' last
        self.changed = False

    def add(self, anchors: List[bytes]) -> None:
        """A request forwarded to the engine: its prompt's anchors (prefix_anchors, the last one
        where it ends), as the ingress that sent it hashed them (PREFIX_HEADER)."""
        if not anchors:
            return
        seen, ends = self.seen, self.ends
        for anchor in anchors:
            seen[anchor] = seen.pop(anchor, 0) + 1
        ends.pop(anchors[-1], None)
        ends[anchors[-1]] = None
        self.changed = True
        while len(seen) > PREFIX_REMEMBERED:
            seen.popitem(last=False)
        while len(ends) > PREFIX_REMEMBERED:
            ends.popitem(last=False)

    def published(self) -> Tuple[str, int]:
        """The anchors to publish and how many of them, first, are ends: the latest ends (half
        the room, or what the others leave), then the anchors seen more than once (shared
        prefixes), then the rest, latest first."""
        self.changed = False
        latest = list(reversed(self.seen.items()))
        shared = [a for a, n in latest if n > 1]
        room = PREFIX_PUBLISHED - min(len(shared), PREFIX_PUBLISHED // 2)
        ends = list(itertools.islice(reversed(self.ends), room))
        chosen = dict.fromkeys(ends)
        for a in itertools.chain(shared, (a for a, n in latest if n == 1)):
            if len(chosen) >= PREFIX_PUBLISHED:
                break
            chosen.setdefault(a)
        return encode_prefixes(list(chosen)), len(ends)


# =============================================================================================
# Engine supervisor: start the engine, wait for it, watch it, stop it
# =============================================================================================
class EngineExited(Exception):
    pass


def _die_with_parent() -> None:                     # runs in the child between fork and exec
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: even a
    except (OSError, AttributeError):                               # kill -9 of the node kills
        pass                                                        # the engine


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(kinds: Tuple[int, ...] = (socket.SOCK_STREAM,), avoid: Optional[Set[int]] = None) -> int:
    """A loopback port free now for each socket kind in `kinds`, for a server that binds it later
    (vLLM takes tens of seconds). Taken below the kernel's ephemeral range: a port bound to 0
    comes from that range, where any outgoing connection on the machine could take it as its
    source port before the server binds it. `avoid`: ports not to hand out, and the chosen one
    is added to it (a caller choosing several ports before any is bound). Port 0's pick when no
    port below the range is free."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), max(1025, low))
        if avoid is not None and port in avoid:
            continue
        try:
            for kind in kinds:
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        if avoid is not None:
            avoid.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =============================================================================================
# Spans to an OTLP collector (--otlp-endpoint): the ingress's and the node's
# =============================================================================================
# A worker's tunnel makes a span of each request whose traceparent (the ingress's) it is given:
# the tunnel's time with the request, and the engine's to its answer's head (node_spans), in the
# ingress's trace, a child of its span.
TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
OTLP_QUEUE_MAX = 8192        # spans waiting for the exporter at most (~3 spans a request: ~2,700
                             # requests, a few seconds at full load); the next is dropped and counted
OTLP_BATCH = 512             # spans per POST (~200 KB of JSON): one collector request a second
                             # at ~170 requests/s
OTLP_INTERVAL_S = 1.0        # a span reaches the collector within about a second
OTLP_TIMEOUT_S = 2.0         # a collector silent this long failed: its batch is dropped and counted


def new_span_id() -> str:
    return "%016x" % (random.getrandbits(64) | 1)


def node_span(fields: Dict[bytes, bytes], target: bytes) -> Optional[list]:
    """The start of a request's node span: [trace, the ingress's span, path, now], None without
    a valid traceparent."""
    given = fields.get(b"traceparent")
    found = TRACEPARENT.fullmatch(given) if given is not None else None
    if found is None:
        return None
    return [found.group(2).decode(), found.group(3).decode(), target.split(b"?", 1)[0][:256].decode("latin-1"),
            time.monotonic()]


def node_spans(item: tuple, nanos: Callable[[float], str]) -> List[Dict[str, Any]]:
    """A tunnelled request's spans (OTLP/JSON): the tunnel's, from the request to the answer's
    end, and the engine's to its answer's head (when it answered)."""
    trace, parent, path, sent, *answered, end = item
    span = new_span_id()
    spans = [{"traceId": trace, "spanId": span, "parentSpanId": parent, "name": "otela.node.tunnel", "kind": 2,
              "startTimeUnixNano": nanos(sent), "endTimeUnixNano": nanos(end),
              "attributes": [{"key": "url.path", "value": {"stringValue": path}}]}]
    if answered:
        head_at, status = answered
        spans[0]["attributes"].append({"key": "http.response.status_code", "value": {"intValue": str(status)}})
        spans[0]["status"] = {"code": 2 if status >= 500 else 1}
        spans.append({"traceId": trace, "spanId": new_span_id(), "parentSpanId": span,
                      "name": "otela.engine.first_byte", "kind": 3, "startTimeUnixNano": nanos(sent),
                      "endTimeUnixNano": nanos(head_at)})
    return spans


class SpanExporter:
    """Spans to an OTLP/HTTP JSON collector (POST {endpoint}/v1/traces) from a thread of its own,
    in batches. The request path only appends a tuple to a bounded queue (add): a collector that
    is down, slow or never answers costs requests nothing; its spans are dropped and counted
    (otela_otlp_spans_dropped_total)."""

    def __init__(self, endpoint: str, render: Callable[[tuple, Callable[[float], str]], List[Dict[str, Any]]],
                 service: str, queue_max: int = OTLP_QUEUE_MAX, batch: int = OTLP_BATCH,
                 interval: float = OTLP_INTERVAL_S, timeout: float = OTLP_TIMEOUT_S):
        url = urllib.parse.urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--otlp-endpoint {endpoint!r}: expected http(s)://HOST:PORT[/path]")
        self.scheme, self.host, self.port = url.scheme, url.hostname, url.port
        path = url.path.rstrip("/")
        self.path = path if path.endswith("/v1/traces") else path + "/v1/traces"
        self.render, self.service, self.queue_max = render, service, queue_max
        self.batch, self.interval, self.timeout = batch, interval, timeout
        self.queue: collections.deque = collections.deque()   # (append and popleft are atomic)
        self.exported = 0
        self.dropped_full = 0     # counted by the event loop: the queue was full
        self.dropped_failed = 0   # counted by the thread: the collector failed or timed out
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="otela-otlp", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self.dropped_full + self.dropped_failed

    def add(self, span: tuple) -> None:
        """One request's spans, as `render` takes them: queued, or dropped when the queue is full."""
        if len(self.queue) >= self.queue_max:
            self.dropped_full += 1
            return
        self.queue.append(span)

    def stop(self, wait: float = 1.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(wait)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self.interval)
            self._wake.clear()
            while self.queue and not self._stopped:
                batch = [self.queue.popleft() for _ in range(min(self.batch, len(self.queue)))]
                try:
                    self._post(batch)
                    self.exported += len(batch)
                except (OSError, http.client.HTTPException, ValueError):
                    self.dropped_failed += len(batch)

    def _post(self, batch: List[tuple]) -> None:
        body = crdt.dumps(self.document(batch, time.time() - time.monotonic()))
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", self.path, body, {"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            if answer.status >= 300:
                raise ValueError(f"the collector answered {answer.status}")
        finally:
            conn.close()

    def document(self, batch: List[tuple], offset: float) -> Dict[str, Any]:
        """The OTLP/JSON ExportTraceServiceRequest of a batch; `offset` turns the loop's monotonic
        clock into Unix time (`render` makes each item's spans with it)."""
        def nanos(t: float) -> str:
            return str(int((t + offset) * 1e9))
        spans = [span for item in batch for span in self.render(item, nanos)]
        return {"resourceSpans": [{"resource": {"attributes": [
                    {"key": "service.name", "value": {"stringValue": self.service}}]},
                "scopeSpans": [{"scope": {"name": self.service}, "spans": spans}]}]}


def engine_scheduling(argv: List[str]) -> Dict[str, str]:
    """{"scheduling": "priority"} when an engine's command line turns priority scheduling on."""
    for at, arg in enumerate(argv):
        if arg == "--enable-priority-scheduling" or arg == "--scheduling-policy=priority" or (
                arg == "--scheduling-policy" and argv[at + 1:at + 2] == ["priority"]):
            return {"scheduling": "priority"}
    return {}


def engine_catalog(data: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The record's fields of an engine's /v1/models `data`: `models` (every id, its LoRA adapters
    too, so an ingress of the release before adapters routes them as models), `adapters`
    ({adapter: [parent, root]}, as vLLM answers an adapter: `parent` its base, `root` its path)
    and `max_model_len` (vLLM's field; llama.cpp's server gives `meta.n_ctx`), the smallest
    window where the ids differ. Names and counts past the registry's bounds are left out."""
    models: List[str] = []
    adapters: Dict[str, List[str]] = {}
    windows = []
    for entry in data:
        name = str(entry["id"])
        if len(name) > crdt.MAX_STRING or len(models) >= crdt.MAX_LIST:
            continue
        models.append(name)
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != name and len(adapters) < crdt.MAX_ADAPTERS:
            root = entry.get("root") if isinstance(entry.get("root"), str) else ""
            adapters[name] = [parent[:crdt.MAX_STRING], root if len(root) <= crdt.MAX_STRING else ""]
        window = entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx")
        if isinstance(window, int) and not isinstance(window, bool) and 0 < window < 2**31:
            windows.append(window)
    found: Dict[str, Any] = {"models": models, "adapters": adapters}
    if windows:
        found["max_model_len"] = min(windows)
    return found


def publish_catalog(node: Node, catalog: Dict[str, Any], **fields) -> None:
    """Our record's models from `catalog` (with `fields`): where the adapters' paths make it larger
    than a record may be, without their paths; then without the adapters (their names stay models)."""
    adapters = catalog.get("adapters") or {}
    tries = [adapters, {a: [p, ""] for a, (p, _) in adapters.items()}, {}] if adapters else [{}]
    for i, kept in enumerate(tries):
        try:
            node.update(**fields, **{**catalog, "adapters": kept})
            return
        except crdt.RecordError:
            if i == len(tries) - 1:
                raise
            log.warning("the engine's adapters do not fit a record %s", "with their paths: published without them"
                        if i == 0 else "at all: published as models without their bases")


async def follow_engine_models(node: Node, supervisor: EngineSupervisor, published: Dict[str, Any],
                               changed: asyncio.Event) -> None:
    """While the engine serves, read its /v1/models again every engine_models_interval (engines
    with /health) and at once when `changed` is set (a load or unload went through the tunnel),
    and publish what changed: models loaded after the engine started get routed."""
    while True:
        period = supervisor.config.engine_models_interval if supervisor.health_route else None
        try:
            await asyncio.wait_for(changed.wait(), period)
        except asyncio.TimeoutError:
            pass
        changed.clear()
        if node.overlay is None or node.overlay.record.get("state") != crdt.SERVING or node.draining:
            continue
        try:
            catalog = await supervisor.catalog()
        except EngineError as exc:
            log.info("re-reading the engine's models: %s", exc)   # its health checks judge it
            continue
        if catalog != published:
            published.clear()
            published.update(catalog)
            publish_catalog(node, catalog)
            log.info("session %s models now: %s", node.session_id, ", ".join(catalog["models"]))


class EngineSupervisor:
    """The engine as a child process: its own process group (so its workers die with it), never
    daemonized, killed with the node even on SIGKILL (PR_SET_PDEATHSIG)."""

    def __init__(self, command: str, engine_url: Optional[str], config: Config):
        if "{port}" in command:                     # let the node pick a free loopback port
            port = free_port()
            command = command.replace("{port}", str(port))
            engine_url = engine_url or f"http://127.0.0.1:{port}"
        self.argv = shlex.split(command)
        if not self.argv:
            raise ConfigError("--process is empty")
        if engine_url is None:
            port = 8000                             # vLLM's default port
            for flag, value in zip(self.argv, self.argv[1:]):
                if flag == "--port" and value.isdigit():
                    port = int(value)
            engine_url = f"http://127.0.0.1:{port}"
        self.url = engine_url
        self.config = config
        self.client = EngineClient(engine_url)
        # what the record says of how the engine orders its queue: "priority" where its command
        # asks for priority scheduling (vLLM's --scheduling-policy priority, SGLang's
        # --enable-priority-scheduling), so an ingress sends each request's class as the body's
        # `priority`. A job that claims it falsely only gets requests with a `priority` it ignores
        # or refuses (its own clients' loss); an ingress of a release before reads no such field.
        self.scheduling = engine_scheduling(self.argv)
        self.health_path = "/health"
        self.health_route = True                    # False: the engine has no /health route
        self.proc: Optional[asyncio.subprocess.Process] = None

    async def spawn(self) -> None:
        try:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, stdin=subprocess.DEVNULL,
                                                             start_new_session=True,
                                                             preexec_fn=_die_with_parent)
        except OSError as exc:
            raise ConfigError(f"cannot start engine {self.argv[0]!r}: {exc.strerror}") from None
        log.info("engine started (pid %d): %s", self.proc.pid, " ".join(self.argv))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def _probe(self) -> Tuple[int, str]:
        try:
            status, _ = await self.client.get(self.health_path, self.config.engine_check_timeout)
            return status, f"HTTP {status}"
        except EngineError as exc:
            return 0, str(exc)

    async def _liveness(self) -> Tuple[int, str]:
        """Once ready, an engine without /health is alive while its HTTP server answers at all:
        probing /v1/models instead would queue behind generations in llama-cpp-python (one
        lock for every route) and, with its default --interrupt_requests, cut user streams."""
        if self.health_route:
            return await self._probe()
        # A TCP connect, not a request: its HTTP server logs none (GET /health, answered 404,
        # put a line into the node's log every 2 s). A hung server that still accepts is left
        # to the ingress's passive health, which takes it out of rotation after two failures.
        host, port = split_addr(self.url.split("://", 1)[-1].split("/", 1)[0])
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                               self.config.engine_check_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            return 0, f"connect to {host}:{port}: {exc or 'timed out'}"
        writer.close()
        return 200, "accepts connections"

    async def wait_ready(self) -> None:
        """Poll /health (or /v1/models when there is no /health) until 200; log progress."""
        started = time.monotonic()
        next_log = started + 10
        delay = 0.1
        while True:
            if not self.alive():
                raise EngineExited(f"engine exited with code {self.proc.returncode} before it was ready")
            status, detail = await self._probe()
            if status == 404 and self.health_path == "/health":
                self.health_path = "/v1/models"     # e.g. engines without a /health route
                self.health_route = False
                continue
            if status == 200:
                log.info("engine ready after %.1f s", time.monotonic() - started)
                return
            now = time.monotonic()
            if now - started > self.config.engine_ready_timeout:
                raise EngineExited(f"engine not ready after {self.config.engine_ready_timeout:.0f} s ({detail})")
            if now >= next_log:
                log.info("waiting for engine at %s: %.0f s so far (%s)", self.url, now - started, detail)
                next_log = now + 30
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)             # fast for small models, 1 s polls for big ones

    async def models(self) -> List[str]:
        return (await self.catalog())["models"]

    async def catalog(self) -> Dict[str, Any]:
        """The record's fields of the engine's /v1/models (engine_catalog)."""
        status, body = await self.client.get("/v1/models", self.config.engine_check_timeout)
        if status != 200:
            raise EngineError(f"/v1/models answered {status}")
        try:
            return engine_catalog(crdt.loads(body)["data"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EngineError("/v1/models returned no model list") from None

    async def watch(self) -> str:
        """Return (a reason) when the engine exits or fails `engine_check_failures` checks in a row."""
        failures = 0
        # an exit ends the wait at once, not a check later (an engine this process did not start:
        # the checks alone)
        exited = asyncio.ensure_future(self.proc.wait() if self.proc is not None else asyncio.Event().wait())
        try:
            while True:
                await asyncio.wait({exited}, timeout=self.config.engine_check_interval)
                if not self.alive():
                    return f"engine exited with code {self.proc.returncode}"
                status, detail = await self._liveness()
                failures = 0 if status == 200 else failures + 1
                if failures >= self.config.engine_check_failures:
                    return f"engine failed {failures} health checks ({detail})"
        finally:
            exited.cancel()

    async def stop(self) -> None:
        self.client.close()
        if self.proc is None or self.proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.config.engine_stop_timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                await asyncio.wait_for(self.proc.wait(), wait)
                break
            except asyncio.TimeoutError:
                continue
        log.info("engine stopped (code %s)", self.proc.returncode)


def detect_hardware() -> Dict[str, Any]:
    """GPU name, count and per-GPU memory from nvidia-smi or rocm-smi; CPU fallback."""
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    if out:
        rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if "," in line]
        if rows:
            count = len(rows)
            if visible not in (None, ""):
                count = min(count, len([v for v in visible.split(",") if v.strip()]))
            return {"gpu": rows[0][0], "count": count, "memory_gb": round(float(rows[0][1]) / 1024, 1)}
    out = run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"])
    if out:
        try:
            cards = [c for k, c in crdt.loads(out).items() if k.startswith("card")]
            first = cards[0]
            name = first.get("Card series") or first.get("Card SKU") or "amd"
            mem = float(first.get("VRAM Total Memory (B)", 0)) / 2**30
            return {"gpu": str(name), "count": len(cards), "memory_gb": round(mem, 1)}
        except (ValueError, IndexError, AttributeError, TypeError):
            pass
    mem_gb = 0.0
    try:
        with open("/proc/meminfo") as fh:
            mem_gb = int(fh.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"gpu": "cpu", "count": os.cpu_count() or 1, "memory_gb": round(mem_gb, 1)}


def instance_layout(hardware: Dict[str, Any], env=None) -> Dict[str, Any]:
    """hardware plus the layout of an engine instance over several nodes, which the job template
    says (sbatch/ranks.sh): its nodes' host names, tp and pp; count becomes the instance's GPUs."""
    env = os.environ if env is None else env
    nodes = [n for n in env.get("OTELA_INSTANCE_NODES", "").split(",") if n][:crdt.MAX_LIST]
    try:
        tp, pp = int(env.get("OTELA_INSTANCE_TP", "1")), int(env.get("OTELA_INSTANCE_PP", "1"))
    except ValueError:
        return hardware
    if len(nodes) < 2 or tp < 1 or pp < 1:
        return hardware
    return dict(hardware, nodes=nodes, tp=tp, pp=pp, count=tp * pp)


# =============================================================================================
# CLI
# =============================================================================================
def add_overlay_args(parser: argparse.ArgumentParser, gossip_default: str = DEFAULT_GOSSIP,
                     listen_default: str = DEFAULT_LISTEN,
                     listen_help: str = "TCP address for the tunnel, /v1/registry and /healthz") -> None:
    """The flags every overlay member takes; each also reads an OTELA_* environment variable
    (crdt.parse_settings). The ingress binds its gossip port on every interface by default
    (INGRESS_GOSSIP): it is what nodes on other hosts bootstrap to."""
    g = parser.add_argument_group("overlay")
    g.add_argument("--key-file", default=None,
                   help="cluster secret written by keygen (env OTELA_KEY_FILE; required, no default: every member "
                        "of one cluster names the same file); never pass secrets in argv")
    g.add_argument("--bootstrap", action="append", default=None,
                   help="HOST:PORT[,…] of any members' --gossip, a file of them, or an http URL returning "
                        "them (env OTELA_BOOTSTRAP); none: start a new overlay")
    g.add_argument("--gossip", default=gossip_default,
                   help=f"UDP (and TCP) gossip address to bind (env OTELA_GOSSIP; default {gossip_default})")
    g.add_argument("--listen", default=listen_default,
                   help=f"{listen_help} (env OTELA_LISTEN; default {listen_default})")
    g.add_argument("--label", action="append", default=None,
                   help="k=v label for this session, repeatable (env OTELA_LABEL, comma-separated)")
    g.add_argument("--site-name", default=None, metavar="NAME",
                   help="the site this member runs at (a machine room, an institution: 1-64 of [0-9A-Za-z_.-]), "
                        "carried as its label site=NAME and shown in /v1/registry and the dashboard (env "
                        "OTELA_SITE_NAME; default none). A job's word only: where an ingress checks grants, "
                        "the site label of the job's grant is the one it believes")
    g.add_argument("--advertise", default=None,
                   help="host peers should use to reach this node when binding 0.0.0.0 (env OTELA_ADVERTISE; "
                        "default: the host bound, or the address this machine's name resolves to when that is 0.0.0.0)")
    g.add_argument("--probe-interval", type=float, default=None,
                   help="failure-detector probe period in seconds (env OTELA_PROBE_INTERVAL; default 0.7): a "
                        "shorter one also shortens the probe timeouts to 40%% of it")
    g.add_argument("--reach", default="auto", choices=("auto", "private", "public"),
                   help="auto: a seed's dial-back tells whether peers can dial this node; private: act as if "
                        "behind a NAT (link to relays at once: a lab's or a firewalled site's); public: never "
                        "ask (env OTELA_REACH; default auto)")


def check_bootstrap(specs: List[str]) -> None:
    """A bootstrap typed on the command line that is neither HOST:PORT, nor a URL, nor an
    existing file is a ConfigError: warning and starting alone would split the cluster in two.
    (What a file or URL holds is read at each start, and a bad line there only warned.)"""
    for spec in specs:
        for item in (s.strip() for s in spec.split(",")):
            if not item or item.startswith(("http://", "https://")) or os.path.isfile(item):
                continue
            try:
                split_addr(item)
            except ValueError:
                raise ConfigError(f"bad --bootstrap {item!r}: expected HOST:PORT (e.g. login1:7946), "
                                  "an http(s) URL or a file listing them") from None


def config_from_args(args: argparse.Namespace, **fixed: Any) -> Config:
    """The Config of one process, built once from its flags (add_overlay_args, add_knob_args, and
    `start`'s --grant-file; each flag else its OTELA_* variable) and what its role fixes (`fixed`:
    a relay's `relay` and `reach`, an ingress's `ingress_keys`). Raises ConfigError."""
    config = tuned(Config(), args)
    ring = load_secrets(args.key_file)
    config.key, config.accept_keys = ring[0], ring[1:]
    config.tls_cert, config.tls_key = find_tunnel_tls(args.key_file)
    config.reach = args.reach
    config.relay = not getattr(args, "no_relay", False)
    if getattr(args, "grant_file", None):
        config.grant, config.grant_key, config.job_tls = load_grant(args.grant_file)
        if time.time() >= config.grant["until"]:
            raise ConfigError(f"grant {args.grant_file} ended at {time.ctime(config.grant['until'])}: "
                              "ask for a new one")
    config.bootstrap = [b for b in args.bootstrap or () if b]
    check_bootstrap(config.bootstrap)
    config.labels.update(_parse_labels(args.label or ()))
    if args.site_name is not None:
        config.labels[crdt.SITE_LABEL] = _site_name(args.site_name, config.labels)
    try:
        split_addr(args.gossip), split_addr(args.listen)
        config.gossip, config.listen = args.gossip, args.listen
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.advertise:
        config.advertise_gossip = f"{args.advertise}:{split_addr(args.gossip)[1]}"
        config.advertise_listen = f"{args.advertise}:{split_addr(args.listen)[1]}"
    if args.probe_interval is not None:
        _set_probe_interval(config, args.probe_interval)
    for name, value in fixed.items():
        setattr(config, name, value)
    return config


def _parse_labels(items: Iterable[str]) -> Dict[str, str]:
    """--label k=v entries (empty ones skipped) as a dict. Raises ConfigError."""
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if item and (not sep or not key):
            raise ConfigError(f"bad label {item!r}: expected k=v")
        if item:
            labels[key.strip()] = value.strip()
    return labels


def _site_name(name: str, labels: Dict[str, str]) -> str:
    """--site-name checked, and consistent with a --label site=… given too. Raises ConfigError."""
    name = name.strip()
    if not crdt.SITE_NAME.match(name):
        raise ConfigError(f"bad --site-name {name!r}: 1-64 characters of [0-9A-Za-z_.-]")
    if labels.get(crdt.SITE_LABEL, name) != name:
        raise ConfigError(f"--site-name {name} and --label {crdt.SITE_LABEL}={labels[crdt.SITE_LABEL]} disagree: "
                          "give one")
    return name


def _set_probe_interval(config: Config, interval: float) -> None:
    """--probe-interval, with the probe's timeouts kept inside it: 0.4 of it each, so the direct
    and the indirect phase (PROBE_ROUND) both end within one round."""
    if interval <= 0:
        raise ConfigError("--probe-interval must be > 0")
    config.probe_interval = interval
    config.probe_timeout = min(config.probe_timeout, interval * 0.4)
    config.indirect_timeout = min(config.indirect_timeout, interval * 0.4)


KEY_FILES = {"cluster": "cluster.key", "ingress": "ingress.key"}   # keygen's secrets, by tier


def _write_secret(path: str, force: bool, lines: Optional[List[str]] = None) -> None:
    """`lines` (default: a new secret, 64 hex chars) in `path`, mode 0600; an existing file is
    replaced only when `force`."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; pass --force to replace it (every holder needs the new key), "
                          "or rotate it without an outage (--rotate, --promote, --retire)") from None
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines or [os.urandom(32).hex()]) + "\n")
    os.chmod(path, 0o600)


ROTATION_STEPS = ("rotate", "promote", "retire")


def rotate(out_dir: str, tier: str, step: str = "rotate") -> List[str]:
    """Rotation without an outage, in three steps, each copied to every holder and followed by a
    rolling restart (a holder seals or signs with the first secret and accepts all):
      rotate   add a new secret last: accepted everywhere, used by nobody yet;
      promote  move the last secret first: used, while the old one is still accepted;
      retire   keep the first secret only.
    Sealing with a secret before every holder accepts it would cut the cluster in two. The
    cluster tier's steps renew the tunnel's TLS pair the same way (rotate_tunnel_tls). Returns
    the files written."""
    path = os.path.join(out_dir, KEY_FILES[tier])
    lines = [line.hex() for line in load_secrets(path, f"{tier} key")]
    if step == "rotate":
        lines.append(os.urandom(32).hex())
    elif step == "promote":
        lines = lines[-1:] + lines[:-1]
    else:
        lines = lines[:1]
    tls = rotate_tunnel_tls(out_dir, step) if tier == "cluster" else []
    _write_secret(path, True, lines)
    return [path] + tls


# The tunnel's TLS pair rotates in the same steps as the secrets. cluster.crt may hold several
# certificates and cluster-tls.key their keys, in the same order: a member shows the first
# certificate (with its key: OpenSSL takes a file's first certificate and first key) and trusts
# every one (each is its own pinned anchor), so a member one step ahead or behind still
# completes the handshake both ways, and after `retire` a stolen old pair is refused everywhere.
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.S)


def _pem_blocks(path: str, label: bytes) -> List[bytes]:
    """The PEM blocks of `path` whose label ends with `label` (CERTIFICATE, PRIVATE KEY), in order."""
    with open(path, "rb") as fh:
        return [m.group(0).rstrip(b"\r\n") + b"\n" for m in _PEM_BLOCK.finditer(fh.read())
                if m.group(1).endswith(label)]


def rotate_tunnel_tls(out_dir: str, step: str) -> List[str]:
    """One rotation step of cluster.crt and cluster-tls.key (see above); [] when there is no
    such pair (keygen found no openssl). Raises ConfigError when they do not pair up."""
    crt, tls_key = os.path.join(out_dir, "cluster.crt"), os.path.join(out_dir, "cluster-tls.key")
    if not (os.path.isfile(crt) and os.path.isfile(tls_key)):
        return []
    certs, keys = _pem_blocks(crt, b"CERTIFICATE"), _pem_blocks(tls_key, b"PRIVATE KEY")
    if not certs or len(certs) != len(keys):
        raise ConfigError(f"{crt} and {tls_key} do not pair up ({len(certs)} certificates, {len(keys)} keys): "
                          "run keygen --force to start again")
    if step == "rotate":
        with tempfile.TemporaryDirectory() as tmp:
            new_crt, new_key = os.path.join(tmp, "new.crt"), os.path.join(tmp, "new.key")
            _new_tunnel_pair(new_crt, new_key)
            certs, keys = certs + _pem_blocks(new_crt, b"CERTIFICATE"), keys + _pem_blocks(new_key, b"PRIVATE KEY")
    elif step == "promote":
        certs, keys = certs[-1:] + certs[:-1], keys[-1:] + keys[:-1]
    else:
        certs, keys = certs[:1], keys[:1]
    _write_private(tls_key, b"".join(keys))
    with open(crt, "wb") as fh:
        fh.write(b"".join(certs))
    return [crt, tls_key]


def job_certificate(key_file: str, until: float, now: float) -> Tuple[bytes, bytes]:
    """A tunnel certificate of one job's own and its key (PEM), signed by the cluster's TLS pair
    beside `key_file` (the one in use): every member's trust in the cluster's certificate takes
    it, and its fingerprint in the job's grant (`certificate_fingerprint`) tells it from anything
    another holder of the cluster's pair could show. Raises ConfigError without the pair or openssl."""
    crt, tls_key = find_tunnel_tls(key_file)
    if not crt:
        raise ConfigError(f"no cluster certificate beside {key_file} (keygen where openssl is installed)")
    days = str(max(1, math.ceil((until - now) / 86400.0) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        ca_crt, ca_key = os.path.join(tmp, "ca.crt"), os.path.join(tmp, "ca.key")
        _write_private(ca_crt, _pem_blocks(crt, b"CERTIFICATE")[0])
        _write_private(ca_key, _pem_blocks(tls_key, b"PRIVATE KEY")[0])
        job_key, csr, job_crt = (os.path.join(tmp, n) for n in ("job.key", "job.csr", "job.crt"))
        try:
            subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                            "-nodes", "-keyout", job_key, "-out", csr, "-subj", "/CN=otela-job"],   # (not the
                                                                # issuer's name: it would read as self-signed)
                           check=True, capture_output=True, timeout=60)
            subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-set_serial",
                            str(secrets.randbits(63)), "-days", days, "-out", job_crt],
                           check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ConfigError(f"cannot make the job's tunnel certificate with openssl: {exc}") from None
        with open(job_crt, "rb") as fh, open(job_key, "rb") as kh:
            return fh.read(), kh.read()


def certificate_fingerprint(cert: Union[bytes, str]) -> str:
    """The sha256 of a certificate (PEM, or DER bytes), in hex: what a grant pins."""
    der = ssl.PEM_cert_to_DER_cert(cert if isinstance(cert, str) else cert.decode()) \
        if (cert if isinstance(cert, str) else cert[:5].decode("latin-1")).startswith("-----") else cert
    return hashlib.sha256(der).hexdigest()


def _new_tunnel_pair(crt: str, tls_key: str) -> None:
    """A self-signed certificate for the tunnel and its key (openssl; raises OSError or
    SubprocessError without it)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", tls_key, "-out", crt, "-days", "3650", "-subj", "/CN=otela-cluster"],
                   check=True, capture_output=True, timeout=60)
    os.chmod(tls_key, 0o600)


def _write_private(path: str, data: bytes) -> None:
    """`data` into `path`, mode 0600 from its first byte (written beside it, then renamed over it)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".otela-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def keygen(out_dir: str, force: bool = False, ingress_only: bool = False) -> List[str]:
    """Write DIR/cluster.key (for every member), DIR/ingress.key (for ingress hosts only: the
    authority over API keys and usage, see crdt.Authority), 64 hex chars each, mode 0600, and,
    when openssl is there, a cluster TLS certificate for the data tunnel (DIR/cluster.crt,
    DIR/cluster-tls.key). `ingress_only`: just ingress.key, for a cluster that has its key."""
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    ingress = os.path.join(out_dir, KEY_FILES["ingress"])
    if ingress_only:
        _write_secret(ingress, force)
        return [ingress]
    path = os.path.join(out_dir, KEY_FILES["cluster"])
    _write_secret(path, force)
    written = [path]
    if force or not os.path.exists(ingress):
        _write_secret(ingress, force)
        written.append(ingress)
    crt, tls_key = os.path.join(out_dir, "cluster.crt"), os.path.join(out_dir, "cluster-tls.key")
    try:
        _new_tunnel_pair(crt, tls_key)
        written += [crt, tls_key]
    except (OSError, subprocess.SubprocessError):
        log.warning("openssl not available: no cluster certificate written (only needed for the TLS tunnel)")
    return written


def _stop_on_signals() -> asyncio.Event:
    """Set by SIGTERM or SIGINT: a long-running command's cue to stop cleanly."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    return stop


async def _until(coro, stop: asyncio.Event):
    """Run coro until it finishes or `stop` is set: (result, stopped)."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        return task.result(), False
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None, True


EXIT_ENGINE_FAILED = 3


async def run_worker(args: argparse.Namespace, config: Config) -> int:
    """`start`: supervise the engine and serve it as a session until SIGTERM or engine failure."""
    supervisor = EngineSupervisor(args.process, args.engine_url, config)
    node = Node(config, role="worker", hardware=instance_layout(detect_hardware()), engine_url=supervisor.url)
    stop = _stop_on_signals()
    publisher: Optional[asyncio.Future] = None
    follower: Optional[asyncio.Future] = None
    published: Dict[str, Any] = {}                  # the engine's models as our record has them
    changed = asyncio.Event()
    node.tunnel.on_adapters = changed.set
    _trace_tunnel(node, args.otlp_endpoint)
    try:
        # Bind first: a port in use must fail before an engine (on a GPU node, a vLLM loading
        # weights) is started for nothing.
        await node.start(serve_http=True, state=crdt.JOIN)
        await supervisor.spawn()
        while True:
            try:
                _, stopped = await _until(supervisor.wait_ready(), stop)
                if not stopped:
                    published.clear()
                    published.update(await supervisor.catalog())
                    models = published["models"]
                    publish_catalog(node, published, state=crdt.SERVING, **supervisor.scheduling)
                    if publisher is None:
                        publisher = asyncio.ensure_future(publish_engine_view(node))
                        follower = asyncio.ensure_future(follow_engine_models(node, supervisor, published, changed))
                    if not node.reach_pending:
                        log.info("session %s SERVING %s", node.session_id, ", ".join(models))
                    reason, stopped = await _until(supervisor.watch(), stop)
            except (EngineExited, EngineError) as exc:
                reason, stopped = str(exc), False
            if stopped:
                return await _shutdown(node, supervisor, config)
            log.error("session %s DOWN: %s", node.session_id, reason)
            node.set_state(crdt.DOWN)               # no new requests, at once, everywhere
            await supervisor.stop()
            if not args.restart:
                await asyncio.sleep(config.leave_linger)
                await node.stop(leave=False)
                return EXIT_ENGINE_FAILED
            await supervisor.spawn()
            node.rejoin(state=crdt.JOIN, models=[], adapters={})
            log.info("engine restarted; new session %s", node.session_id)
    finally:
        await _worker_stopped(node, supervisor, (publisher, follower))


def _trace_tunnel(node: Node, endpoint: Optional[str]) -> None:
    """With --otlp-endpoint, the tunnel exports each traced request's span (node_spans)."""
    if not endpoint:
        return
    try:
        node.tunnel.tracer = SpanExporter(endpoint, node_spans, "otela-node")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


async def _worker_stopped(node: Node, supervisor: EngineSupervisor,
                          tasks: Tuple[Optional[asyncio.Future], ...]) -> None:
    """A worker's end, however it came: its tasks cancelled, its spans sent, its engine and node stopped."""
    for task in tasks:
        if task is not None:
            task.cancel()
    if node.tunnel.tracer is not None:
        node.tunnel.tracer.stop()
    await supervisor.stop()
    await node.stop(leave=False)


async def publish_engine_view(node: Node, every: float = PUBLISH_VIEW_S) -> None:
    """While SERVING, what the ingresses route by goes in our record, at most every `every`
    seconds and only when it changed: `prefixes` (PrefixSummary), `load` (requests in flight
    through this node from every ingress; a change of at least LOAD_STEP or a quarter) and
    `speed` (EngineSpeed). A record
    over the registry's size bound (many labels) publishes fewer prefixes, or none."""
    published_load = 0   # (an idle worker's record never changes for this)
    while True:
        await asyncio.sleep(every)
        overlay, prefixes = node.overlay, node.prefixes
        if overlay is None or overlay.record.get("state") != crdt.SERVING or node.draining:
            continue
        load = node.inflight
        fields: Dict[str, Any] = {}
        if abs(load - published_load) >= max(LOAD_STEP, published_load // 4) or load == 0 < published_load:
            fields["load"] = published_load = load
        if prefixes is not None and prefixes.changed:
            fields["prefixes"], fields["prefix_ends"] = prefixes.published()
        speed = node.speed.changed() if node.speed is not None else None
        if speed is not None:
            fields["speed"] = speed
        while fields:
            try:
                node.update(**fields)
                break
            except crdt.RecordError:
                text = fields.get("prefixes", "")
                if not text:
                    break
                kept = list(decode_prefixes(text))[:len(text) // 24]
                fields["prefixes"] = encode_prefixes(kept)
                fields["prefix_ends"] = min(fields["prefix_ends"], len(kept))


async def _shutdown(node: Node, supervisor: EngineSupervisor, config: Config) -> int:
    """SIGTERM: DOWN at once, drain in-flight requests, stop the engine, LEFT."""
    log.info("stopping: session %s DOWN, draining %d in-flight requests", node.session_id, node.inflight)
    node.draining = True
    node.set_state(crdt.DOWN)
    deadline = time.monotonic() + config.drain_timeout
    while node.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if node.inflight:
        log.warning("drain timeout: %d requests still in flight", node.inflight)
    await supervisor.stop()
    await node.stop(leave=True)
    log.info("session %s LEFT", node.session_id)
    return 0


# The variables of flags whose names or separators are not crdt.parse_settings' own: --bootstrap's
# OTELA_BOOTSTRAP is one value (its commas are read with it, as the flag's are)
SETTING_NAMES = {"--bootstrap": ("BOOTSTRAP", None), "--force": None}   # keygen --force: the flag only


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="otela_node.py", description="otela node: wrap an LLM engine as a "
                                "discoverable, health-checked session of the overlay.")
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("keygen", help="write the cluster secret (and TLS certificate) into DIR")
    k.add_argument("--out", required=True,
                   help="directory for cluster.key (mode 0600) and the tunnel certificate (env OTELA_OUT; "
                        "required, no default)")
    k.add_argument("--force", action="store_true", help="replace an existing key")
    k.add_argument("--ingress-only", action="store_true",
                   help="write only DIR/ingress.key (the ingress hosts' secret) for a cluster that has its cluster.key")
    k.add_argument("--rotate", choices=sorted(KEY_FILES), default=None,
                   help="rotation, step 1 of 3: add a new secret to DIR/<tier>.key, accepted but not used yet; "
                        "after each step copy the file to every holder and restart them one at a time")
    k.add_argument("--promote", choices=sorted(KEY_FILES), default=None,
                   help="rotation, step 2: the new secret seals or signs, the old one is still accepted")
    k.add_argument("--retire", choices=sorted(KEY_FILES), default=None,
                   help="rotation, step 3: keep only the secret in use")
    s = sub.add_parser("start", help="start an engine and serve it as a session")
    add_overlay_args(s)
    s.add_argument("--process", required=True,
                   help='engine command line, e.g. "vllm serve M --port 8000" ({port}: a free port) '
                        "(env OTELA_PROCESS)")
    s.add_argument("--grant-file", default=None,
                   help="this job's grant (`otela_ingress.py grant`, or the placer, writes it; mode 600): the "
                        "models and labels ingresses route to it for (env OTELA_GRANT_FILE; without one, "
                        "ingresses holding the ingress secret route nothing here)")
    s.add_argument("--engine-url", default=None,
                   help="where the engine listens (env OTELA_ENGINE_URL; default from --port in the command)")
    s.add_argument("--restart", action="store_true",
                   help="restart a failed engine as a new session instead of exiting (env OTELA_RESTART)")
    s.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="send the spans of each request the ingress traced (the tunnel's, the engine's time to "
                        "first byte) to this OTLP/HTTP collector (JSON, POST URL/v1/traces), batched from a "
                        "thread; a collector down or slow drops spans, never delays a request "
                        "(env OTELA_OTLP_ENDPOINT; default: none)")
    s.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING (env OTELA_LOG_LEVEL; default INFO)")
    add_knob_args(s, skip=("probe_interval",))
    r = sub.add_parser("relay", help="a standalone relay (and seed) for members behind NATs, e.g. on a login node")
    add_overlay_args(r, gossip_default=INGRESS_GOSSIP)
    add_knob_args(r, skip=("probe_interval",) + ENGINE_KNOBS)
    r.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING (env OTELA_LOG_LEVEL; default INFO)")
    return p


async def run_relay(config: Config) -> int:
    """`relay`: a dialable member that only relays (and seeds), until SIGTERM."""
    node = Node(config, role="relay")
    stop = _stop_on_signals()
    await node.start(serve_http=True, state=crdt.SERVING)
    log.info("relay %s on gossip %s", node.session_id, node.overlay.addr)
    try:
        await stop.wait()
    finally:
        await node.stop(leave=True)
    return 0


def _keygen_command(args: argparse.Namespace) -> List[str]:
    """`keygen`: new secrets, or one rotation step (--rotate, --promote, --retire); the files
    written."""
    steps = [(step, getattr(args, step)) for step in ROTATION_STEPS if getattr(args, step)]
    if len(steps) > 1:
        raise ConfigError("keygen: one of --rotate, --promote, --retire at a time")
    if not steps:
        return keygen(args.out, args.force, args.ingress_only)
    try:
        return rotate(args.out, steps[0][1], steps[0][0])
    except (OSError, subprocess.SubprocessError) as exc:   # openssl missing or failing
        raise ConfigError(f"keygen --{steps[0][0]}: cannot make a tunnel certificate: {exc}") from None


def main(argv=None) -> int:
    try:   # every flag also reads its OTELA_<FLAG> (the label's OTELA_LABEL, comma-separated)
        args = crdt.parse_settings(build_parser(), argv, SETTING_NAMES, os.environ)
    except ValueError as exc:
        print(f"otela_node.py: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(args, "log_level", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s otela_node %(levelname)s %(message)s")
    try:
        if args.command == "keygen":
            for path in _keygen_command(args):
                print(path)
            return 0
        if args.command == "relay":   # a relay is dialable and relays, whatever it is told
            config = config_from_args(args, relay=True, reach="public")
            install_event_loop()
            return asyncio.run(run_relay(config))
        config = config_from_args(args)
        install_event_loop()
        return asyncio.run(run_worker(args, config))
    except (ConfigError, OSError) as exc:          # OSError: e.g. address already in use
        print(f"otela_node.py: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
