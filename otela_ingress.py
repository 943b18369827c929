"""otela_ingress.py: the OpenAI-compatible front door of the otela overlay.

Role: a full overlay member (it runs an `otela_node.Node` with role "ingress", so it holds the
session registry locally) that also serves the OpenAI HTTP API to users. A request comes in
over HTTP/1.1, is authenticated against a hashed key, is routed by a pluggable policy to one
healthy session serving its model, and is proxied there over a kept-alive connection (the
node's tunnel: mutual TLS, or the cluster's tunnel header). The answer goes back to the client
as it arrives: whole for plain requests, byte for byte for server-sent event streams. Every
finished request becomes a row of the usage ledger.

Every route is relayed the same way: any method on any path under /v1/ that is not the ingress's
own (and the engine routes outside /v1/ a site enables, --native-route), with any body (JSON, a
multipart upload, a file, none). Its model is the JSON's `model`, a form's field `model`, the
x-otela-model header, the query's or a path segment; a request naming none goes to any session
serving one of the key's models. An answer of type text/event-stream is relayed event by event
whatever the route (the Responses API's, SGLang's). A model whose every attempt fails before the
first byte hands the request to the next of its fallbacks (an alias's models, --fallback).

Theory of operation
-------------------
The sections, in file order, and what each holds:

    config               every limit and timing default, with the reason for the number; Limits
    errors               HTTPError, the one way a request is refused (its body and reason
                         phrase: otela_node's error_body and REASONS, one table for both roles)
    request validation   paths in normal form (normal_path), and the types of what the ingress reads
    keys, usage ledger   Key (hashed, with its rate bucket), Ledger (a journal file, then SQLite)
    engine numbers       an answer's token counts bounded by what the ingress saw (prompt_bound,
                         completion_cap; _Exchange.bound_usage books them)
    cluster-wide keys    ClusterKeys: key records and usage counters as entries of the overlay's
                         map, so rate limits and budgets count the whole cluster's use
    limits               ClusterFlow: requests and tokens per sliding minute and requests in flight,
                         per key, user and model, summed over every ingress (lim: and flow: entries);
                         a key's and a model's sites (data residency: Ingress.candidates)
    grants               Grants: what each session may serve, as the login node signed it
    routing              Candidate, the policies (TTFTPolicy, the default: PrefixIndex,
                         PublishedPrefixes, EngineKind, SpeedFit; the path's measured round trip,
                         so a request stays at its ingress's site), PassiveHealth (sessions out of
                         rotation)
    fair queue           FairQueue, Waiting: requests held at the ingress while the engines for
                         them are saturated, sent in weighted fair order by tenant and class
    metrics              Metrics: /metrics in Prometheus' text format
    trace context        traceparent in and out, Server-Timing (spans: otela_node.SpanExporter)
    streams              StreamWatch: SSE events passed through, their usage read (and stripped)
    upstream             UpstreamPool (kept-alive connections per session; writes requests),
                         Upstream (reads an answer with otela_node's codec), _Relay (a stream)
    client connections   _ClientConn (the connection's one parser and writer of answers) and
                         _Client (its protocol, and the loop that serves its requests in turn)
    the exchange         _Exchange: one proxied request, its lifecycle as a table, its
                         attempts, its answer, and finish(), the one place its end is booked
    LoRA adapters        AdapterRoutes: loads and unloads through the overlay, loads on demand
    the ingress          Ingress: the shared state, candidates from the registry, auth, the
                         routes; beside it, given what they use: EvictionDoubts, AdminAPI,
                         MetricsPage (/metrics) and Views (the GET endpoints). Ingress alone
                         holds the node: the parts above are given at construction what they
                         read or write of it (the registry's reads, the session id, publish, adopt)
    dashboard, CLI

How a proxied request flows through them:

    1. _Client.data_received -> _Client.serve: the connection's parser reads the head. It is
       otela_node's sans-IO codec, with h11 inside it for a request only h11 judges (HTTP/1.0,
       Expect, odd bytes): one parser per connection, one kind of head (a MessageHead). A read
       holding exactly one plain proxied request is read from its own bytes (whole_request).
    2. Ingress.proxy: the key, its rate and budget, the JSON, the model, the candidates (cached
       per model and allowlist), its limits' windows (ClusterFlow.admit, only for a request under
       a limit); the policy picks a session and the request goes out on a
       kept-alive connection (UpstreamPool.send_request) before anything else is booked; an
       _Exchange is made. When the session picked is full (FairQueue.full), or requests wait
       already, the request waits instead (Ingress._wait) until Ingress.dispatch_waiting sends it
       (after a finish, or on a short timer) in fair order. Any other head goes to Ingress.route: its body is read piece by piece
       by each data_received (_Client.read_body, under its deadline and size limit), then it is
       proxied, or the admin API or a GET endpoint answers it.
    3. The upstream connection's data_received (_UpstreamProtocol) calls the exchange back: the
       answer's head, then its plain body whole (_Exchange._read_answer), or, for a stream, a
       _Relay that writes each read to the client as it comes. A session that fails to answer,
       or refuses with a 5xx, hands the request to the next one (_Exchange.retry, up to
       MAX_ATTEMPTS); a stream whose session fails after its first bytes is continued on
       another from the text that went out (_Exchange.resume), or ends with an error event.
       A session that goes silent without a reset (its site cut off) fails the same way once
       this ingress no longer routes to it (Ingress._cut_unreachable, each SWEEP_INTERVAL_S).
    4. _Exchange.finish(outcome): the ledger row is journalled before the client's last bytes
       go out, the in-flight count, the policy, passive health and metrics right after them.
    5. _Client.serve_next: on to the next request the client sent meanwhile.

One engine: the protocol callbacks. No task or future sits between the steps on the common
path: at low load the ingress's share of a request's latency is mostly the CPU's cold caches,
and each event-loop pass costs more of them. What must wait on something else (a new upstream
connection, a usage query in an executor) is a future whose completion calls one method back;
no task owns a connection or loops over its events. Backpressure is the transports' own
pause/resume callbacks, in both directions.

One request, one state machine: each proxied request's state moves down EXCHANGE_LIFECYCLE
(received -> routed -> sent -> head -> [body] -> done, or stream -> done, or -> retried ->
routed again, or -> failed), and its end is booked once, in _Exchange.finish (OUTCOMES says
what each way of ending books).

Data flow:
    client --codec/h11--> auth (keys in memory) --> candidates --> policy.pick
        --> upstream pool --HTTP/1.1--> node tunnel --> engine
        <-- response relayed (retried on another session if nothing was sent yet)
        --> usage journal (a copy into a mapped file before the client sees the last byte, so a kill -9
            never loses a completed request) --> writer thread --> SQLite (WAL), in batches.

Several ingresses are one service: key records and per-(key, day) and per-(key, month) usage counters are
entries of the overlay's map (crdt.py), so a key made or revoked at one ingress holds at all,
and rate limits and token budgets count the whole cluster's use (see ClusterKeys). Each
ingress keeps its own SQLite copy of them, and its own request rows.

Settings: a setting is its flag, else the OTELA_* variable named after it, else its default
(crdt.parse_settings); the limits below are flags too (LIMITS: --max-connections,
OTELA_MAX_CONNECTIONS, ...).

Headers: requests take `Authorization: Bearer <key>`, `X-Otela-Priority: interactive|standard|batch`
(the class in the fair queue, as the key allows; see request_class), `X-Request-Id` (kept when sane, else
made), `traceparent`/`tracestate` (W3C; continued, or a trace started: the engine gets them with
X-Request-Id and User-Agent), `X-Otela-Model` (the model of a body that names none), from an
admin key `X-Otela-Session: <session id>` (the request goes to that session alone) and, to opt
out of the per-request usage row (the request is still counted per day), `X-Otela-No-Track: 1`;
answers carry `Server-Timing` (the ingress's time, the engine's to its first byte); responses carry `X-Otela-Session: <session id>` naming the session that
served them, `X-Request-Id`, and `X-Otela-Model` when another model than the one named answered
(an alias's, a fallback).

TLS (--tls-cert, --tls-key): the listener accepts TCP as for plain HTTP, so a connection is counted
and under the head's deadline from accept; start_tls then takes it over (_Client._secured).

What this file must never do:
  1. Block the event loop: no SQLite, no DNS, no file I/O on the request path but the one
     append to the usage journal (keys are read by the ledger thread and swapped in; usage
     queries run in an executor).
  2. Re-serialise what it relays: the request body is forwarded verbatim (one exception: a
     stream gets `stream_options.include_usage` so its tokens can be counted, and the
     usage-only chunk the client did not ask for is removed); SSE chunks are relayed as bytes.
  3. Let one client hurt another: every connection has its own buffers, limits and deadlines;
     a slow reader only slows its own stream, and a client that leaves frees the engine
     working for it.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import calendar
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import importlib
import itertools
import math
import mmap
import os
import random
import re
import secrets
import sqlite3
import ssl
import sys
import threading
import time
from typing import Any, Callable, Container, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qs, parse_qsl, quote, unquote, unquote_to_bytes, urlencode

try:
    import h11
except ModuleNotFoundError:
    import otela_node  # noqa: F401  (exits with the one line that says how to get h11)
    raise

import crdt
import otela_node  # the overlay (joins the cluster, holds the registry)

# =============================================================================================
# Config: every limit and timing default, with the reason for the number
# =============================================================================================
MAX_HEADER_BYTES = 16 * 1024         # request line + headers; real clients send < 2 KiB, and
                                     # a bigger budget only helps slowloris-style abuse
MAX_BODY_BYTES = 16 * 1024 * 1024    # a 128k-token prompt is ~0.5 MB of text; embedding
                                     # batches are larger; 16 MiB leaves room for both
MAX_CONNECTIONS = 4096               # below the usual 8192 fd soft limit with upstreams counted;
                                     # the one over it is answered 503, not reset
ADDRESS_SHARE = 0.25                 # one client address holds at most this share of them, so
                                     # filling the ingress takes four hosts, not one script ...
ADDRESS_FLOOR = 64                   # ... but never fewer than 64: one app server's pool (the
                                     # benchmark keeps 64) behind one address is normal
MAX_HEADLESS = 1024                  # connections with no complete head yet, all addresses
                                     # together (nginx's way against slowloris from many hosts):
                                     # a real client's head follows its handshake within an RTT,
                                     # so 1,024 mid-head at once is an attack; a newcomer over it
                                     # cuts the oldest, and a legitimate client always gets in
HEADLESS_SCAN = 64                   # the oldest this many are looked at for one of an address
                                     # over its share; none such: the oldest of all is cut
READ_CHUNK = 256 * 1024              # one read per SSE burst or request body in most cases
IDLE_TIMEOUT_S = 120.0               # a keep-alive client silent this long is closed
HEAD_TIMEOUT_S = 10.0                # a request head (< 2 KiB, one packet from real clients) must
                                     # be whole this long after its first byte, or after the
                                     # connection opened; absolute, so a client dribbling a byte
                                     # at a time (slowloris) cannot hold its connection longer
REQUEST_TIMEOUT_S = 30.0             # a request's body must be whole this long after its head,
                                     # however it trickles in (16 MiB needs 4.5 Mbit/s)
UPSTREAM_CONNECT_TIMEOUT_S = 3.0     # loopback/LAN connects take < 1 ms; 3 s means dead
UPSTREAM_IDLE_TIMEOUT_S = 600.0      # prefill of a long prompt on a busy engine can take
                                     # minutes before the first byte; longer means hung
SWEEP_INTERVAL_S = 1.0               # granularity of the timeouts and deadlines above
GONE_SILENT_S = 1.0                  # an answer awaited this long from a session no longer routed to
                                     # (suspected, down: a site cut off) is given up and retried
MAX_ATTEMPTS = 3                     # sessions tried per request: a second session rules out a
                                     # poison request (two 5xx), a third survives one dying meanwhile
RETRY_STATUSES = frozenset((500, 502, 503))  # engine-side failures worth another session
POOL_IDLE_PER_PROVIDER = 128         # kept-alive upstream connections per session (> the 64
                                     # concurrent clients of the benchmark)
SICK_AFTER_FAILURES = 2              # consecutive failures before a session leaves rotation:
                                     # one failure may be bad luck, two in a row is a pattern
SICK_BACKOFF_S = 1.0                 # first time out of rotation, doubled per relapse ...
SICK_BACKOFF_MAX_S = 60.0            # ... up to a minute, then probed back in by one request
CANDIDATE_TTL_S = 1.0                # candidate lists are rebuilt on registry change, and at
                                     # least this often in case a change went unnoticed
STATS_WINDOW_S = 300.0               # /v1/usage/stats looks at the last five minutes ...
STATS_MAX_SAMPLES = 20000            # ... of at most this many requests per model
LEDGER_FLUSH_S = 0.25                # rows reach SQLite within 250 ms, one commit per batch
                                     # (the journal makes each durable at once); the writer
                                     # wakes on this clock, never per request, so a quiet
                                     # ingress is not woken twice per request
LEDGER_JOURNAL_MAX = 8 * 1024 * 1024  # journal file size before starting the next one
KEYS_RELOAD_S = 1.0                  # a key created or revoked by the CLI takes effect within 1 s;
                                     # an unknown token makes its request wait for a read of SQLite at
                                     # once (one per token a second at most), so a key the CLI just made
                                     # works on its first request
KEY_RELOAD_WAITERS = 1024            # requests waiting for such a read at most; more are refused at once
STREAM_DRAIN_ABOVE = 64 * 1024      # bytes buffered for a stream's client before waiting for it
SSE_CARRY_MAX = 64 * 1024            # bytes of an unfinished SSE event held back at most
DRAIN_S = 10.0                       # on SIGTERM, requests in flight get this long to finish
LINGER_S = 2.0                       # after a last answer, what a client still sends (a body we
                                     # refused to read) is read and dropped this long at most:
                                     # closing with unread bytes sends a TCP reset, which can
                                     # destroy the answer before the client reads it
RETRY_AFTER_S = 5                    # Retry-After on 503: about one gossip round plus a probe
WARMUP_MAX_S = 10.0                  # a (re)started ingress that has heard from no peer yet says
                                     # 503 (Retry-After: 1), not 404, for a model it does not know:
                                     # nodes redial a seed every ~3 s and the first answer carries
                                     # a node's whole view; 10 s without one means it is alone
# The fair queue (FairQueue): requests wait at the ingress, not at saturated engines
QUEUE_WAIT_S = 0.05                  # a session is full when the prefill this ingress queued at its
                                     # engine would take longer than this (its learned speed): what a
                                     # newcomer of another tenant waits there behind a flood (the rest
                                     # it waits here, in fair order), against the engine's batches:
                                     # measured (bench_tenants --quick, 512-token prompts), 0.02 s left
                                     # the engines a third as busy as they could be, 0.2 s made a
                                     # newcomer wait behind the flood's seconds of prefill at the engine
QUEUE_PRIORITY_WAIT_S = 0.05         # ... the bound where the engine schedules by priority: there a
                                     # newcomer overtakes the queued work (engine_priority), so it may
                                     # be looser, but measured (bench_tenants --quick --drain 60,
                                     # queue_prio) 0.1 s gave the flood 0.63 of the capacity left (0.51
                                     # at 0.05) and B's TTFT p99 6.6x unloaded (3.1x): the engine's
                                     # running batch fills with the flood's streams, each step carries
                                     # a full prefill chunk, and priority does not preempt for a slot;
                                     # 0.15-0.5 worse still. Kept at QUEUE_WAIT_S until an engine
                                     # preempts for priority
QUEUE_SESSION_DEPTH = 256            # ... or when this ingress has this many requests in flight at it:
                                     # vLLM runs at most 256 at once (max_num_seqs); more wait in the
                                     # engine's own queue, first come first served, not in fair order
QUEUE_SESSION_SLOTS = 256            # ... or, while two tenants or more hold requests here, this many
                                     # (its running slots): past them only a tenant below its share
                                     # of the slots goes (FairQueue.overtakes). Off (as the depth) by
                                     # default: a count that suits one answer length starves another
                                     # (a slot frees when an answer ends; bench_tenants' figures)
QUEUE_GUARD_WAIT_S = float("inf")   # ... the prefill bound for a tenant with more requests waiting here
                                     # while another, with none waiting, has requests in flight from
                                     # here (FairQueue.guarded): below one prompt's prefill its prompts
                                     # go one at a time, so the other's prompt shares its steps with
                                     # one prefill of the flood, not QUEUE_WAIT_S of them. Off (no
                                     # bound at or above QUEUE_WAIT_S guards) by default: not yet
                                     # better at every answer length (the fair queue's comment)
QUEUE_MAX = 10000                    # requests waiting at most, all keys together (each holds its
                                     # body: the bytes bound below is the one that binds on memory).
                                     # Measured (tests/bench_queue_memory.py: 10,000 waiting from
                                     # 1,000 keys, tracemalloc, the client connections not counted):
                                     # 2.0 KB a request plus 2.2 x its body's bytes (the body, its
                                     # parsed JSON, the prompt's block chain): 80 MiB for chats of
                                     # 64-1024 tokens, 31 MiB at 64, 130 MiB at 1024
QUEUE_MAX_PER_KEY = 1000             # ... of one key: a flood fills its own share, not the queue
QUEUE_MAX_BYTES = 256 * 1024 * 1024  # request bytes waiting at most (a tenth of a small login node):
                                     # with the above, the queue holds at most 10,000 x 2 KB + 2.2 x
                                     # 256 MiB, about 585 MiB of ASCII chats; a body whose text mixes
                                     # ASCII with one astral character parses to 4 bytes a character,
                                     # up to ~5 x its bytes (1.3 GiB at this bound)
QUEUE_KEY_BYTES = 32 * 1024 * 1024   # ... of one key (two 16 MiB bodies, thousands of chats)
QUEUE_TIMEOUT_S = 60.0               # a request waits this long at most, then gets 429: a client
                                     # (the openai SDK: 600 s) is still there, and told to come back
QUEUE_AGE_S = 10.0                   # a waiting request rises one class per this many seconds
                                     # (batch is served as interactive after 20 s): never starved
QUEUE_RETRY_AFTER_S = 2              # Retry-After of a 429 from the queue: about the time a request
                                     # of a saturated engine takes to free its slot
QUEUE_LOOKAHEAD = 8                  # waiting requests of one model passed over in a dispatch because
                                     # the session each picked is full while another of the model's
                                     # is not: the next in line may pick that one (a conversation's
                                     # own engine full stops only its turns); past this many, the
                                     # model waits for the next dispatch (each costs a policy pick)
QUEUE_TICK_S = 0.02                  # while requests wait, dispatch is tried this often besides at each
                                     # finish (an engine's first byte lowers its queued work too)
PRIORITY_RANK = {name: rank for rank, name in enumerate(crdt.PRIORITY_CLASSES)}   # 0: served first
PRIORITY_HEADER = b"x-otela-priority"   # request: the class it asks for (the key must allow it)
# The engine's own `priority` (vLLM's: an integer, lower is scheduled sooner, 0 the default) of
# each class (its lowest: a tenant's standing is added), set in the body sent to a session whose
# engine runs priority scheduling; and the class a body's `priority` asks for: below 0
# interactive, 0 standard, above 0 batch.
ENGINE_PRIORITY = (-10, 0, 10)
ENGINE_PRIORITY_SPREAD = 10   # numbers per class: its base plus a tenant's standing (FairQueue.engine_priority)
ENGINE_PRIORITY_FIRST = 2     # a tenant with fewer requests than this at priority engines (its
                              # number at most its class's base + 1) does not wait here: the engine
                              # puts it before the flood's queued work (FairQueue.overtakes)
DEFAULT_DB = "otela.sqlite"
DEFAULT_LISTEN = "127.0.0.1:8080"    # the API's port in the README and `make run`; loopback until
                                     # told otherwise (a node's tunnel is on 7700)
NO_TRACK_HEADER = b"x-otela-no-track"  # "1" opts the request out of per-request rows
SESSION_HEADER = b"x-otela-session"    # response header: which session served the request
KEY_PREFIX = "sk-otela-"
PROXIED_PATHS = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"))
MODEL_PREFIX = b"/v1/models/"
ADMIN_PREFIX = b"/v1/admin/"
REQUEST_ID_HEADER = b"x-request-id"   # taken from the client when sane, else made; on every answer
_REQUEST_ID = re.compile(rb"[0-9A-Za-z._:/+=-]{1,128}")   # JSON- and log-safe, as OpenAI's req_... ids
_REQUEST_ID_PREFIX = secrets.token_hex(8).encode()   # 64 random bits per process
_request_numbers = itertools.count(1)
STREAMABLE_PATHS = frozenset((b"/v1/chat/completions", b"/v1/completions"))
_HEADER_SAFE = re.compile(r"[0-9A-Za-z._:/+=@-]{1,256}")   # a model name that may go in a header as it is
_MODEL_LINE = re.compile(rb"x-otela-model: [^\r]*\r\n")
MODEL_HEADER = b"x-otela-model"      # request: the model of a body that names none (a binary upload);
                                     # response: the model that answered, when a fallback did
ANY_MODEL = "*"                      # the model a request that names none is booked under
# A path whose %-encoding hides a separator ("/v1/files%2F..%2Fx"): the engine (or a proxy in front of
# it) may decode it into another route than the one the ingress checked; refused on relayed routes
_ENCODED_SEPARATOR = re.compile(rb"%(?:2[fF]|5[cC])")
# The limits above a deployment may have to change: each is also a flag of `serve` and an OTELA_*
# variable named after it (MAX_CONNECTIONS: --max-connections, OTELA_MAX_CONNECTIONS), read as
# every setting is (crdt.parse_settings), into the one Limits an ingress is built with.
LIMITS = {name: globals()[name] for name in (   # name -> its default
    "MAX_HEADER_BYTES", "MAX_BODY_BYTES", "MAX_CONNECTIONS", "ADDRESS_SHARE", "ADDRESS_FLOOR", "MAX_HEADLESS",
    "IDLE_TIMEOUT_S", "HEAD_TIMEOUT_S", "REQUEST_TIMEOUT_S", "UPSTREAM_CONNECT_TIMEOUT_S", "UPSTREAM_IDLE_TIMEOUT_S",
    "MAX_ATTEMPTS", "POOL_IDLE_PER_PROVIDER", "SICK_AFTER_FAILURES", "SICK_BACKOFF_S", "SICK_BACKOFF_MAX_S",
    "DRAIN_S", "LINGER_S", "WARMUP_MAX_S", "QUEUE_WAIT_S", "QUEUE_PRIORITY_WAIT_S", "QUEUE_SESSION_DEPTH",
    "QUEUE_SESSION_SLOTS", "QUEUE_GUARD_WAIT_S", "QUEUE_MAX", "QUEUE_MAX_PER_KEY", "QUEUE_MAX_BYTES", "QUEUE_KEY_BYTES", "QUEUE_TIMEOUT_S", "QUEUE_AGE_S")}


LIMIT_HELP = {   # each limit's unit and the short reason for its default (the long one is beside it)
    "MAX_HEADER_BYTES": "bytes of a request line and headers at most (real clients send < 2 KiB)",
    "MAX_BODY_BYTES": "bytes of a request body at most (a 128k-token prompt is ~0.5 MB; embedding batches more)",
    "MAX_CONNECTIONS": "client connections at most; the one over gets 503 (below the usual 8192 descriptors)",
    "ADDRESS_SHARE": "share (0-1) of the connections one client address may hold (filling it takes 4 hosts)",
    "ADDRESS_FLOOR": "connections one address may always hold (an app server's pool behind one address)",
    "MAX_HEADLESS": "connections with no complete head yet, all addresses together (slowloris from many hosts)",
    "IDLE_TIMEOUT_S": "seconds a kept-alive client may stay silent between requests",
    "HEAD_TIMEOUT_S": "seconds for a whole request head, from its first byte (absolute: slowloris)",
    "REQUEST_TIMEOUT_S": "seconds for a whole request body after its head (16 MiB needs 4.5 Mbit/s)",
    "UPSTREAM_CONNECT_TIMEOUT_S": "seconds to connect to a session (a LAN connect takes < 1 ms)",
    "UPSTREAM_IDLE_TIMEOUT_S": "seconds an engine may be silent mid-answer (a long prompt's prefill on a busy engine)",
    "MAX_ATTEMPTS": "sessions tried per request before the client gets the error",
    "POOL_IDLE_PER_PROVIDER": "kept-alive connections per session (more than the benchmark's 64 clients)",
    "SICK_AFTER_FAILURES": "failures in a row before a session leaves rotation (one may be bad luck)",
    "SICK_BACKOFF_S": "seconds a session first sits out, doubled per relapse",
    "SICK_BACKOFF_MAX_S": "seconds a session sits out at most before one request probes it back",
    "DRAIN_S": "seconds requests in flight get on SIGTERM",
    "LINGER_S": "seconds what a client still sends after a last answer is read and dropped (no TCP reset)",
    "WARMUP_MAX_S": "seconds a (re)started ingress says 503, not 404, until a peer's record arrives",
    "QUEUE_WAIT_S": "seconds of prefill queued at an engine before requests wait at the ingress (in fair order)",
    "QUEUE_PRIORITY_WAIT_S": "seconds of prefill queued at an engine that schedules by priority before requests "
                             "wait at the ingress (looser bounds measured worse)",
    "QUEUE_SESSION_DEPTH": "requests in flight from this ingress at which a session is full (vLLM runs 256)",
    "QUEUE_SESSION_SLOTS": "requests in flight from this ingress at which a session is full while two users or more "
                           "have requests here, but for a user below its share of them (as --queue-session-depth: "
                           "off; 16 measured best for 16-token answers on emulated H100s)",
    "QUEUE_GUARD_WAIT_S": "seconds of prefill queued at an engine past which a user with more requests waiting "
                          "is not sent more there while another user with none waiting has requests in flight "
                          "here (at or above --queue-wait-s: off; 0.001: one prompt at a time)",
    "QUEUE_MAX": "requests waiting at the ingress at most, all keys (more get 429; --no-queue: none wait)",
    "QUEUE_MAX_PER_KEY": "requests of one key waiting at most (more get 429: a flood fills its own share)",
    "QUEUE_MAX_BYTES": "request bytes waiting at most, all keys (the queue's memory)",
    "QUEUE_KEY_BYTES": "request bytes of one key waiting at most",
    "QUEUE_TIMEOUT_S": "seconds a request waits at most, then 429 with Retry-After",
    "QUEUE_AGE_S": "seconds of waiting that lift a request one priority class (no class starves)",
}


class Limits:
    """The LIMITS one ingress runs with, built once (from `serve`'s flags and their variables, or
    by a caller) and passed in: a field is the limit's name in lower case, its default the
    module constant of that name (the reason for each number is beside it). Nothing rewrites
    the constants, so a default argument frozen at import cannot miss a setting."""

    __slots__ = tuple(name.lower() for name in LIMITS)

    def __init__(self, **given: Any):
        unknown = set(given) - set(self.__slots__)
        if unknown:
            raise TypeError(f"unknown limits: {', '.join(sorted(unknown))}")
        for name, default in LIMITS.items():
            setattr(self, name.lower(), given.get(name.lower(), default))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(**{name.lower(): getattr(args, name.lower()) for name in LIMITS})

    def per_address(self) -> int:
        """The connections one client address may hold (ADDRESS_SHARE, ADDRESS_FLOOR)."""
        return min(self.max_connections, max(self.address_floor, int(self.max_connections * self.address_share)))


# =============================================================================================
# Errors for the client (their body, status and reason phrase: otela_node.error_body, REASONS)
# =============================================================================================
class HTTPError(Exception):
    """An error answered to the client in OpenAI's shape (otela_node.error_body)."""

    def __init__(self, status: int, message: str, code: Optional[str] = None,
                 param: Optional[str] = None, headers: Sequence[Tuple[bytes, bytes]] = (),
                 etype: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = list(headers)
        self.etype = etype


# =============================================================================================
# Request validation: what is refused before anything is routed (beyond the JSON and the model)
# =============================================================================================
_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array"}
# A path that names another route once decoded and resolved ("/v1/../x", "/v1/%2e%2e/x",
# "//v1/x", "/v1/./models", "\\"): an engine (or a proxy in front of it) that resolves it
# would serve a route other than the one the ingress checked, such as an engine's admin routes
# beside /v1. Refused with 400 before anything is routed.
_ODD_PATH = re.compile(rb"//|\\|/\.\.?(?:/|$)|[\x00-\x20\x7f]")


def normal_path(path: bytes) -> bool:
    """Whether a request path is in normal form, as sent and percent-decoded."""
    if _ODD_PATH.search(path):
        return False
    return b"%" not in path or _ODD_PATH.search(unquote_to_bytes(path)) is None


_JSON_START = re.compile(rb"\s*\{")   # a body that may be a JSON object, whatever its type says
_BOUNDARY = re.compile(rb'boundary="?([^";\s]{1,200})"?', re.IGNORECASE)
_FORM_MODEL = re.compile(rb'(?im)^content-disposition:[ \t]*form-data;(?:[^\r\n]*;)?[ \t]*name="?model"?[ \t]*(?:;|\r?$)')
FORM_MODEL_MAX = 512   # bytes of a form's model field at most (a model name, never a file)


def form_model(body: bytes, ctype: bytes) -> Optional[Tuple[int, int]]:
    """Where the value of the field `model` of a multipart/form-data body lies (start, end), or
    None. One pass forward: each part's head is looked at, no value is copied (a file part of
    megabytes costs one find); the body is already within the size limit."""
    found = _BOUNDARY.search(ctype)
    if found is None:
        return None
    delimiter = b"\r\n--" + found.group(1)
    at = body.find(delimiter[2:])
    while at >= 0:
        head_start = at + len(delimiter)   # (the first delimiter has no CRLF before it)
        head_end = body.find(b"\r\n\r\n", head_start)
        if head_end < 0:
            return None
        end = body.find(delimiter, head_end + 4)
        if end < 0:
            return None
        if _FORM_MODEL.search(body, head_start, head_end + 2) is not None and end - head_end - 4 <= FORM_MODEL_MAX:
            return head_end + 4, end
        at = end + 2
    return None


def with_model(body: bytes, ctype: Optional[bytes], model: str) -> bytes:
    """The body naming `model` instead (an alias's target, a fallback): a JSON body's `model`, or a
    form's field; any other body names none, and goes as it is."""
    if ctype is None and body:   # JSON (the one rewrite of a body besides include_usage)
        request = crdt.loads(body)
        request["model"] = model
        return crdt.dumps(request)
    span = form_model(body, ctype) if ctype else None
    if span is None:
        return body
    return body[:span[0]] + model.encode() + body[span[1]:]


def query_params(query: bytes) -> Dict[str, str]:
    """A query string's first value of each name; 400 for one not percent-encoded UTF-8."""
    try:
        return {k: v[0] for k, v in parse_qs(query.decode("ascii"), errors="strict").items()}
    except UnicodeDecodeError:
        raise HTTPError(400, "The query string is not percent-encoded UTF-8", "invalid_parameter") from None


def with_model_target(target: bytes, old: str, new: str) -> bytes:
    """The target naming `new` where it named `old` (a fallback's, an alias's): the query's
    `model`, or the path's segments that spell it (Ingress._model_elsewhere)."""
    path, mark, query = target.partition(b"?")
    if query and b"model=" in query:
        pairs = parse_qsl(query.decode("ascii", "replace"), keep_blank_values=True)
        if ("model", old) in pairs:
            query = urlencode([(k, new if (k, v) == ("model", old) else v) for k, v in pairs]).encode()
    text = unquote(path.decode("utf-8", "replace")) + "/"
    if f"/{old}/" in text:
        path = quote(text.replace(f"/{old}/", f"/{new}/", 1)[:-1], safe="/:@!$&'()*+,;=-._~").encode()
    return path + mark + query


# =============================================================================================
# Keys and allowlists (SQLite, hashed)
# =============================================================================================
# Keys are 256 random bits, so a plain sha256 is enough to store them: there is no password
# to brute-force, and the lookup must cost a microsecond, not a KDF's milliseconds.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY, user TEXT NOT NULL, hash TEXT NOT NULL UNIQUE,
    allow TEXT NOT NULL DEFAULT '[]', admin INTEGER NOT NULL DEFAULT 0,
    rate REAL NOT NULL DEFAULT 0, created REAL NOT NULL, revoked REAL,
    budget_day INTEGER NOT NULL DEFAULT 0, budget_month INTEGER NOT NULL DEFAULT 0,
    expires REAL, replica TEXT);
CREATE TABLE IF NOT EXISTS usage_slots (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS limit_entries (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS limits (
    kind TEXT NOT NULL, name TEXT NOT NULL, rpm INTEGER NOT NULL DEFAULT 0,
    tpm INTEGER NOT NULL DEFAULT 0, concurrency INTEGER NOT NULL DEFAULT 0, changed REAL NOT NULL,
    queue TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (kind, name));
CREATE TABLE IF NOT EXISTS requests (
    ts REAL NOT NULL, day TEXT NOT NULL, key_id TEXT, user TEXT, model TEXT,
    session TEXT, provider TEXT, status INTEGER, prompt_tokens INTEGER,
    completion_tokens INTEGER, latency_ms REAL, stream INTEGER, attempts INTEGER, request_id TEXT,
    trace_id TEXT, waited_ms REAL);
CREATE TABLE IF NOT EXISTS daily (
    day TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0, errors INTEGER NOT NULL DEFAULT 0,
    opted_out INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0, waited_ms REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (day, user, model));
"""


def open_db(path: str) -> sqlite3.Connection:
    """One connection with the schema, WAL and a busy timeout (the CLI and serve share it).
    The database is private to its owner (mode 0600, like the journal and the cluster key):
    SQLite gives its -wal, -shm and journal files the database file's mode."""
    # created here, with its mode, before SQLite would create it 0644 (there already, or not
    # creatable: SQLite says which)
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a commit is durable against a crash of this process (kill -9),
            # which is the promise; only a power loss may drop the last commits.
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            _add_key_columns(db)
        except BaseException:
            db.close()
            raise
    except sqlite3.Error as exc:   # say which file: "unable to open database file" alone is no help
        raise sqlite3.Error(f"--db {path}: {exc}") from None
    for suffix in ("", "-wal", "-shm", "-journal"):   # one made before this rule: private from now on
        with contextlib.suppress(OSError):   # absent, or not ours to change
            mode = os.stat(path + suffix).st_mode
            if mode & 0o077:
                os.chmod(path + suffix, mode & 0o700)
    return db


# Columns a release added later (budgets, expiry, the replicated record): a database made before
# them gets them on open, with the defaults of a key that has none.
_KEY_COLUMNS = (("budget_day", "INTEGER NOT NULL DEFAULT 0"), ("budget_month", "INTEGER NOT NULL DEFAULT 0"),
                ("expires", "REAL"), ("replica", "TEXT"))


def _add_key_columns(db: sqlite3.Connection) -> None:
    have = {row[1] for row in db.execute("PRAGMA table_info(keys)")}
    for name, decl in _KEY_COLUMNS:
        if name not in have:
            db.execute(f"ALTER TABLE keys ADD COLUMN {name} {decl}")
    have = {row[1] for row in db.execute("PRAGMA table_info(requests)")}
    for name, decl in (("request_id", "TEXT"), ("trace_id", "TEXT"), ("waited_ms", "REAL")):   # (in this
        if name not in have:                                                      # order: rows go in by position)
            db.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")
    if "waited_ms" not in {row[1] for row in db.execute("PRAGMA table_info(daily)")}:
        db.execute("ALTER TABLE daily ADD COLUMN waited_ms REAL NOT NULL DEFAULT 0")
    if "queue" not in {row[1] for row in db.execute("PRAGMA table_info(limits)")}:   # a key's fair-queue fields
        db.execute("ALTER TABLE limits ADD COLUMN queue TEXT NOT NULL DEFAULT '{}'")


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class Key:
    """An API key as routing sees it (the secret itself is never kept)."""

    __slots__ = ("id", "user", "allow", "admin", "rate", "_tokens", "_stamp", "hash", "budget_day",
                 "budget_month", "expires", "rpm", "tpm", "concurrency", "limited", "weight", "priority",
                 "priorities", "sites")

    def __init__(self, key_id: str, user: str, allow: Sequence[str] = (), admin: bool = False,
                 rate: float = 0.0, key_hash: str = "", record: Optional[Dict[str, Any]] = None,
                 settings: Optional[Dict[str, Any]] = None):
        self.id, self.user, self.allow = key_id, user, tuple(sorted(set(allow)))
        self.admin, self.rate = bool(admin), float(rate)
        self._tokens, self._stamp = max(1.0, self.rate), 0.0
        self.hash = key_hash   # (record: its replicated record, crdt.key_record; None for ANONYMOUS)
        self.budget_day = int(record.get("budget_day", 0)) if record else 0
        self.budget_month = int(record.get("budget_month", 0)) if record else 0
        self.expires: Optional[float] = record.get("expires") if record else None
        # its settings entry (crdt.key_settings_record; none: the defaults), read once here so the
        # request path pays nothing for them: the window limits (ClusterFlow; 0: none), its share
        # of the fair queue, its class and the classes it may ask for (FairQueue)
        get = settings.get if settings else {}.get
        self.rpm, self.tpm, self.concurrency = get("rpm", 0), get("tpm", 0), get("concurrency", 0)
        self.limited = bool(self.rpm or self.tpm or self.concurrency)
        self.weight = float(get("weight", 1.0))
        self.priority = PRIORITY_RANK[get("priority", crdt.DEFAULT_PRIORITY)]
        self.priorities = frozenset(PRIORITY_RANK[c] for c in get("priorities", ()))
        sites = get("sites")   # where its requests may be served (Ingress.candidates); None: anywhere
        self.sites: Optional[frozenset] = frozenset(sites) if sites else None

    @classmethod
    def of_record(cls, key_hash: str, record: Dict[str, Any], settings: Optional[Dict[str, Any]] = None) -> Key:
        return cls(record["id"], record["user"], record.get("allow", ()), record.get("admin", False),
                   record.get("rate", 0.0), key_hash, record, settings)

    def carry_bucket(self, old: Key) -> None:
        """This key replaces `old` (an edit of it): the requests `old` admitted still count."""
        self._tokens, self._stamp = old._tokens, old._stamp

    def charge(self, requests: int) -> None:
        """Requests another ingress admitted for this key take tokens from this bucket too, so
        the rate holds for the cluster (down to a debt of one burst: a flood elsewhere cannot
        lock the key out here for longer than a second's refill)."""
        if self.rate > 0 and requests > 0:
            now = time.monotonic()   # take()'s clock: the refill up to now first
            burst = max(1.0, self.rate)
            tokens = min(burst, self._tokens + (now - self._stamp) * self.rate) if self._stamp else burst
            self._tokens, self._stamp = max(-burst, tokens - requests), now

    def take(self, now: float) -> bool:
        """Token bucket: `rate` requests per second, bursts of up to max(1, rate)."""
        if self.rate <= 0:
            return True
        burst = max(1.0, self.rate)
        self._tokens = min(burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


ANONYMOUS = Key("-", "anonymous", admin=True)   # the identity of every request under --no-auth


def new_key(user: str, allow: Sequence[str] = (), admin: bool = False, rate: float = 0.0,
            budget_day: int = 0, budget_month: int = 0, expires: Optional[float] = None
            ) -> Tuple[str, str, Dict[str, Any]]:
    """A new key: (the token, shown once and never stored, the sha256 of it, its record). Its
    settings, if any, are an entry of their own (key_settings)."""
    token = KEY_PREFIX + secrets.token_urlsafe(32)
    record = crdt.key_record(secrets.token_hex(4), user, time.time(), allow, admin, rate,
                             budget_day, budget_month, expires)
    return token, hash_key(token), record


def key_settings(at: float, limits: Optional[Mapping[str, int]] = None, **queueing: Any) -> Dict[str, Any]:
    """A key's settings entry as set at `at` (its version: `at` in ms, so the latest setting wins,
    as a user's limits): `limits` its window limits (limit_spec), `queueing` its fair-queue fields
    (queue_spec) and its sites (sites_spec); none of them: the settings cleared."""
    return crdt.key_settings_record(int(at * 1000), limits, **queueing)


def parse_expiry(text: str, now: float) -> float:
    """An expiry: a duration from now ("30d", "12h", "90m", "45s") or a UTC date or time
    ("2027-01-31", "2027-01-31T12:00"); a unix time for the record."""
    text = text.strip()
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return now + float(text[:-1]) * units[text[-1]]
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except ValueError:
            continue
    raise ValueError(f"expires must be a duration (30d, 12h, 90m) or a UTC date/time "
                     f"(2027-01-31, 2027-01-31T12:00), got {text!r}")


MAX_EXPIRES = 253402300799.0   # 9999-12-31T23:59:59Z


def key_spec(user: Any, allow: Any = None, rate: Any = 0.0, budget_day: Any = 0, budget_month: Any = 0,
             expires: Any = None) -> Tuple[str, List[str], float, int, int, Optional[float]]:
    """Check what a new key is to be (the CLI's flags, the admin API's fields): ValueError
    with a one-line reason."""
    if not isinstance(user, str) or not user.strip() or not user.strip().isprintable():
        raise ValueError("user must name someone (printable, not empty)")
    allow = _key_allow(allow)
    if type(rate) not in (int, float) or not (math.isfinite(rate) and rate >= 0):
        raise ValueError("rate must be a number >= 0 (requests/s; 0: none)")
    for name, value in (("budget_day", budget_day), ("budget_month", budget_month)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a whole number of tokens >= 0 (0: none)")
        if value >= 2**53:   # what every ingress's registry accepts (exact in a JSON double)
            raise ValueError(f"{name} must be below 2^53 tokens (0: none)")
    expires = None if expires is None else _key_expiry(expires)
    user = user.strip()
    try:   # whatever the registry would refuse is refused now, not after a key was handed out
        crdt.validate_key(crdt.key_entry("0" * 64), crdt.key_record(
            "check", user, time.time(), allow, False, float(rate), budget_day, budget_month, expires))
    except crdt.RecordError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None
    return user, allow, float(rate), budget_day, budget_month, expires


def queue_spec(weight: Any = 1.0, priority: Any = None, priorities: Any = None) -> Dict[str, Any]:
    """Check a new key's fair-queue fields (the CLI's --weight, --priority, --priorities; the admin
    API's weight, priority, priorities): crdt.key_record's keyword arguments, or ValueError with a
    one-line reason. `priorities`: a list of classes or a comma-separated string."""
    if type(weight) not in (int, float) or not (math.isfinite(weight) and 0 < weight <= crdt.MAX_KEY_WEIGHT):
        raise ValueError(f"weight must be a number > 0 and <= {crdt.MAX_KEY_WEIGHT:g} (its share of "
                         "the queue against a key of weight 1)")
    classes = ", ".join(crdt.PRIORITY_CLASSES)
    priority = crdt.DEFAULT_PRIORITY if priority is None else priority
    if priority not in crdt.PRIORITY_CLASSES:
        raise ValueError(f"priority must be one of {classes}")
    if isinstance(priorities, str):
        priorities = [c.strip() for c in priorities.split(",") if c.strip()]
    priorities = [] if priorities is None else priorities
    if not isinstance(priorities, list) or any(c not in crdt.PRIORITY_CLASSES for c in priorities):
        raise ValueError(f"priorities must list classes of {classes}")
    return {"weight": float(weight), "priority": priority, "priorities": sorted(set(priorities))}


def sites_spec(sites: Any) -> Dict[str, List[str]]:
    """Check the sites a key's or a model's requests may be served at (the CLI's --sites, the
    admin API's sites): a list of site names or a comma-separated string; None or empty: anywhere.
    crdt.limit_record's keyword argument, or ValueError with a one-line reason."""
    if isinstance(sites, str):
        sites = [s.strip() for s in sites.split(",") if s.strip()]
    sites = [] if sites is None else sites
    if not isinstance(sites, list) or any(not isinstance(s, str) or not crdt.SITE_NAME.match(s) for s in sites):
        raise ValueError("sites must list site names, as --site-name takes them (up to 64 letters, digits, "
                         "dots, dashes or underscores each)")
    if len(set(sites)) > crdt.MAX_SITES:
        raise ValueError(f"sites names {len(set(sites))} sites; {crdt.MAX_SITES} at most")
    return {"sites": sorted(set(sites))}


def _key_allow(allow: Any) -> List[str]:
    """A key's allowlist: a comma-separated string (the CLI's), a list of names, or None (any)."""
    if isinstance(allow, str):
        allow = [a.strip() for a in allow.split(",") if a.strip()]
        if not allow:   # e.g. --allow "$EMPTY": never a key for any provider
            raise ValueError("allow names no provider; leave it out for a key that may use any")
        return allow
    if allow is None:
        return []
    if not (isinstance(allow, list) and all(isinstance(a, str) and a for a in allow)):
        raise ValueError("allow must be a list of provider names")
    return list(allow)


def _key_expiry(expires: Any) -> float:
    """A key's end as a unix time, from a unix time, a duration (30d) or a UTC date."""
    if isinstance(expires, str):
        expires = parse_expiry(expires, time.time())
    elif type(expires) not in (int, float) or not 0 <= expires < math.inf:
        raise ValueError("expires must be a unix time, a duration (30d) or a UTC date")
    if expires > MAX_EXPIRES:   # a time `keys list` (gmtime) and every ingress can still read
        raise ValueError("expires must be before the year 10000")
    return float(expires)


def key_answer(token: str, record: Dict[str, Any], settings: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """What `keys create --json` prints and POST /v1/admin/keys answers: one shape, every
    field spelled out (the record and its settings leave defaults out), no internal state or
    version."""
    settings = settings or {}
    return {"object": "api_key", "id": record["id"], "key": token, "user": record["user"],
            "created": record["created"], "admin": record.get("admin", False), "allow": record.get("allow", []),
            "rate": record.get("rate", 0.0), "budget_day": record.get("budget_day", 0),
            "budget_month": record.get("budget_month", 0), "expires": record.get("expires"),
            "weight": settings.get("weight", 1.0), "priority": settings.get("priority", crdt.DEFAULT_PRIORITY),
            "priorities": settings.get("priorities", []), "sites": settings.get("sites", []),
            **{f: settings.get(f, 0) for f in crdt.LIMIT_FIELDS}}


def create_key(db: sqlite3.Connection, user: str, allow: Sequence[str] = (), admin: bool = False,
               rate: float = 0.0, budget_day: int = 0, budget_month: int = 0,
               expires: Optional[float] = None) -> Tuple[str, str]:
    """Store a new key; return (key id, the token, which is shown once and never stored)."""
    token, digest, record = new_key(user, allow, admin, rate, budget_day, budget_month, expires)
    store_key_record(db, digest, record)
    return record["id"], token


def store_key_record(db: sqlite3.Connection, digest: str, record: Dict[str, Any]) -> None:
    """Write a key's record (made here or replicated from another ingress) into its row."""
    revoked = record.get("revoked_at", 0.0) if record["state"] == crdt.KEY_REVOKED else None
    db.execute("INSERT INTO keys (id, user, hash, allow, admin, rate, created, revoked, budget_day, "
               "budget_month, expires, replica) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(hash) DO UPDATE "
               "SET user=excluded.user, allow=excluded.allow, admin=excluded.admin, rate=excluded.rate, "
               "revoked=coalesce(revoked, excluded.revoked), budget_day=excluded.budget_day, "
               "budget_month=excluded.budget_month, expires=excluded.expires, replica=excluded.replica",
               (record["id"], record["user"], digest, crdt.dumps(record.get("allow", [])).decode(),
                int(record.get("admin", False)), float(record.get("rate", 0.0)), record["created"], revoked,
                record.get("budget_day", 0), record.get("budget_month", 0), record.get("expires"),
                crdt.encode(record).decode()))


def list_keys(db: sqlite3.Connection) -> List[Dict[str, Any]]:
    rows = db.execute("SELECT id, user, allow, admin, rate, created, revoked, budget_day, budget_month, "
                      "expires, hash FROM keys ORDER BY created").fetchall()
    return [{"id": r[0], "user": r[1], "allow": crdt.loads(r[2]), "admin": bool(r[3]),
             "rate": r[4], "created": r[5], "revoked": r[6], "budget_day": r[7], "budget_month": r[8],
             "expires": r[9], "hash": r[10]} for r in rows]


def revoke_key(db: sqlite3.Connection, key_id: str) -> bool:
    cur = db.execute("UPDATE keys SET revoked=? WHERE id=? AND revoked IS NULL", (time.time(), key_id))
    return cur.rowcount > 0


def load_key_records(db: sqlite3.Connection) -> Dict[str, Dict[str, Any]]:
    """sha256 -> replicated record for every key, revoked ones included. A row from before
    replication (or revoked by the CLI since) gets the record its columns say."""
    records = {}
    for key_id, user, digest, allow, admin, rate, created, revoked, budget_day, budget_month, expires, replica \
            in db.execute("SELECT id, user, hash, allow, admin, rate, created, revoked, budget_day, "
                          "budget_month, expires, replica FROM keys"):
        record = None
        if replica:
            try:
                record = crdt.loads(replica)
                crdt.validate_key(crdt.key_entry(digest), record)
            except (ValueError, crdt.RecordError):
                record = None
        if record is None:
            record = crdt.key_record(key_id, user, created, crdt.loads(allow), bool(admin), rate,
                                     budget_day, budget_month, expires)
        if revoked is not None:
            record = crdt.revoked(record, revoked)
        records[digest] = record
    return records


def allowed(allow: Sequence[str], session_id: str, owner: Optional[str], labels: Dict[str, str]) -> bool:
    """An allowlist entry names a provider: its owner, a label "k=v", a label value, or a session.
    `owner` and `labels`: what routing believes of the session (its grant's labels, see Grants)."""
    if not allow:
        return True
    for entry in allow:
        if entry == owner or entry == session_id:
            return True
        name, eq, value = entry.partition("=")
        if eq and labels.get(name) == value:
            return True
        if not eq and entry in labels.values():
            return True
    return False


# =============================================================================================
# Usage ledger (journal + SQLite WAL, one writer thread) and live usage statistics
# =============================================================================================
# A usage row: the journal line (a JSON array) and the requests table take these, in this order.
USAGE_FIELDS = ("ts", "key_id", "user", "model", "session", "provider", "status", "prompt_tokens",
                "completion_tokens", "latency_ms", "stream", "attempts", "tracked", "request_id", "trace_id",
                "waited_ms")   # (waited_ms: time in the fair queue, a row of a request that waited alone has it)


def _day(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


_LAST_TS = 253402300799.0   # 9999-12-31 23:59:59 UTC: the last second gmtime and SQLite's date() take


def ledger_row_ok(row: Any) -> bool:
    """Whether `row` is a usage row (USAGE_FIELDS) this ingress could have written: of its shape
    and types, a time gmtime takes, token counts no engine's answer is booked above
    (crdt.MAX_REQUEST_TOKENS), other integers within SQLite's. Only asked of a batch SQLite
    could not take, to find the rows to blame."""
    if not isinstance(row, tuple) or len(row) not in (13, 14, 15, 16):
        return False
    ts, key_id, user, model, session, provider, status, prompt, completion, latency, stream, attempts, \
        tracked = row[:13]
    numbers = (ts, latency)
    return all(type(v) in (int, float) and math.isfinite(v) for v in numbers) and 0 <= ts <= _LAST_TS \
        and all(type(v) is str for v in (key_id, user, model, session, provider)) \
        and all(v is None or type(v) is int and 0 <= v <= crdt.MAX_REQUEST_TOKENS for v in (prompt, completion)) \
        and all(type(v) is int and 0 <= v < 1 << 63 for v in (status, stream, attempts, tracked)) \
        and all(v is None or type(v) is str for v in row[13:15]) \
        and all(v is None or type(v) in (int, float) and 0 <= v < 1e12 for v in row[15:])


# One statement for both kinds of rows: the day is derived in SQLite, and an opted-out request
# (tracked = 0, the 13th value) leaves no row here; it is only counted in `daily`.
_INSERT_REQUESTS = ("INSERT INTO requests SELECT ?1, date(?1, 'unixepoch'), ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, "
                    "?10, ?11, ?12, ?14, ?15, ?16 WHERE ?13")
_INSERT_DAILY = ("INSERT INTO daily VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT(day, user, model) DO UPDATE SET "
                 "requests=requests+excluded.requests, errors=errors+excluded.errors, "
                 "opted_out=opted_out+excluded.opted_out, prompt_tokens=prompt_tokens+excluded.prompt_tokens, "
                 "completion_tokens=completion_tokens+excluded.completion_tokens, "
                 "waited_ms=waited_ms+excluded.waited_ms")


def _answer(futures: List[concurrent.futures.Future], result: Any) -> None:
    """Set the result of futures another thread may have cancelled meanwhile (its client left)."""
    for future in futures:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_result(result)


class Ledger:
    """The usage ledger: crash-safe without SQLite on the event loop.

    Theory of operation. When a request completes, the event loop appends one JSON line to a
    journal file mapped shared (a copy into the page cache, no system call; the bytes belong to
    the kernel at once, so a kill -9 right after cannot lose them) *before* the client gets the
    last byte, and adds the row to a list. Every LEDGER_FLUSH_S a thread takes the list and commits it to
    SQLite (WAL) in one transaction, together with how far into the journal it got. At start,
    whatever the journal holds past that point (the rows a crash kept from SQLite) is applied
    first. The journal is cut into files of LEDGER_JOURNAL_MAX bytes; a file is deleted once all
    of it is in SQLite. The same thread reloads the keys when another process changed them.
    A row leaves the journal only once committed: a batch SQLite refuses (a full disk, a locked
    or read-only file) goes back in front of the queue for the next commit, the journal position
    moves only with a commit, and a journal file is deleted only when a commit went past it. A
    failing ledger shows on /healthz and /metrics while requests go on being served.
    """

    def __init__(self, path: str, on_keys: Callable[[Dict[str, Dict[str, Any]]], None],
                 on_settings: Optional[Callable[[Dict[str, Dict[str, Any]]], None]] = None):
        """`on_keys(records)` gets every key's record (revoked ones too: ClusterKeys) at each reload,
        after `on_settings(settings)` got the keys' settings (so a new key never works without them)."""
        self.path = path
        self._on_keys = on_keys
        self._on_settings = on_settings
        # One ingress per ledger: a second one would replay the first one's live journal.
        try:
            self._lock = os.open(f"{path}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError as exc:   # name the --db, not the lock file beside it
            raise ValueError(f"--db {path}: {exc.strerror} (its folder must exist and be writable)") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock)
            raise ValueError(f"{path} is the ledger of another running ingress: give each its own --db") \
                from None
        self._db = open_db(path)
        self._db.execute("CREATE TABLE IF NOT EXISTS ledger_state (id INTEGER PRIMARY KEY CHECK (id = 0), "
                         "seq INTEGER NOT NULL, offset INTEGER NOT NULL)")
        self._data_version = -1
        self._replicas: Dict[str, Dict[str, Any]] = {}   # entry id -> record to keep (ClusterKeys)
        self._reload_keys()
        self.rows_written = 0
        self.failed_commits = 0             # batches SQLite refused (each retried with the next)
        self.rows_dropped = 0               # rows (and replicated records) SQLite could never
                                            # take (see _commit): lost, and shown
        self.error: Optional[str] = None    # why the last commit failed; None once one succeeds
        self._pending: List[tuple] = []    # journalled rows not yet in SQLite (appended by the loop)
        self._position = (0, 0)            # (journal file, offset) after the last pending line
        self._rows_lock = threading.Lock()
        self._wake = threading.Event()     # set by flush or close
        self._flushed = threading.Condition()
        self._generation = 0               # batches committed; flush() waits for the next one
        self._waiters = 0                  # threads in flush()
        self._reloads: List[concurrent.futures.Future] = []   # reload_keys callers waiting (_reload_lock)
        self._reload_lock = threading.Lock()
        self._closing = False
        self._state_seq = 0
        self.seq = self._recover()
        self._fd = -1
        self._map: Optional[mmap.mmap] = None
        self._open_journal(0)
        self._thread = threading.Thread(target=self._run, name="otela-ledger", daemon=True)
        self._thread.start()

    # -- the event loop's side ------------------------------------------------------------------
    def record(self, values: tuple, line: Optional[bytes] = None) -> None:
        """Journal one row (USAGE_FIELDS; durable against a crash of this process once this
        returns) and queue it for SQLite. `line`, when given, is the row already serialised
        (a JSON array and a newline)."""
        self.journal(crdt.dumps(values) + b"\n" if line is None else line)
        self.queue(values)

    def journal(self, line: bytes) -> None:
        """The first half of record: the row's line into the journal (before the client's last
        byte). queue(values) must follow with nothing journalled between: a row's place in the
        journal is where the journal ends when it is queued."""
        offset = self._offset
        end = offset + len(line)
        if end > self._size:
            self.seq += 1
            self._open_journal(len(line))
            offset, end = 0, len(line)
        if self._map is not None:
            self._map[offset:end] = line   # a store into the page cache: no system call
        else:
            try:
                os.write(self._fd, line)
            except OSError as exc:   # a full disk must not take the API down with it
                print(f"otela-ingress: usage journal write failed: {exc}", file=sys.stderr)
        self._offset = end

    def queue(self, values: tuple) -> None:
        """The second half of record: the journalled row, queued for SQLite."""
        with self._rows_lock:
            self._pending.append(values)
            self._position = (self.seq, self._offset)

    def _open_journal(self, need: int) -> None:
        """Start journal file self.seq. It is mapped shared and its blocks reserved up front:
        a row is then a copy into the page cache, which a kill -9 of this process cannot lose,
        without a write() (whose inode time update cost ~50 us on an idle loop). Where the
        blocks cannot be reserved (full disk, a file system without fallocate), rows go out
        with write() instead, so a full disk costs an error message, never a SIGBUS."""
        old_fd, old_map = self._fd, self._map
        size = max(LEDGER_JOURNAL_MAX, need)
        self._fd = os.open(self._journal(self.seq), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._offset, self._size, self._map = 0, size, None
        try:
            os.posix_fallocate(self._fd, 0, size)
            self._map = mmap.mmap(self._fd, size)
        except (OSError, ValueError, AttributeError) as exc:
            print(f"otela-ingress: usage journal not mapped ({exc}); using write()", file=sys.stderr)
            os.ftruncate(self._fd, 0)
        if old_map is not None:
            old_map.close()
        if old_fd >= 0:
            os.close(old_fd)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every row recorded so far is in SQLite (tests, /v1/usage, shutdown)."""
        if not self._thread.is_alive():   # closed: everything was written on the way out
            return True
        with self._flushed:
            target = self._generation + 2   # the batch in progress may have missed our rows
            self._waiters += 1
            self._wake.set()
            try:
                return self._flushed.wait_for(
                    lambda: self._generation >= target or not self._thread.is_alive(), timeout)
            finally:
                self._waiters -= 1

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._map is not None:
            self._map.close()
        os.close(self._fd)
        self._db.close()
        os.close(self._lock)

    # -- the writer thread ------------------------------------------------------------------------
    def _journal(self, seq: int) -> str:
        return f"{self.path}.usage.{seq}"

    def _recover(self) -> int:
        """Apply journal rows that never reached SQLite; returns the next journal number."""
        state = self._db.execute("SELECT seq, offset FROM ledger_state").fetchone() or (0, 0)
        directory = os.path.dirname(os.path.abspath(self.path))
        prefix = os.path.basename(self.path) + ".usage."
        seqs = sorted(int(name[len(prefix):]) for name in os.listdir(directory)
                      if name.startswith(prefix) and name[len(prefix):].isdigit())
        rows = []
        for seq in seqs:
            if seq < state[0]:
                continue
            with open(self._journal(seq), "rb") as f:
                if seq == state[0]:
                    f.seek(state[1])
                data = f.read()
                end = data.find(b"\0")   # a mapped journal's unused tail is zeros
                for line in (data if end < 0 else data[:end]).splitlines():
                    try:
                        values = tuple(crdt.loads(line))
                    except ValueError:   # a torn last line: that request never completed
                        continue
                    if len(values) in (13, 14, 15, 16):   # 13, 14, 15: from before request ids, trace ids, waits
                        rows.append(values)
        nxt = max(seqs + [state[0]]) + 1
        if not self._commit(rows, (nxt, 0)):   # the writer retries them; the files stay till then
            self._pending, self._position = rows, (nxt, 0)
            return nxt
        for seq in seqs:
            os.unlink(self._journal(seq))
        if rows:
            print(f"otela-ingress: recovered {len(rows)} usage rows from the journal", file=sys.stderr)
        return nxt

    def _reload_keys(self) -> None:
        version = self._db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._data_version = version
            if self._on_settings is not None:
                self._on_settings(load_key_settings(self._db))
            self._on_keys(load_key_records(self._db))

    def reload_keys(self) -> Optional[concurrent.futures.Future]:
        """Read the keys from SQLite now, not at the next KEYS_RELOAD_S: a future done once they
        were handed over (or None when too many wait already: the caller refuses at once)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._reload_lock:
            if len(self._reloads) >= KEY_RELOAD_WAITERS:
                return None
            self._reloads.append(future)
        self._wake.set()
        return future

    def replicate(self, entry_id: str, record: Dict[str, Any]) -> None:
        """Keep a replicated key record or usage slot in SQLite (the event loop's side: a dict
        store; the writer thread commits the latest of each with the next batch)."""
        with self._rows_lock:
            self._replicas[entry_id] = record

    def keep_settings(self, digest: str, record: Dict[str, Any]) -> None:
        """Keep a key's settings (from the overlay, its key known here) as the row `keys create`
        writes, so `keys list` shows them whichever ingress they were set at."""
        with self._rows_lock:
            self._replicas[SETTINGS_ROW + digest] = record

    def _store_replicas(self) -> None:
        with self._rows_lock:
            replicas, self._replicas = self._replicas, {}
        if not replicas:
            return
        db = self._db
        try:
            db.execute("BEGIN")
            for entry_id, record in replicas.items():
                if entry_id.startswith(SETTINGS_ROW):   # (our own write: no reload reads it back now)
                    store_limit(db, "k", entry_id[len(SETTINGS_ROW):], {f: record.get(f, 0) for f in crdt.LIMIT_FIELDS},
                                record["version"] / 1000, {f: record[f] for f in crdt.KEY_QUEUE_FIELDS
                                                           + crdt.RESIDENCY_FIELDS if f in record})
                elif crdt.kind_of(entry_id) == crdt.KEY:
                    try:
                        store_key_record(db, entry_id[len(crdt.KEY_ENTRY):], record)
                    except sqlite3.IntegrityError:   # its short id names another key here
                        print(f"otela-ingress: key {record['id']} from the overlay clashes with a "
                              "local key id; it works but is not kept in this --db", file=sys.stderr)
                elif crdt.kind_of(entry_id) == crdt.LIMIT:
                    db.execute("INSERT OR REPLACE INTO limit_entries VALUES (?, ?)",
                               (entry_id, crdt.encode(record).decode()))
                else:
                    db.execute("INSERT OR REPLACE INTO usage_slots VALUES (?, ?)",
                               (entry_id, crdt.encode(record).decode()))
            db.execute("COMMIT")
            # our own writes leave PRAGMA data_version alone: no reload, no echo
        except Exception as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            if not isinstance(exc, sqlite3.Error):   # a record no retry would keep: the overlay holds it
                self.rows_dropped += len(replicas)
                print(f"otela-ingress: {len(replicas)} replicated keys/usage not kept in SQLite "
                      f"({exc.__class__.__name__}: {exc})", file=sys.stderr)
                return
            with self._rows_lock:   # kept for the next round, like ledger rows
                self._replicas = dict(replicas, **self._replicas)
            print(f"otela-ingress: keeping replicated keys/usage failed (retried): {exc}", file=sys.stderr)
            if "readonly" in str(exc):
                self._reopen()

    def _run(self) -> None:
        next_reload = time.monotonic() + KEYS_RELOAD_S
        while True:
            self._wake.wait(LEDGER_FLUSH_S)   # set only by flush() and close()
            self._wake.clear()
            closing = self._closing   # read after clear(): close() sets it before waking us
            try:
                self._write_pending()
                self._store_replicas()   # keys and usage slots from the overlay (ClusterKeys)
            except Exception as exc:   # nothing above raises by design; if it did, the writer goes on
                self.error = f"ledger writer: {exc.__class__.__name__}: {exc}"
                print(f"otela-ingress: {self.error}", file=sys.stderr)
            with self._flushed:
                self._generation += 1
                self._flushed.notify_all()
                if self._waiters:
                    self._wake.set()   # a flush waits for one more batch
            if closing:
                with self._reload_lock:
                    waiting, self._reloads = self._reloads, []
                _answer(waiting, False)
                return
            if self._reloads or time.monotonic() >= next_reload:
                next_reload = time.monotonic() + KEYS_RELOAD_S
                with self._reload_lock:
                    waiting, self._reloads = self._reloads, []
                try:
                    self._reload_keys()
                except Exception as exc:   # (a locked database, a bad row): tried again in a second
                    print(f"otela-ingress: key reload failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)
                _answer(waiting, True)   # (after the keys were handed to the loop: they come first)

    def _write_pending(self) -> None:
        """The rows queued so far into SQLite, or back in front of the queue when it refuses."""
        with self._rows_lock:   # the rows and the journal position that ends them, together
            rows, self._pending = self._pending, []
            position = self._position
        if not rows:
            return
        old_seq = self._state_seq
        if not self._commit(rows, position):
            with self._rows_lock:   # first in the next batch; the position stays theirs
                self._pending = rows + self._pending
        for seq in range(old_seq, self._state_seq):   # files now wholly in SQLite
            with contextlib.suppress(OSError):
                os.unlink(self._journal(seq))

    def _commit(self, rows: List[tuple], position: Tuple[int, int]) -> bool:
        """Rows and the journal position after them, in one transaction; False when SQLite
        refused them (nothing of them is in). A row that is not one this ingress could have
        written (a count over 2^63 is an OverflowError, not a sqlite3.Error; a journal line of
        another shape) would fail every retry and hold back every row after it: it is taken out
        of `rows` instead, printed and counted (rows_dropped: /healthz says degraded from then
        on), and the others are written."""
        try:
            written = self._write(rows, position)
        except sqlite3.Error as exc:   # the rows stay in the journal and in the queue
            return self._refused(exc)
        except Exception as exc:
            why = f"{exc.__class__.__name__}: {exc}"
            bad = [row for row in rows if not ledger_row_ok(row)] or list(rows)   # none to blame: all go
            for row in bad:
                print(f"otela-ingress: usage row dropped ({why}): {repr(row)[:300]}", file=sys.stderr)
            dropped = {id(row) for row in bad}
            rows[:] = [row for row in rows if id(row) not in dropped]
            self.rows_dropped += len(bad)
            try:
                written = self._write(rows, position)
            except sqlite3.Error as again:
                return self._refused(again)
            except Exception as again:   # a bug: the batch goes (a restart's recovery meets it again),
                self.rows_dropped += len(rows)   # the writer stays
                print(f"otela-ingress: {len(rows)} usage rows dropped ({again.__class__.__name__}: {again})",
                      file=sys.stderr)
                rows[:] = []
                return True
        self.rows_written += written
        self._state_seq = position[0]
        if self.error is not None:
            print("otela-ingress: ledger writes work again", file=sys.stderr)
            self.error = None
        return True

    def _refused(self, exc: sqlite3.Error) -> bool:
        """SQLite refused a batch: it is kept for the next commit (False)."""
        self.failed_commits += 1
        if self.error is None:   # said once per outage, not four times a second
            print(f"otela-ingress: ledger write failed (rows kept, retried): {exc}", file=sys.stderr)
        self.error = str(exc)
        if "readonly" in str(exc):
            self._reopen()
        return False

    def _write(self, rows: List[tuple], position: Tuple[int, int]) -> int:
        """One transaction: the rows, their daily sums and the journal position (rolled back
        whole on any error). Returns the request rows written."""
        daily: Dict[Tuple[str, str, str], List[int]] = {}
        days: Dict[int, str] = {}
        for ts, _, user, model, _, _, status, prompt, completion, _, _, _, tracked, *rest in rows:
            day = days.get(int(ts // 86400))
            if day is None:
                day = days[int(ts // 86400)] = _day(ts)
            agg = daily.get((day, user, model))
            if agg is None:
                agg = daily[(day, user, model)] = [0, 0, 0, 0, 0, 0.0]
            agg[0] += 1
            agg[1] += status >= 400
            agg[2] += not tracked
            agg[3] += prompt or 0
            agg[4] += completion or 0
            agg[5] += (rest[2] or 0.0) if len(rest) > 2 else 0.0
        db = self._db
        written = 0
        db.execute("BEGIN")
        try:
            if rows:
                written = db.executemany(_INSERT_REQUESTS, [r if len(r) == 16 else r + (None,) * (16 - len(r))
                                                            for r in rows]).rowcount
                db.executemany(_INSERT_DAILY, [(*key, *agg) for key, agg in daily.items()])
            db.execute("INSERT OR REPLACE INTO ledger_state VALUES (0, ?, ?)", position)
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        return written

    def _reopen(self) -> None:
        """SQLite opens a file it may not write read-only, and that connection stays read-only
        after the file becomes writable: a new one sees it, so the ledger recovers by itself."""
        try:
            fresh = open_db(self.path)
        except sqlite3.Error:   # still not usable: the next failed commit tries again
            return
        self._db.close()
        self._db = fresh

    def pending(self) -> int:
        """Rows journalled but not yet in SQLite."""
        return len(self._pending)

    def health(self) -> Dict[str, Any]:
        """/healthz's view: not ok while SQLite refuses rows, once any row could not be written
        at all (until a restart), and if the writer thread is gone."""
        error = self.error
        if error is None and self.rows_dropped:
            error = f"{self.rows_dropped} usage rows could not be written (see the log)"
        if not self._thread.is_alive() and not self._closing:
            error = "the ledger's writer thread stopped: rows and keys changed by the CLI are not taken"
        return {"ok": error is None, "error": error, "failed_commits": self.failed_commits,
                "pending_rows": self.pending(), "dropped_rows": self.rows_dropped}


def query_usage(path: str, days: int = 31, user: Optional[str] = None,
                model: Optional[str] = None) -> Dict[str, Any]:
    """Totals per user, model and day (runs in an executor: it touches the disk)."""
    db = sqlite3.connect(path, timeout=10.0)
    try:
        since = _day(time.time() - max(0, days - 1) * 86400.0)
        sql = ("SELECT day, user, model, requests, errors, opted_out, prompt_tokens, "
               "completion_tokens, waited_ms FROM daily WHERE day >= ?")
        args: List[Any] = [since]
        if user:
            sql += " AND user = ?"
            args.append(user)
        if model:
            sql += " AND model = ?"
            args.append(model)
        rows = db.execute(sql + " ORDER BY day, user, model", args).fetchall()
    finally:
        db.close()
    fields = ("day", "user", "model", "requests", "errors", "opted_out", "prompt_tokens",
              "completion_tokens", "waited_ms")   # (waited_ms: in the fair queue, FairQueue)
    data = [dict(zip(fields, row)) for row in rows]
    totals = {f: sum(r[f] for r in data) for f in fields[3:]}
    return {"object": "list", "since": since, "data": data, "totals": totals}


class UsageStats:
    """Per model: recent arrival rate and input/output token mean and std (for the placer)."""

    def __init__(self, window: float = STATS_WINDOW_S):
        self.window = window
        self._samples: Dict[str, collections.deque] = {}
        self._unserved: Dict[str, collections.deque] = {}   # catalogued model -> when nothing served it

    def unserved(self, model: str, now: float) -> None:
        """A request for a catalogued model that nothing serves (answered 503): demand all the same,
        from which the placer starts its first instance."""
        times = self._unserved.get(model)
        if times is None:
            times = self._unserved[model] = collections.deque(maxlen=STATS_MAX_SAMPLES)
        times.append(now)

    def add(self, model: str, now: float, prompt_tokens: Optional[int], completion_tokens: int) -> None:
        samples = self._samples.get(model)
        if samples is None:
            samples = self._samples[model] = collections.deque(maxlen=STATS_MAX_SAMPLES)
        samples.append((now, prompt_tokens, completion_tokens))

    def view(self, now: float) -> Dict[str, Any]:
        models = {}
        for model, samples in self._samples.items():
            while samples and samples[0][0] < now - self.window:
                samples.popleft()
            if not samples:
                continue
            n = len(samples)
            # a younger history than the window would underestimate the rate
            span = max(1.0, min(self.window, now - samples[0][0])) if n < samples.maxlen else \
                max(1e-3, now - samples[0][0])
            known_inputs = [s[1] for s in samples if s[1] is not None]
            models[model] = {"requests": n, "arrival_rate": n / span,
                             "input_tokens": _mean_std(known_inputs) if known_inputs else None,
                             "output_tokens": _mean_std([s[2] for s in samples])}
        for model, times in self._unserved.items():
            while times and times[0] < now - self.window:
                times.popleft()
            if times:
                models.setdefault(model, {"requests": 0, "arrival_rate": 0.0, "input_tokens": None,
                                          "output_tokens": None})["unserved"] = len(times)
        return {"window_s": self.window, "models": models}


def _mean_std(values: List[int]) -> Dict[str, float]:
    mean = sum(values) / len(values)
    return {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))}


# =============================================================================================
# Engine numbers: an answer's token counts believed only as far as what this ingress saw
# =============================================================================================
# A compute job runs the engine, so the usage it reports is a claim (DESIGN, "Trust"): a count of
# 10^15 tokens would spend every budget of its users, and 10^23 does not fit SQLite. Each count is
# booked at most at a bound that an honest engine never passes, from what went through here:
#   prompt      the request body's bytes + PROMPT_TEMPLATE_TOKENS (+ MEDIA_PART_TOKENS for each
#               image, audio or video named by URL): a token of text is at least one byte of it,
#               and a message's JSON ({"role":"user","content":""}, 29 bytes) outweighs the tokens
#               a chat template wraps it in (ChatML, Llama 3, Gemma: 5); the allowance is the
#               template's own text (a default system prompt, a date, tool-use instructions)
#   completion  the answer's bytes (streamed or whole: each token is at least a byte of its text,
#               and its JSON around it is more than the end-of-sequence token an engine counts
#               without printing), and max_tokens (max_completion_tokens, max_output_tokens)
#               times the choices (n, best_of) when the request states it; 0 for embeddings
#   cached      the prompt tokens
# and none over crdt.MAX_REQUEST_TOKENS, which no context window reaches. A count over its bound
# is booked at the bound and counted on /metrics by reason and session
# (otela_engine_usage_bounded_total): the session that said it is marked there.
PROMPT_TEMPLATE_TOKENS = 256   # the largest template preamble seen: Llama 3.1's date and tool-use
                               # instructions ~90 tokens, gpt-oss's channels and tools ~120
MEDIA_PART_TOKENS = 32768      # an image named by URL: Qwen2.5-VL's largest is 16,384 tokens (its
                               # default max_pixels); twice that for a short video or an audio clip
_MEDIA_URL = b'_url"'          # "image_url", "video_url", "audio_url" (key and type: counted twice)
_CAP_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def prompt_bound(body: bytes) -> int:
    """The most prompt tokens a request with this body can be (see above)."""
    bound = len(body) + PROMPT_TEMPLATE_TOKENS
    if bound < crdt.MAX_REQUEST_TOKENS and _MEDIA_URL in body:
        bound += body.count(_MEDIA_URL) * MEDIA_PART_TOKENS
    return min(bound, crdt.MAX_REQUEST_TOKENS)


def completion_cap(request: Dict[str, Any], path: bytes) -> Optional[int]:
    """The most completion tokens the request asks for (None: it does not say)."""
    if path == b"/v1/embeddings":
        return 0
    get, cap = request.get, None
    for name in _CAP_FIELDS:
        v = get(name)
        if type(v) is int and v >= 0 and (cap is None or v > cap):
            cap = v
    if cap is None:
        return None
    n, best_of = get("n"), get("best_of")   # (mostly neither: a request's cost, not a list's)
    if n is None and best_of is None:
        return cap
    return cap * max([v for v in (n, best_of) if type(v) is int and v > 0], default=1)


# A model's context window (its engines' max_model_len, in their records): a prompt that cannot
# fit goes to the next model of its fallbacks, or is answered 400 context_length_exceeded as OpenAI
# answers it. Without a tokenizer the prompt's tokens are estimated from below, so that no prompt
# that fits is turned away: its text's UTF-8 bytes / PROMPT_BYTES_PER_TOKEN (BPE tokenizers make
# about 4 of English, 2-3 of code or other scripts; 8 leaves room for runs of spaces and repeats),
# token ids as they are, images and audio not at all. A prompt between that bound and the window
# goes on, and the engine answers it.
PROMPT_BYTES_PER_TOKEN = 8
_PROMPT_FIELDS = frozenset(("messages", "content", "text", "prompt", "input", "instructions"))


def prompt_tokens_at_least(request: Dict[str, Any]) -> int:
    """A lower bound of the tokens of a request's prompt (see above)."""
    text, tokens = 0, 0
    todo: List[Any] = [v for k, v in request.items() if k in _PROMPT_FIELDS]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            text += len(value) if value.isascii() else len(value.encode("utf-8", "replace"))
        elif isinstance(value, list):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(v for k, v in value.items() if k in _PROMPT_FIELDS)
        elif type(value) is int:   # a token id (a completion's prompt given as ids)
            tokens += 1
    return tokens + text // PROMPT_BYTES_PER_TOKEN


def context_window(candidates: Sequence[Candidate]) -> Optional[int]:
    """The largest window of a model's sessions (None where one does not say its own)."""
    windows = [c.record.get("max_model_len") for c in candidates]
    return None if not windows or None in windows else max(windows)


def asked_completion(request: Dict[str, Any]) -> int:
    """The completion tokens one answer may take (0: the request does not say)."""
    return max([v for v in map(request.get, _CAP_FIELDS) if type(v) is int and v > 0], default=0)


def too_long(window: int, prompt: int, completion: int) -> HTTPError:
    return HTTPError(400, f"This model's maximum context length is {window} tokens. However, you requested at "
                          f"least {prompt + completion} tokens ({prompt} in the prompt, an estimate from below; "
                          f"{completion} for the completion). Please reduce the length of the messages or "
                          "completion.", "context_length_exceeded", "messages")


# =============================================================================================
# Cluster-wide keys and usage: replicated through the overlay, SQLite as each ingress's copy
# =============================================================================================
# Theory of operation. A key's record (crdt KEY entry, keyed by the token's sha256) and the
# per-(key, day) and per-(key, month) usage G-Counters (crdt USAGE entries, one slot per ingress session)
# live in the overlay's map, so every ingress holds all of them and they spread the way
# sessions do (pushed at once, repaired by anti-entropy, sent whole to a (re)joining ingress).
#   1. A key made or revoked here (the CLI on this --db, or the admin API) is published; one
#      learned from the overlay is written to this ingress's SQLite, so `keys list` shows it
#      and a restart starts from it. The request path reads only `ClusterKeys.keys`, rebuilt
#      on each change of a key record or of its settings.
#   1a. A key's settings (limits, weight, classes: crdt "Limits and flows") are an entry of
#      their own, "lim:k-<subject>", which an ingress of the release before carries without
#      understanding while it admits the key. They reach here through ClusterFlow (it holds every
#      "lim:" entry) and wait in `settings` for their key, or rebuild it; a Key reads them once
#      when it is built, so a key without settings costs the request path nothing. Where both
#      entries are made here, the settings go first (the CLI: one SQLite transaction the ledger
#      thread reads settings first; the admin API: published first), so a new key never works
#      here without them; at a peer the two may arrive a push apart.
#   2. Each request this ingress serves adds to its own slot at once; the slots that changed
#      go out every USAGE_PUBLISH_S. A peer's slot that grew charges the key's rate bucket
#      here with the requests it served, so a rate holds for the cluster, not per ingress.
#   3. Budgets (tokens per UTC day and month) are checked against the sum of every slot: the
#      cluster's use, stale by at most USAGE_PUBLISH_S plus one push (a few ms on a LAN).
USAGE_PUBLISH_S = 0.5     # own slots go out at most this often: at 50 req/s one record per
                          # (key, model) per half second instead of 50, and budgets elsewhere
                          # lag by half a second (a key can overrun by that much use)
QUOTA_MESSAGE = ("You exceeded your current quota ({what}); it renews at {renews} UTC. "
                 "Ask the operator for a larger budget.")


class ClusterKeys:
    """The keys and usage of the whole cluster as this ingress sees them."""

    def __init__(self, session_id: Callable[[], str], publish_entry: Callable[[str, Dict[str, Any]], None],
                 adopt_entries: Callable[[List[Tuple[str, Dict[str, Any]]]], None],
                 ledger: Callable[[], Optional[Ledger]]):
        self.session_id = session_id           # our session's id: a rejoin makes a new one
        self.publish_entry, self.adopt_entries = publish_entry, adopt_entries   # the overlay's writes
        self.ledger = ledger   # this ingress's SQLite copy (made at Ingress.start)
        self.keys: Dict[str, Key] = {}   # sha256 -> accepted key: what the request path reads
        self.records: Dict[str, Dict[str, Any]] = {}   # sha256 -> key record (revoked too)
        self.slots: Dict[str, Dict[str, Any]] = {}     # usage entry id -> slot record
        self.mine: Dict[str, Dict[str, Any]] = {}      # our own slots, live (entry id -> record)
        self._dirty: set = set()                       # own slots changed since published
        self.sent: Dict[str, tuple] = {}               # own slots' counts as last published (_carry)
        self.day_used: Dict[Tuple[str, str], int] = collections.defaultdict(int)    # (hash, day)
        self.month_used: Dict[Tuple[str, str], int] = collections.defaultdict(int)  # (hash, YYYY-MM)
        self.next_expiry = math.inf
        self._timer: Optional[asyncio.TimerHandle] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._today = (-1, "")                         # (unix day number, its YYYY-MM-DD)
        self._hot: Dict[str, tuple] = {}               # hash -> today's own slots, see count
        # Keys' settings ("lim:k-" entries, crdt "Limits and flows"): they arrive apart from their
        # keys, before or after them, so both are kept, and a change of either rebuilds the Key
        self.settings: Dict[str, Dict[str, Any]] = {}  # subject -> settings record (not cleared)
        self.by_subject: Dict[str, str] = {}           # subject -> sha256 of its key
        self.flow: Optional[ClusterFlow] = None        # names the subjects (use_flow)

    def use_flow(self, flow: ClusterFlow) -> None:
        """The keys' settings come through `flow` (it holds every "lim:" entry) and are named by
        its subject key."""
        self.flow = flow
        flow.on_key_settings = self.on_settings
        self.resubject()

    def subject(self, digest: str) -> str:
        """The subject of a key's settings (ClusterFlow.admit books the key's window under it)."""
        return self.flow.subject("k", digest) if self.flow is not None else ""

    def resubject(self) -> None:
        """The subject key changed (ClusterFlow.use, at start): every key's subject with it."""
        self.by_subject = {self.subject(digest): digest for digest in self.records}
        now = time.time()
        for digest, record in list(self.records.items()):
            self._rebuild_one(digest, record, now)
    def today(self, now: float) -> str:
        """The UTC day of `now`, formatted once a day instead of per request."""
        number = int(now // 86400)
        if number != self._today[0]:
            self._today = (number, crdt.time_day(now))
            self._hot = {}
        return self._today[1]

    # -- what comes in: SQLite at start and after the CLI, the overlay at any time ------------
    def read_records(self, records: Dict[str, Dict[str, Any]]) -> None:
        """Every key's record in SQLite, revoked ones too (read by the ledger thread at start
        and after the CLI changed them): adopted on the event loop."""
        self._on_loop(self.adopt, records)

    def read_settings(self, settings: Dict[str, Dict[str, Any]]) -> None:
        """Keys' settings the CLI stored in SQLite (read by the ledger thread just before the keys):
        published on the event loop, unless a later setting is held."""
        self._on_loop(self.adopt_settings, settings)

    def _on_loop(self, adopt: Callable[[Dict[str, Dict[str, Any]]], None], rows: Dict[str, Dict[str, Any]]) -> None:
        loop = self._loop
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here or loop is None:
            adopt(rows)
        else:   # (in the order they were read: settings before their keys)
            loop.call_soon_threadsafe(adopt, rows)

    def adopt_settings(self, settings: Dict[str, Dict[str, Any]]) -> None:
        for digest, record in settings.items():
            if self.flow is not None:
                try:
                    self.flow.set_key_settings(digest, record, now=False)
                except crdt.RecordError as exc:   # a bad row in SQLite must not stop the ingress
                    print(f"otela-ingress: not replicated: {exc}", file=sys.stderr)

    def adopt(self, records: Dict[str, Dict[str, Any]]) -> None:
        """Key records read from this ingress's SQLite: publish them (the lattice keeps the
        newer of each, and a revocation always wins)."""
        for digest, record in records.items():
            self.publish(crdt.key_entry(digest), record)

    def adopt_slots(self, slots: List[Tuple[str, Dict[str, Any]]]) -> None:
        """Usage slots kept in SQLite (ours from before a restart, and other ingresses'): taken
        back as they were, not published (no slot but our session's own is ours to write)."""
        self.adopt_entries(slots)   # the overlay tells on_entry, as for any change

    def publish(self, entry_id: str, record: Dict[str, Any]) -> None:
        try:
            self.publish_entry(entry_id, record)   # the overlay tells on_entry, as for any change
        except crdt.RecordError as exc:   # a bad row in SQLite must not stop the ingress
            print(f"otela-ingress: not replicated: {exc}", file=sys.stderr)

    def on_entry(self, entry_id: str, record: Optional[Dict[str, Any]]) -> None:
        """A key record or usage slot changed in the map (ours or a peer's)."""
        if record is None:
            return
        kind = crdt.kind_of(entry_id)
        ledger = self.ledger()
        if kind == crdt.KEY:
            digest = entry_id[len(crdt.KEY_ENTRY):]
            if digest not in self.records:
                self.by_subject[self.subject(digest)] = digest
                settings = self.settings.get(self.subject(digest))
                if settings is not None and ledger is not None:   # they came first
                    ledger.keep_settings(digest, settings)
            self.records[digest] = record
            self._rebuild_one(digest, record, time.time())
        elif kind == crdt.USAGE:
            self._count_slot(entry_id, record)
        else:
            return
        if ledger is not None:
            ledger.replicate(entry_id, record)

    def on_settings(self, entry_id: str, record: Dict[str, Any]) -> None:
        """A key's settings changed in the map (ClusterFlow.on_entry): its Key is rebuilt with them
        where its record is here already; else they wait for it."""
        subject = entry_id[len(crdt.LIMIT_ENTRY):]
        if crdt.has_settings(record):
            self.settings[subject] = record
        elif self.settings.pop(subject, None) is None:
            return   # cleared, and nothing was set: no key changes
        digest = self.by_subject.get(subject)
        if digest is not None and digest in self.records:
            self._rebuild_one(digest, self.records[digest], time.time())
            ledger = self.ledger()
            if ledger is not None:
                ledger.keep_settings(digest, record)

    def settings_of(self, digest: str) -> Dict[str, Any]:
        """A key's settings record ({}: none, its defaults)."""
        return self.settings.get(self.subject(digest), {})

    def _count_slot(self, entry_id: str, record: Dict[str, Any]) -> None:
        if entry_id in self.mine:
            return   # counted live in count(); the map has an older or equal copy
        old = self.slots.get(entry_id)
        self.slots[entry_id] = record
        tokens = record["prompt_tokens"] + record["completion_tokens"]
        requests = record["requests"]
        if old is not None:
            tokens -= old["prompt_tokens"] + old["completion_tokens"]
            requests -= old["requests"]
        digest = record["key"]
        day, month = crdt.budget_periods(record)
        if tokens > 0 and day is not None:
            self.day_used[(digest, day)] += tokens
        if tokens > 0 and month is not None:
            self.month_used[(digest, month)] += tokens
        key = self.keys.get(digest)
        if key is not None and old is not None and day is not None:   # a day slot we knew grew:
            key.charge(requests)                                        # requests served elsewhere

    # -- the keys the request path reads ------------------------------------------------------
    def _rebuild_one(self, digest: str, record: Dict[str, Any], now: float) -> None:
        keys = dict(self.keys)
        old = keys.pop(digest, None)
        if crdt.key_accepts(record, now):
            key = Key.of_record(digest, record, self.settings.get(self.subject(digest)) if self.settings else None)
            if old is not None:   # a rate bucket carries over an edit of its key
                key.carry_bucket(old)
            keys[digest] = key
            if key.expires is not None:
                self.next_expiry = min(self.next_expiry, key.expires)
        self.keys = keys   # one reference swap: the request path never sees half of it

    def expire(self, now: float) -> None:
        """Drop keys whose expiry has come (checked every USAGE_PUBLISH_S)."""
        if now < self.next_expiry:
            return
        keys = {d: k for d, k in self.keys.items() if k.expires is None or now < k.expires}
        self.next_expiry = min((k.expires for k in keys.values() if k.expires is not None), default=math.inf)
        self.keys = keys

    def refusal(self, digest: Optional[str]) -> HTTPError:
        """The 401 for a token that is not an accepted key: say why when we know the key."""
        record = self.records.get(digest) if digest else None
        if record is not None and record["state"] == crdt.KEY_REVOKED:
            return HTTPError(401, "This API key was revoked", "invalid_api_key")
        if record is not None and record.get("expires") is not None and time.time() >= record["expires"]:
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(record["expires"]))
            return HTTPError(401, f"This API key expired at {when} UTC", "expired_api_key")
        return HTTPError(401, "Invalid API key", "invalid_api_key")

    # -- usage: our slots, budgets -----------------------------------------------------------
    def _own(self, digest: str, period: str, slot: str) -> Tuple[Dict[str, Any], str]:
        entry_id = crdt.usage_entry(digest, crdt.ALL_MODELS, period, slot)   # hashed once a day
        record = self.mine.get(entry_id)
        if record is None:
            record = self.mine[entry_id] = crdt.usage_record(digest, crdt.ALL_MODELS, period, slot, 0, 0, 0, 0)
        return record, entry_id

    def count(self, key: Key, model: str, prompt_tokens: Optional[int], completion_tokens: Optional[int]) -> None:
        """One finished request (any status) served here: our day and month counters of its key
        (the model is in the ledger's rows, not in the replicated counters)."""
        digest = key.hash
        if not digest:
            return   # --no-auth's anonymous key: nothing to budget
        now = time.time()
        slot = self.session_id()
        hot = self._hot.get(digest)   # this key's slots today: the common case
        if hot is None or not hot[0] <= now < hot[1] or hot[2] != slot:
            day = self.today(now)
            start = now // 86400 * 86400   # the UTC day's bounds: its slots hold between them
            hot = self._hot[digest] = (start, start + 86400, slot, self._own(digest, day, slot),
                                       self._own(digest, day[:7], slot), (digest, day), (digest, day[:7]))
        prompt, completion = prompt_tokens or 0, completion_tokens or 0
        for record, entry_id in hot[3:5]:
            record["requests"] += 1
            record["prompt_tokens"] += prompt
            record["completion_tokens"] += completion
            self._dirty.add(entry_id)
        self.day_used[hot[5]] += prompt + completion
        self.month_used[hot[6]] += prompt + completion

    def check_quota(self, key: Key) -> None:
        """429 insufficient_quota (OpenAI's shape) for a key whose day or month budget is used."""
        if not (key.budget_day or key.budget_month):
            return
        now = time.time()
        day = self.today(now)
        if key.budget_day and self.day_used.get((key.hash, day), 0) >= key.budget_day:
            renews = time.strftime("%Y-%m-%d 00:00", time.gmtime(crdt.day_start(day) + 86400))
            raise HTTPError(429, QUOTA_MESSAGE.format(what=f"{key.budget_day} tokens a day", renews=renews),
                            "insufficient_quota", etype="insufficient_quota")
        if key.budget_month and self.month_used.get((key.hash, day[:7]), 0) >= key.budget_month:
            year, month = int(day[:4]), int(day[5:7])
            renews = f"{year + month // 12:04d}-{month % 12 + 1:02d}-01 00:00"
            raise HTTPError(429, QUOTA_MESSAGE.format(what=f"{key.budget_month} tokens a month", renews=renews),
                            "insufficient_quota", etype="insufficient_quota")

    def usage(self, digest: str, now: float) -> Dict[str, Any]:
        """A key's cluster-wide use today and this month against its budgets."""
        day = crdt.time_day(now)
        record = self.records.get(digest) or {}
        return {"day": day, "tokens_today": self.day_used.get((digest, day), 0),
                "tokens_this_month": self.month_used.get((digest, day[:7]), 0),
                "budget_day": record.get("budget_day", 0), "budget_month": record.get("budget_month", 0)}

    def totals(self, digest: Optional[str] = None) -> Dict[Tuple[str, str, str], Dict[str, int]]:
        """The G-Counters' values, our live slots included."""
        slots = list(self.slots.values()) + list(self.mine.values())
        return crdt.usage_totals(slots, digest)

    # -- the timer ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer = loop.call_later(USAGE_PUBLISH_S, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(USAGE_PUBLISH_S, self._tick, loop)
        try:
            self.flush()
            self.expire(time.time())
        except Exception as exc:   # a bug here must not stop the timer, nor the ingress
            print(f"otela-ingress: usage publish failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)

    def flush(self) -> None:
        """Publish our slots that changed (each write bumps its version)."""
        dirty, self._dirty = self._dirty, set()
        slot = self.session_id()
        today = crdt.time_day(time.time())
        for entry_id in [e for e, r in self.mine.items()
                         if r["day"] < today[:len(r["day"])] and e not in dirty]:
            self.slots[entry_id] = self.mine.pop(entry_id)   # a closed day or month: no more writes
            self.sent.pop(entry_id, None)
        for entry_id in dirty:
            record = self.mine[entry_id]
            if record["slot"] != slot:   # we rejoined as a new session: this slot is closed
                self._carry(entry_id, record, slot)
                continue
            record["version"] += 1
            self.sent[entry_id] = tuple(record[f] for f in crdt.USAGE_COUNTS)
            self.publish(entry_id, dict(record))

    def _carry(self, entry_id: str, record: Dict[str, Any], slot: str) -> None:
        """Counts a closed slot of ours got after it last went out (this ingress was evicted, by a
        partition, and rejoined as `slot` before the next flush): only its session may write it,
        so they go on in the new session's slot of the same key and period, and the closed one
        stays as the map has it. Without this they were counted here and nowhere else."""
        sent = self.sent.get(entry_id, (0,) * len(crdt.USAGE_COUNTS))
        delta = [record[f] - was for f, was in zip(crdt.USAGE_COUNTS, sent)]
        if not any(delta):
            return
        new, new_id = self._own(record["key"], record["day"], slot)
        for f, was, more in zip(crdt.USAGE_COUNTS, sent, delta):
            record[f] = was
            new[f] += more
        self._dirty.add(new_id)


def load_usage_slots(path: str, days: int = crdt.USAGE_RETENTION_DAYS,
                     months: int = crdt.USAGE_RETENTION_MONTHS) -> List[Tuple[str, Dict[str, Any]]]:
    """The usage slots this ingress kept (read once at start, before serving)."""
    db = open_db(path)
    try:
        rows = db.execute("SELECT id, record FROM usage_slots").fetchall()
    finally:
        db.close()
    slots = []
    horizons = crdt.usage_horizons(time.time(), days, months)
    for entry_id, text in rows:
        try:
            record = crdt.loads(text)
        except ValueError:
            continue
        if isinstance(record, dict) and crdt.usage_kept(str(record.get("day", "")), *horizons):
            slots.append((entry_id, record))   # older periods stay in SQLite, out of the map
    return slots


# =============================================================================================
# Limits: requests and tokens per sliding minute, requests in flight, per key, user and model
# =============================================================================================
# Theory of operation. A subject (a key, a user across its keys, a model across every key's
# requests to it) may carry limits (crdt.LIMIT_FIELDS: rpm, tpm, concurrency). Each is a "lim:"
# entry an admin sets at any ingress: a user's or a model's with PUT /v1/admin/limits/users/NAME
# or `limits set`, a key's (its settings, with its fair-queue fields) when the key is made
# (`keys create --rpm`, POST /v1/admin/keys) or with PUT /v1/admin/keys/ID/limits; a key's go to
# ClusterKeys, which builds them into the Key. A model's limit counts all of its requests: it
# protects the sessions serving it, which is what a per-model limit is for; a key's share of a
# model is what its own limits (or the fair queue) are for, so no per-key-per-model entries.
#   1. Admission (Ingress.proxy, after routing): every limited subject of the request has room
#      for one more request in its window, for its tokens (the prompt estimated as OpenAI does,
#      len/4, plus its max_tokens reserved; a request that names no max_tokens reserves its
#      prompt only), and one more in flight. Past any: 429 rate_limit_exceeded, its type
#      "requests" or "tokens", Retry-After and the x-ratelimit-* headers; else the request is
#      booked in each subject's window and the same headers go on its answer. Requests of keys
#      with no limits, where no user or model has any, cost one attribute test.
#   2. Finish (_Exchange.finish): the reservation becomes the tokens served (bounded as the
#      ledger books them), and the request leaves the in-flight counts.
#   3. Windows are 61 one-second buckets (the current second and the 60 before): a request counts
#      for at least a minute after it came, so no 60 s span ever holds more than the limit; at a
#      single ingress each limit is hit exactly at its number.
#   4. Cluster-wide: every FLOW_PUBLISH_S this ingress publishes its windows (the busiest
#      MAX_FLOW_SUBJECTS, when changed) as its "flow:<session>" entry; each ingress adds the other
#      sessions' latest to its own counts. What it cannot know is what the others admitted since
#      their last publish reached it, so over any minute a subject is admitted at most
#          limit + R * (FLOW_PUBLISH_S + d)
#      requests (or tokens), R its rate at the other ingresses, d the push's delay (ms on a LAN);
#      in flight likewise, R the arrival rate. A peer's counts are believed until it publishes
#      again (a window that drains is published as it drains) or for FLOW_STALE_S at most.
FLOW_PUBLISH_S = USAGE_PUBLISH_S   # the error bound's interval (above): half a second
FLOW_STALE_S = 90.0                # a peer's counts older than this are dropped (its window is a
                                   # minute: a session gone quiet or away holds nothing after it)
WINDOW_S = 60                      # the limits' window: per minute, as OpenAI's
PROMPT_CHARS_PER_TOKEN = 4         # OpenAI's own estimate for rate limits (characters / 4)
FLOW_RECORD_BYTES = crdt.MAX_RECORD_BYTES - 96   # room for the signature ("sig", 64 hex digits)
MAX_LOCAL_SUBJECTS = 65536         # windows kept here (limited keys, users, models, tenants): past
                                   # it the idle ones go first; ~1 KB each at most


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* write it: "20ms", "1s", "6m0s"."""
    if seconds < 1.0:
        return f"{max(0, int(seconds * 1000))}ms"
    whole = int(math.ceil(seconds))
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def limit_spec(spec: Mapping[str, Any]) -> Dict[str, int]:
    """rpm, tpm and concurrency from the admin API's JSON or the CLI's flags: whole numbers >= 0
    (0: none); ValueError with a one-line reason."""
    limits = {}
    for field in crdt.LIMIT_FIELDS:
        value = spec.get(field, 0)
        if value is None:
            value = 0
        if type(value) is not int or not 0 <= value < 2**53:
            raise ValueError(f"{field} must be a whole number >= 0 below 2^53 (0: none)")
        limits[field] = value
    return limits


class Window:
    """One subject's last minute here: one-second buckets [second, requests, tokens], their sums,
    its requests in flight, and the tokens served for it in all (the fair queue's counter)."""

    __slots__ = ("buckets", "requests", "tokens", "inflight", "served")

    def __init__(self):
        self.buckets: Deque[List[int]] = collections.deque()
        self.requests = self.tokens = self.inflight = self.served = 0

    def slide(self, second: int) -> None:
        buckets = self.buckets
        while buckets and buckets[0][0] <= second - (WINDOW_S + 1):
            _, requests, tokens = buckets.popleft()
            self.requests -= requests
            self.tokens -= tokens

    def add(self, second: int, tokens: int) -> None:
        buckets = self.buckets
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += 1
            buckets[-1][2] += tokens
        else:
            buckets.append([second, 1, tokens])
        self.requests += 1
        self.tokens += tokens
        self.inflight += 1

    def correct(self, second: int, delta: int) -> None:
        """A request of `second` served `delta` tokens more (or fewer) than reserved."""
        for bucket in reversed(self.buckets):
            if bucket[0] == second:
                delta = max(delta, -bucket[2])
                bucket[2] += delta
                self.tokens += delta
                return
            if bucket[0] < second:
                return   # slid out already: it counts no more

    def until_free(self, now: float, requests: int = 0, tokens: int = 0) -> float:
        """Seconds until `requests` requests and `tokens` tokens have left the window (0: all)."""
        freed_r = freed_t = 0
        for second, r, t in self.buckets:
            freed_r += r
            freed_t += t
            if freed_r >= requests and freed_t >= tokens and (requests or tokens):
                return max(0.0, second + WINDOW_S + 1 - now)
        return max(0.0, self.buckets[-1][0] + WINDOW_S + 1 - now) if self.buckets else 0.0

    def idle(self) -> bool:
        return not self.buckets and not self.inflight


class Ticket:
    """What one admitted request holds: its subjects' windows, its second and its reservation."""

    __slots__ = ("windows", "second", "reserved")

    def __init__(self, windows: List[Window], second: int, reserved: int):
        self.windows, self.second, self.reserved = windows, second, reserved


class ClusterFlow:
    """The limits of every subject and their windows, this ingress's and the others' (see above)."""

    def __init__(self, session_id: Callable[[], str], publish_entry: Callable[[str, Dict[str, Any]], None],
                 record_of: Callable[[str], Optional[Dict[str, Any]]], authority: Optional[crdt.Authority] = None):
        self.session_id = session_id           # our session's id: a rejoin makes a new one
        self.publish_entry, self.record_of = publish_entry, record_of   # the overlay's map
        self.active = False    # any user or model limit: requests then look theirs up
        self.limits: Dict[str, Dict[str, Any]] = {}   # subject -> its lim record (users', models')
        self.sites: Dict[str, Dict[str, Any]] = {}    # subject -> a model's lim record that names sites
        self.model_sites: Dict[str, frozenset] = {}   # model -> the sites its requests may be served at
        self.windows: Dict[str, Window] = {}          # subject -> its window here
        self.remote: Dict[str, List[int]] = {}        # subject -> the other sessions' sums
        self.peers: Dict[str, Dict[str, Any]] = {}    # flow entry id -> a peer's latest record
        self.refused: collections.Counter = collections.Counter()   # 429s by subject kind and type
        self._subjects: Dict[Tuple[str, str], str] = {}
        self._published: Dict[str, List[int]] = {}
        self._version = 0
        self._timer: Optional[asyncio.TimerHandle] = None
        # keys' settings entries go to the keys (ClusterKeys.use_flow), never into `limits`
        self.on_key_settings: Optional[Callable[[str, Dict[str, Any]], None]] = None
        self.use(authority)

    def use(self, authority: Optional[crdt.Authority]) -> None:
        """The subjects' key: the ingress tier's (a node without the secret: a local one, as
        nothing of the ingress plane leaves it then)."""
        self._key = authority.subject_key() if authority is not None else b"otela-local-subjects"
        self._subjects = {}

    def subject(self, kind: str, name: str) -> str:
        subjects = self._subjects
        found = subjects.get((kind, name))
        if found is None:
            if len(subjects) >= MAX_LOCAL_SUBJECTS:
                subjects.clear()
            found = subjects[(kind, name)] = crdt.subject_of(self._key, kind, name)
        return found

    # -- admission and finish (the request path) ---------------------------------------------
    def admit(self, key: Key, model: str, body: bytes, cap: Optional[int], client: Any) -> Optional[Ticket]:
        """Book a request on its subjects, its x-ratelimit-* lines onto its answer; None when
        nothing limits it. Raises HTTPError 429 when a subject has no room."""
        checks = []
        if key.limited:
            checks.append((self.subject("k", key.hash or key.id), key.rpm, key.tpm, key.concurrency, "key"))
        if self.active:
            for kind, name in (("u", key.user), ("m", model)):
                subject = self.subject(kind, name)
                record = self.limits.get(subject)
                if record is not None:
                    checks.append((subject, record.get("rpm", 0), record.get("tpm", 0),
                                   record.get("concurrency", 0), crdt.LIMIT_SUBJECTS[kind]))
        if not checks:
            return None
        now = time.time()
        second = int(now)
        reserved = (len(body) + PROMPT_CHARS_PER_TOKEN - 1) // PROMPT_CHARS_PER_TOKEN + (cap or 0)
        windows, heads = [], []
        for subject, rpm, tpm, concurrency, what in checks:
            window = self.windows.get(subject)
            if window is None:
                window = self.windows[subject] = Window()
            window.slide(second)
            remote = self.remote.get(subject) or (0, 0, 0, 0)
            requests, tokens = window.requests + remote[0], window.tokens + remote[1]
            if rpm and requests + 1 > rpm:
                self._refuse(what, "requests", f"{rpm} requests per minute", window.until_free(now, 1),
                             (rpm, rpm - requests, window, tpm, tokens))
            if tpm and tokens + reserved > tpm:
                if reserved > tpm:   # never fits: say so (OpenAI's "Request too large")
                    self.refused[(what, "tokens")] += 1
                    raise HTTPError(429, f"Request too large for this {what}: it reserves {reserved} tokens (its "
                                         f"length / {PROMPT_CHARS_PER_TOKEN} and max_tokens), over the limit of {tpm} "
                                         "tokens per minute. Ask for fewer max_tokens or send a shorter prompt.",
                                    "rate_limit_exceeded", etype="tokens")
                self._refuse(what, "tokens", f"{tpm} tokens per minute ({reserved} asked)",
                             window.until_free(now, 0, tokens + reserved - tpm), (rpm, rpm - requests, window, tpm, tokens))
            if concurrency and window.inflight + remote[2] + 1 > concurrency:
                self._refuse(what, "requests", f"{concurrency} requests in flight", 1.0,
                             (rpm, rpm - requests, window, tpm, tokens))
            windows.append(window)
            heads.append((rpm, rpm - requests - 1, window, tpm, tokens + reserved))
        for window in windows:
            window.add(second, reserved)
        client.conn.extra += self._lines(heads, now)
        return Ticket(windows, second, reserved)

    def _refuse(self, what: str, kind: str, limit: str, wait: float, head: tuple) -> None:
        self.refused[(what, kind)] += 1
        lines = [(b"retry-after", str(max(1, int(math.ceil(wait)))).encode())]
        lines += [tuple(line.split(b": ", 1)) for line in self._lines([head], time.time()).split(b"\r\n") if line]
        raise HTTPError(429, f"Rate limit reached for this {what}: {limit}. Please try again in "
                             f"{reset_text(wait)}.", "rate_limit_exceeded", etype=kind, headers=lines)

    @staticmethod
    def _lines(heads: List[tuple], now: float) -> bytes:
        """The x-ratelimit-* header lines: for requests and for tokens, the subject with the
        least room left (OpenAI's names; the reset: until the window is empty again)."""
        out = b""
        requests = [h for h in heads if h[0]]
        if requests:
            rpm, left, window = min(requests, key=lambda h: h[1])[:3]
            out += b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n" \
                   b"x-ratelimit-reset-requests: %s\r\n" % (rpm, max(0, left), reset_text(window.until_free(now)).encode())
        tokens = [h for h in heads if h[3]]
        if tokens:
            _, _, window, tpm, used = min(tokens, key=lambda h: h[3] - h[4])
            out += b"x-ratelimit-limit-tokens: %d\r\nx-ratelimit-remaining-tokens: %d\r\n" \
                   b"x-ratelimit-reset-tokens: %s\r\n" % (tpm, max(0, tpm - used), reset_text(window.until_free(now)).encode())
        return out

    @staticmethod
    def release(ticket: Ticket, served: int) -> None:
        """The request is over: its reservation becomes the `served` tokens, it leaves the
        in-flight counts."""
        delta = served - ticket.reserved
        for window in ticket.windows:
            window.inflight -= 1
            window.served += served
            if delta:
                window.correct(ticket.second, delta)

    # -- the fair queue's counter ---------------------------------------------------------------
    def note_service(self, tenant: str, tokens: int) -> None:
        """Tokens served here for a tenant of the fair queue (published with the windows)."""
        subject = self.subject("t", tenant)
        window = self.windows.get(subject)
        if window is None:
            window = self.windows[subject] = Window()
        window.served = max(0, window.served + int(tokens))   # (a count: >= 0, whole)

    def remote_service(self, tenant: str) -> int:
        """The tokens the other ingress sessions served for `tenant`, as they last published."""
        return (self.remote.get(self.subject("t", tenant)) or (0, 0, 0, 0))[3]

    def note_inflight(self, tenant: str, delta: int) -> None:
        """A request of a tenant went to (1) or left (-1) a priority-scheduling engine from here."""
        subject = self.subject("t", tenant)
        window = self.windows.get(subject)
        if window is None:
            window = self.windows[subject] = Window()
        window.inflight = max(0, window.inflight + delta)

    def remote_inflight(self, tenant: str) -> int:
        """The requests of `tenant` the other ingress sessions have at such engines now."""
        return (self.remote.get(self.subject("t", tenant)) or (0, 0, 0, 0))[2]

    # -- the map: limits and the others' flows --------------------------------------------------
    def on_entry(self, entry_id: str, record: Optional[Dict[str, Any]]) -> None:
        if record is None:
            return
        kind = crdt.kind_of(entry_id)
        if kind == crdt.LIMIT and entry_id.startswith(crdt.KEY_SETTINGS_ENTRY):
            if self.on_key_settings is not None:
                self.on_key_settings(entry_id, record)
        elif kind == crdt.LIMIT:
            subject = entry_id[len(crdt.LIMIT_ENTRY):]
            if any(record.get(f) for f in crdt.LIMIT_FIELDS):
                self.limits[subject] = record
            else:
                self.limits.pop(subject, None)   # cleared
            self.active = bool(self.limits)
            self._take_sites(subject, record)
        elif kind == crdt.FLOW and entry_id != crdt.flow_entry(self.session_id()):
            self._take_flow(entry_id, record)

    def _take_sites(self, subject: str, record: Dict[str, Any]) -> None:
        """A model's sites (Ingress.residency), as its entry now says (none: anywhere)."""
        old = self.sites.pop(subject, None)
        if old is not None:
            self.model_sites.pop(old["model"], None)
        if subject[0] == "m" and record.get("sites"):
            self.sites[subject] = record
            self.model_sites[record["model"]] = frozenset(record["sites"])

    def _take_flow(self, entry_id: str, record: Optional[Dict[str, Any]]) -> None:
        old = self.peers.pop(entry_id, None)
        if old is not None:
            self._add(old["n"], -1)
        if record is not None and record["at"] >= time.time() - FLOW_STALE_S:
            self.peers[entry_id] = record
            self._add(record["n"], 1)

    def _add(self, subjects: Dict[str, List[int]], sign: int) -> None:
        remote = self.remote
        for subject, counts in subjects.items():
            sums = remote.get(subject)
            if sums is None:
                sums = remote[subject] = [0, 0, 0, 0]
            for i in range(4):
                sums[i] += sign * counts[i]
            if not any(sums):
                del remote[subject]

    # -- the timer: publish ours, forget stale peers, drop idle windows ---------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(FLOW_PUBLISH_S, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(FLOW_PUBLISH_S, self._tick, loop)
        try:
            self.publish(time.time())
        except Exception as exc:   # a bug here must not stop the timer, nor the ingress
            print(f"otela-ingress: flow publish failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)

    def publish(self, now: float) -> None:
        """Our windows' counts, when they changed since the last time (the busiest first)."""
        second = int(now)
        counts = {}
        for subject, window in list(self.windows.items()):
            window.slide(second)
            if window.idle() and not window.served:
                del self.windows[subject]
                continue
            counts[subject] = [window.requests, window.tokens, window.inflight, window.served]
        for entry_id in [e for e, r in self.peers.items() if r["at"] < now - FLOW_STALE_S]:
            self._take_flow(entry_id, None)
        busiest = sorted(counts.items(), key=lambda kv: (-kv[1][0], -kv[1][2], -kv[1][1]))
        counts = dict(busiest[:crdt.MAX_FLOW_SUBJECTS])
        if counts == self._published:
            return
        entry_id = crdt.flow_entry(self.session_id())
        record = crdt.flow_record(self._version + 1, now, counts)
        while len(crdt.encode(record)) > FLOW_RECORD_BYTES:   # large counts: fewer subjects
            record["n"].popitem()
        self._published = counts
        self._version += 1
        self._write(entry_id, record)

    def _write(self, entry_id: str, record: Dict[str, Any]) -> None:
        try:
            self.publish_entry(entry_id, record)   # the overlay tells on_entry, as for any change
        except crdt.RecordError as exc:
            print(f"otela-ingress: not replicated: {exc}", file=sys.stderr)

    # -- the admin's side: set, list, clear ----------------------------------------------------
    def set_limit(self, kind: str, name: str, limits: Dict[str, int], at: float,
                  now: bool = True, sites: Sequence[str] = ()) -> Dict[str, Any]:
        """Publish a user's or a model's limits (all zero: cleared), and a model's `sites` (none:
        anywhere), as set at `at`; returns the admin's view. The version is `at` in milliseconds,
        so the latest setting wins at every ingress; one made `now` (the admin API) wins over
        whatever is held, and a CLI row read again (`now` False: a restart) changes nothing where
        a later setting is held."""
        subject = self.subject(kind, name)
        entry_id = crdt.limit_entry(subject)
        held = self.record_of(entry_id)
        version = int(at * 1000)
        if held is not None and held["version"] >= version:
            if not now:
                return self.view(subject, held, name)
            version = held["version"] + 1   # this clock is behind the last setter's
        record = crdt.limit_record(version, limits, name if kind == "m" else None, sites)
        crdt.validate(entry_id, record)   # a model name too long, a user's sites: refused here, not in the overlay
        self._write(entry_id, record)
        return self.view(subject, record, name)

    def set_key_settings(self, digest: str, settings: Dict[str, Any], now: bool = True) -> Dict[str, Any]:
        """Publish a key's settings (key_settings: versioned by when they were set), as set_limit
        a user's: one set `now` wins over whatever is held; one read again from the --db (`now`
        False) changes nothing where a later setting is held. Returns the record published or held."""
        entry_id = crdt.limit_entry(self.subject("k", digest))
        held = self.record_of(entry_id)
        if held is not None and held["version"] >= settings["version"]:
            if not now or held == settings:
                return held
            settings = dict(settings, version=held["version"] + 1)   # this clock is behind the last setter's
        crdt.validate(entry_id, settings)
        self._write(entry_id, settings)
        return settings

    @staticmethod
    def view(subject: str, record: Dict[str, Any], name: Optional[str]) -> Dict[str, Any]:
        kind = crdt.LIMIT_SUBJECTS[subject[0]]
        view = {"object": "rate_limit", kind: name, "subject": subject, **{f: record.get(f, 0) for f in crdt.LIMIT_FIELDS}}
        if record.get("sites"):   # (a model's; absent where none: anywhere, the shape before residency)
            view["sites"] = record["sites"]
        return view

    def listed(self, users: Iterable[str]) -> List[Dict[str, Any]]:
        """Every limit set (not cleared), users named where a key of theirs is known here (the
        entries carry no user name: see crdt, "Limits and flows")."""
        names = {self.subject("u", user): user for user in users}
        out = []
        for subject, record in sorted(dict(self.limits, **self.sites).items()):
            out.append(self.view(subject, record, record.get("model") if subject[0] == "m" else names.get(subject)))
        return out


# =============================================================================================
# Grants: what a compute job may serve, as the login node said
# =============================================================================================
# Theory of operation. A compute job holds the cluster key, so whatever its record says (models,
# labels, address) is its own word. The login node, which holds the ingress secret, issues each
# job a grant (`otela_ingress.py grant`, or the placer for the jobs it renders): the models it may
# serve, its labels, its Slurm job id and its end, signed; the job's records carry it and are
# bound under its key (crdt, "Records bound to their writers"), so an ingress's map holds only
# records their writers wrote. This section decides what routing believes of them:
#   - a session serves the models of its record that its grant names, and matches allowlists by
#     its grant's labels (and its session id) only;
#   - a session with no grant, an expired or revoked one, or a grant another live session holds
#     (one grant, one live session: the newest) gets nothing, and /v1/registry, /metrics and the
#     dashboard say why;
#   - a session's site (its label site=NAME, `--site-name`) is its grant's site label: a job's
#     record could claim any site, and a job claiming another site's name would draw what stays
#     at that site to itself (a key allowed only "site=b", and later the locality of routing);
#     a record's claim that differs from its grant's is shown beside it (site_claimed), never used;
#   - without an ingress secret nothing can be checked: every session is believed, as before
#     grants (the ingress says so at start). `--allow-ungranted` believes sessions without a grant
#     too: the upgrade's middle step, while jobs started before it still serve.
# Revocations (`otela_ingress.py grant revoke`) are entries of the ingress plane ("rev:<grant id>"
# or "rev:job-<id>"), signed like keys: the CLI writes them to the --db, the ingress that reads them
# publishes them, and every ingress applies them within a gossip round.
GRANT_POLL_S = 0.25          # the --db's revocations read this often: seen at every ingress within a
                             # second (a poll is one PRAGMA; a change, one small SELECT)
RECENTLY_SERVED_S = 600.0    # a model served this recently is absent, not unknown: 503 and
                             # Retry-After while no session of it is reachable, never 404
STARTING_RETRY_S = 30         # Retry-After for a catalogued model nothing serves yet: a cron pass, a
                              # queue wait and a model load are minutes; a client polls gently
DOUBT_S = 15.0               # an eviction of a session that answered here within this is doubted for
                             # as long: an evicted live node rejoins as a new session within a second
DOUBT_REASONS = {            # why an eviction is not believed here (EvictionDoubts), as /metrics says
    "answered": "the session answered here moments before",
    "unvouched": "no confirmer whose binding key this ingress derives vouched for it",
    "unverifiable": "only members whose word nothing here can check confirmed it (ungranted or "
                    "unknown here; believed with --allow-ungranted)",
}
ENDING_S = 120.0             # no new request to a session this close to its job's end (ends_at) while
                             # another serves: a stream started then (~3,600 tokens at 30/s) ends
                             # before Slurm's SIGTERM and the node's drain; at most the second half of
                             # its life (as the placer's successor lead): a successor of a short job is
                             # not ending beside its predecessor
UNGRANTED_REASONS = ("ungranted", "expired", "revoked", "grant_reused", "not_granted")


class Grants:
    """What this ingress believes of each session, from its grant (see above)."""

    def __init__(self, authority: Optional[crdt.Authority], allow_ungranted: bool = False):
        self.authority = authority
        self.believe_all = authority is None
        self.allow_ungranted = allow_ungranted
        self.revoked: set = set()            # grant ids and "job-<id>" revoked
        self.live: Dict[str, Dict[str, Tuple[bool, float]]] = {}   # grant id -> {live session: (serving, start)}
        self.grant_of: Dict[str, str] = {}   # live session -> its grant id
        self.holder: Dict[str, str] = {}     # grant id -> the one live session it serves
        self.served: Dict[str, float] = {}   # model -> when a session last could serve it (monotonic)
        self.loaded: Dict[str, str] = {}     # adapter -> its base, as an admin loaded it through here

    def use(self, authority: Optional[crdt.Authority]) -> None:
        """The ingress secret to check grants with (None: nothing can be checked)."""
        self.authority, self.believe_all = authority, authority is None

    def seen(self, sid: str, record: Optional[Dict[str, Any]]) -> None:
        """A session's record changed: keep each grant's live sessions and its holder."""
        grant = record.get("grant") if record is not None else None
        gid = grant.get("id") if isinstance(grant, dict) else None
        before = self.grant_of.pop(sid, None)
        if before is not None and before != gid:
            self._leave(before, sid)
        if gid is None:
            return
        if record["state"] in crdt.ROUTABLE or record["state"] == crdt.JOIN:
            sessions = self.live.setdefault(gid, {})
            sessions[sid] = (record["state"] in crdt.ROUTABLE, record.get("started", 0.0))
            self.grant_of[sid] = gid
            self._hold(gid, sessions)
        else:
            self._leave(gid, sid)

    def _hold(self, gid: str, sessions: Dict[str, Tuple[bool, float]]) -> None:
        """The grant's one live session: the newest that serves (else the newest): a job's
        successor, started under its slot's grant, takes over once its model is loaded, not
        while it loads (the slot's requests would have nowhere to go)."""
        self.holder[gid] = max(sessions, key=lambda s: (sessions[s], s))

    def _leave(self, gid: str, sid: str) -> None:
        sessions = self.live.get(gid, {})
        sessions.pop(sid, None)
        if sessions:
            self._hold(gid, sessions)
        else:
            self.live.pop(gid, None)
            self.holder.pop(gid, None)

    def refusal(self, sid: str, record: Dict[str, Any], now: float) -> Optional[str]:
        """Why no request goes to this session (one of UNGRANTED_REASONS), or None."""
        if self.believe_all:
            return None
        grant = record.get("grant")
        if not isinstance(grant, dict):
            return None if self.allow_ungranted else "ungranted"
        why = crdt.grant_refusal(grant, self.revoked, now)
        if why is not None:
            return why
        if self.holder.get(grant["id"], sid) != sid:
            return "grant_reused"
        return None

    def models(self, record: Dict[str, Any]) -> List[str]:
        """The models a session serves as far as routing believes: its record's, within its grant
        (none without a grant, unless such sessions are believed). An adapter counts where the grant
        names it, or where an admin loaded it on that base through this ingress: its name is
        otherwise the job's word, and a job granted a base could name its adapter after another
        group's model and be sent that model's prompts."""
        models = record.get("models") or ()
        grant = record.get("grant")
        if self.believe_all or (self.allow_ungranted and not isinstance(grant, dict)):
            return list(models)
        if not isinstance(grant, dict):
            return []
        granted, adapters = grant["models"], record.get("adapters") or {}
        return [m for m in models if m in granted or
                m in self.loaded and self.loaded[m] in granted and adapters.get(m, ("",))[0] == self.loaded[m]]

    def admits(self, allow: Sequence[str], sid: str, record: Dict[str, Any]) -> bool:
        """Whether a key's allowlist admits the session: by its grant's labels and its id (its
        record's owner and labels only where its word is all there is)."""
        if not allow:
            return True
        grant = record.get("grant")
        if self.believe_all or not isinstance(grant, dict):
            return allowed(allow, sid, record.get("owner"), record.get("labels") or {})
        return allowed(allow, sid, None, grant.get("labels") or {})

    def site(self, record: Dict[str, Any]) -> Optional[str]:
        """The site routing believes a session is at: its grant's site label (see above); its
        record's where its word is all there is (an ingress's own, or nothing is checked)."""
        grant = record.get("grant")
        if self.believe_all or not isinstance(grant, dict):
            return (record.get("labels") or {}).get(crdt.SITE_LABEL)
        return (grant.get("labels") or {}).get(crdt.SITE_LABEL)

    def on_revocation(self, entry_id: str) -> None:
        self.revoked.add(entry_id[len(crdt.REVOCATION_ENTRY):])

    def unrouted(self, sessions: Iterable[Tuple[str, Dict[str, Any]]]) -> Dict[str, str]:
        """Live worker sessions this ingress routes nothing to because of their grant -> why."""
        now = time.time()
        return {sid: why for sid, record in sessions if serving_worker(record)
                for why in (self.refusal(sid, record, now),) if why is not None}

    def was_served(self, model: str, now: float) -> bool:
        return now - self.served.get(model, -math.inf) < RECENTLY_SERVED_S


def grant_file(authority: crdt.Authority, models: Sequence[str], labels: Dict[str, str], job: str,
               until: float, now: float, key_file: str = "") -> bytes:
    """The file a job reads with `otela_node.py start --grant-file`: its grant, the grant's key
    and, where the cluster's TLS pair is beside `key_file`, a tunnel certificate of the job's own
    that the grant pins (an ingress then talks to that job alone, whoever else holds the pair)."""
    tls = None
    if key_file and otela_node.find_tunnel_tls(key_file)[0]:
        try:
            tls = otela_node.job_certificate(key_file, until, now)
        except otela_node.ConfigError as exc:   # the grant still binds the job's records
            print(f"otela-ingress: grant: no tunnel certificate of the job's own ({exc}): ingresses will "
                  "take any holder of the cluster's TLS pair at its address", file=sys.stderr)
    grant, key = authority.issue(models, labels, job, until, now,
                                 otela_node.certificate_fingerprint(tls[0]) if tls else None)
    data = {"grant": grant, "key": key.hex()}
    if tls:
        data.update(cert=tls[0].decode(), tls_key=tls[1].decode())
    return crdt.dumps(data) + b"\n"


def store_revocation(db: sqlite3.Connection, target: str, now: float) -> str:
    """Record a revocation in the --db (the ingress publishes it); returns its entry id."""
    entry_id = crdt.revocation_entry(target)
    db.execute("CREATE TABLE IF NOT EXISTS revocations (entry TEXT PRIMARY KEY, at REAL NOT NULL)")
    db.execute("INSERT OR IGNORE INTO revocations VALUES (?, ?)", (entry_id, now))
    return entry_id


def load_revocations(db: sqlite3.Connection) -> List[Tuple[str, float]]:
    db.execute("CREATE TABLE IF NOT EXISTS revocations (entry TEXT PRIMARY KEY, at REAL NOT NULL)")
    return [(row[0], row[1]) for row in db.execute("SELECT entry, at FROM revocations")]


# =============================================================================================
# Routing: the policy interface, the built-in policies, passive health
# =============================================================================================
# A client's conversation key, as a header: vllm-router's consistent_hash reads it first, and
# gateways (LiteLLM-style proxies, OpenRouter-style ones) send or accept it; the body's
# `prompt_cache_key` (OpenAI's) says the same and wins. Both reach the engine as sent.
AFFINITY_HEADER = b"x-session-id"
MAX_SESSION_KEY = 512   # bytes of a key hashed at most (a longer one is its first 512)


def rendezvous(key: bytes, sessions: Sequence[bytes]) -> int:
    """The index of the session `key` hashes highest with (rendezvous hashing): every ingress
    that sees the same sessions picks the same one, with no word exchanged, and a session
    joining or leaving moves only the keys it wins or held (1/N of them, N the sessions)."""
    return max(range(len(sessions)), key=lambda i: hashlib.blake2b(key + sessions[i], digest_size=8).digest())


def affinity_key(request: RoutedRequest) -> Optional[bytes]:
    """What keeps a conversation's turns together: the body's `prompt_cache_key` (a string),
    else the session header, else its opening (the messages up to its first user message, which
    every later turn repeats); None for a request with none of them (a bare prompt). `user` is
    not one: it names the end user, whose many conversations share no more than a system prompt,
    and one busy user would pin them all to one engine (OpenAI moved caching to prompt_cache_key)."""
    body = request.body if isinstance(request.body, dict) else {}
    given = body.get("prompt_cache_key")
    if isinstance(given, str) and given:
        return b"k" + given.encode("utf-8", "surrogatepass")[:MAX_SESSION_KEY]
    if request.session_key:
        return b"h" + request.session_key[:MAX_SESSION_KEY]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    opening = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                   len(messages) - 1)
    text = otela_node.prompt_text({"messages": messages[:opening + 1]})
    return b"o" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def earlier_turns(body: Any) -> Tuple[int, int]:
    """(bytes of the rendered prompt that its earlier turns sent and answered: the messages up to
    the last assistant message, what the engine that served the last turn holds; bytes of that
    last turn's own prompt, the messages before it). (0, 0) for a first turn or a bare prompt."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return 0, 0
    last = next((i for i in range(len(messages) - 1, -1, -1)
                 if isinstance(messages[i], dict) and messages[i].get("role") == "assistant"), -1)
    if last < 0:
        return 0, 0
    size, answer = (len(otela_node.prompt_text({"messages": m}).encode("utf-8", "surrogatepass"))
                    for m in (messages[:last + 1], messages[last:last + 1]))   # (rendered message by message)
    return size, size - answer


class Candidate:
    """A session that may serve a request: its id, its record and a hardware weight."""

    __slots__ = ("session", "session_bytes", "record", "addr", "weight", "pin", "by_priority")

    def __init__(self, session: str, record: Dict[str, Any]):
        self.session, self.session_bytes, self.record = session, session.encode(), record
        self.addr = record.get("addr", "")
        self.by_priority = record.get("scheduling") == "priority"   # its engine takes `priority` (FairQueue)
        self.weight = hardware_weight(record)
        grant = record.get("grant")   # the tunnel certificate its grant names (UpstreamPool.acquire)
        self.pin = grant.get("tls") if isinstance(grant, dict) else None

    def __repr__(self) -> str:
        return f"Candidate({self.session[:8]}, {self.addr}, w={self.weight:g})"


class RoutedRequest:
    """What a policy may look at: the model, the user, whether it streams, the attempt; the
    parsed request (`body`) for a policy whose `wants_body` is true; the client's session header
    (`session_key`: AFFINITY_HEADER's value, None without one); and, by on_request_end, what
    the answer said: its first streamed byte's time (`first_at`, None for a whole answer), its
    usage (`prompt_tokens`, `cached_tokens` as the engine reported them, `completion_tokens`; None
    when not reported). `memo` is the policy's own, kept across the request's attempts."""

    __slots__ = ("model", "user", "key_id", "stream", "path", "attempt", "started", "body", "memo",
                 "first_at", "prompt_tokens", "cached_tokens", "completion_tokens", "named", "session_key")

    def __init__(self, model: str, user: str, key_id: str, stream: bool, path: str,
                 started: Optional[float] = None, body: Optional[Dict[str, Any]] = None):
        self.model, self.user, self.key_id, self.stream, self.path = model, user, key_id, stream, path
        self.attempt, self.started = 0, time.monotonic() if started is None else started
        self.body, self.memo = body, None
        self.first_at = self.prompt_tokens = self.cached_tokens = self.completion_tokens = None
        self.named = model   # the model the client named (an alias, or one the request fell back from)
        self.session_key: Optional[bytes] = None   # the client's AFFINITY_HEADER, as sent


class Policy:
    """Routing policy interface. `--policy module:Class` loads a subclass (or any duck type).

    pick(candidates, request) -> Candidate: candidates is a non-empty list, already filtered
        (SERVING, unsuspected, serving the model, allowed by the key, not sick, not tried).
    on_request_start(candidate, request) / on_request_end(candidate, request, ok): bookkeeping;
        ok is False when the attempt failed and the request moved on to another session.
    Optional: `wants_body = True` (the request's parsed JSON in request.body); attach(ingress),
        called once with the ingress that uses it; stats() -> {session: {name: number}}, shown
        in /metrics and on the dashboard.
    """

    def pick(self, candidates: List[Candidate], request: RoutedRequest) -> Candidate:
        raise NotImplementedError

    def on_request_start(self, candidate: Candidate, request: RoutedRequest) -> None:
        pass

    def on_request_end(self, candidate: Candidate, request: RoutedRequest, ok: bool) -> None:
        pass


class RandomPolicy(Policy):
    def pick(self, candidates, request):
        return candidates[random.randrange(len(candidates))] if len(candidates) > 1 else candidates[0]


class RoundRobinPolicy(Policy):
    def __init__(self):
        self._next: Dict[str, int] = {}

    def pick(self, candidates, request):
        i = self._next.get(request.model, 0)
        self._next[request.model] = i + 1
        return candidates[i % len(candidates)]


# Relative decode speed by GPU: decode is memory-bound, so weights follow HBM bandwidth in
# TB/s (datasheets). Matched by substring of the declared GPU name, longest first.
GPU_WEIGHTS = {
    "MI300X": 5.3, "H200": 4.8, "H100": 3.35, "GH200": 4.0, "MI250X": 3.2, "A100-SXM4-80GB": 2.0,
    "A100": 1.55, "V100": 0.9, "L40S": 0.86, "L40": 0.86, "A40": 0.7, "A10": 0.6, "RTX 4090": 1.0,
    "L4": 0.3, "T4": 0.32,
}
CPU_WEIGHT = 0.05   # a CPU "engine" (the test's llama.cpp) is ~100x slower than a GPU


def hardware_weight(record: Dict[str, Any]) -> float:
    """Declared capacity if any, else GPU bandwidth x count."""
    capacity = record.get("capacity")
    if isinstance(capacity, (int, float)) and not isinstance(capacity, bool) and capacity > 0:
        return float(capacity)
    hardware = record.get("hardware") or {}
    gpu = str(hardware.get("gpu") or "").upper()
    count = hardware.get("count") or 1
    count = count if isinstance(count, (int, float)) and count > 0 else 1
    for name in sorted(GPU_WEIGHTS, key=len, reverse=True):
        if name in gpu:
            return GPU_WEIGHTS[name] * count
    return CPU_WEIGHT * count if not gpu or gpu == "CPU" else 1.0 * count


class HardwarePolicy(Policy):
    def pick(self, candidates, request):
        if len(candidates) == 1:
            return candidates[0]
        return random.choices(candidates, weights=[c.weight for c in candidates])[0]


class LeastLoadedPolicy(Policy):
    """Fewest outstanding requests from this ingress; ties broken at random."""

    def __init__(self):
        self.outstanding: Dict[str, int] = {}

    def pick(self, candidates, request):
        if len(candidates) == 1:
            return candidates[0]
        load = self.outstanding
        least = min(load.get(c.session, 0) for c in candidates)
        best = [c for c in candidates if load.get(c.session, 0) == least]
        return best[random.randrange(len(best))]

    def on_request_start(self, candidate, request):
        self.outstanding[candidate.session] = self.outstanding.get(candidate.session, 0) + 1

    def on_request_end(self, candidate, request, ok):
        left = self.outstanding.get(candidate.session, 0) - 1
        if left > 0:
            self.outstanding[candidate.session] = left
        else:
            self.outstanding.pop(candidate.session, None)


# The fields of a worker's record that change with its traffic (otela_node.publish_engine_view),
# the record's version and its binding (new at every write): a change in these alone leaves the
# candidates, and what the grants and evictions are, as they were.
VIEW_FIELDS = frozenset(("version", "load", "prefixes", "prefix_ends", "speed", "bind"))
MAX_SIGNATURES = 65536


class PrefixIndex:
    """What this ingress sent where, lately: block hash (otela_node.prompt_chain) -> the sessions
    it went to, each with whether a prompt sent there ended at that block (its whole prompt: a
    conversation that comes back with more is continued there). Bounded: `limit` hashes, the
    least recently sent dropped first (an engine's prefix cache drops its least recently used
    blocks too)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.where: collections.OrderedDict[bytes, Dict[str, bool]] = collections.OrderedDict()

    def match(self, chain: List[bytes], sessions: List[str]) -> Dict[str, Tuple[int, bool]]:
        """session -> (how many of the chain's first blocks went to it, whether a whole prompt
        sent there ended at the last of them); absent: none."""
        found: Dict[str, Tuple[int, bool]] = {}
        where = self.where
        for depth, h in enumerate(chain, 1):
            holders = where.get(h)
            if holders is None:
                break
            sessions = [s for s in sessions if s in holders]
            if not sessions:
                break
            for s in sessions:
                found[s] = (depth, holders[s])
        return found

    def add(self, chain: List[bytes], session: str) -> None:
        where, last = self.where, len(chain) - 1
        for i, h in enumerate(chain):
            holders = where.get(h)
            if holders is None:
                where[h] = {session: i == last}
            else:
                holders[session] = i == last or holders.get(session, False)
                where.move_to_end(h)
        while len(where) > self.limit:
            where.popitem(last=False)


class PublishedPrefixes:
    """What the sessions' nodes publish their engines were sent, from every ingress (their
    records' `prefixes`, the first `prefix_ends` of them ends of whole prompts:
    otela_node.PrefixSummary), as one map: anchor hash -> {session: whether a prompt ended
    there}. Kept as records change, a session's old anchors replaced by its new ones; bounded by
    the sessions (`limit`) and what each may publish."""

    def __init__(self, limit: int):
        self.limit = limit
        self.sessions: Dict[str, Tuple[Any, List[bytes]]] = {}   # session -> (its fields, anchors)
        self.where: Dict[bytes, Dict[str, bool]] = {}

    def update(self, session: str, record: Dict[str, Any]) -> None:
        fields = (record.get("prefixes"), record.get("prefix_ends"))
        old = self.sessions.get(session)
        if old is not None and old[0] == fields:
            return
        text, ends = fields
        self.forget(session)
        if not text:
            return
        if len(self.sessions) >= self.limit:
            self.sessions.clear()
            self.where.clear()
        anchors = list(otela_node.decode_prefixes(text))
        ends = ends if isinstance(ends, int) and not isinstance(ends, bool) else 0
        for i, h in enumerate(anchors):
            self.where.setdefault(h, {})[session] = i < ends
        self.sessions[session] = (fields, anchors)

    def forget(self, session: str) -> None:
        old = self.sessions.pop(session, None)
        if old is None:
            return
        where = self.where
        for h in old[1]:
            holders = where.get(h)
            if holders is not None:
                holders.pop(session, None)
                if not holders:
                    del where[h]

    def match(self, chain: List[bytes]) -> Dict[str, Tuple[int, bool]]:
        """session -> (the deepest of the chain's blocks whose anchor it published, whether a
        prompt ended there). The whole chain is read, one lookup a block (anchors are sparse:
        depths 1, 2, 4, …, and each prompt's end)."""
        found: Dict[str, Tuple[int, bool]] = {}
        where = self.where
        if not where:
            return found
        for depth, h in enumerate(chain, 1):
            holders = where.get(h)
            if holders:
                for s, whole in holders.items():
                    found[s] = (depth, whole)
        return found


SpeedFit = otela_node.SpeedFit   # (a node fits its own engine's speed the same way: EngineSpeed)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


class EngineKind:
    """What the sessions of one kind (a model on a hardware weight) share: the speed learned from
    all their answers (SpeedFit), and this ingress's requests in flight to them, of which the
    prompt tokens not yet answered with a first byte. The other ingresses' requests at an engine
    (its node's `load`) are counted as this ingress's are now, on average: a request in flight
    that much prefill still queued (measured this instant; while this ingress has none in flight,
    as it was lately). Not a prior learned from ended requests: one that moved only as answers
    ended (seconds of decoding after they began) made the engines that had answered first look
    cheaper than the rest, and two ingresses piled onto them."""

    __slots__ = ("fit", "queued", "outstanding", "lately")

    def __init__(self, fit: SpeedFit):
        self.fit = fit
        self.queued = 0.0
        self.outstanding = 0
        self.lately = 50.0   # queued tokens per request in flight (EWMA; a tenth of a 500-token prompt)

    def queued_per_request(self) -> float:
        return self.queued / self.outstanding if self.outstanding > 0 else self.lately


class EngineEstimate:
    """One session as this policy sees it: what it has queued from this ingress, what its answers
    reported, and what its kind shares (EngineKind)."""

    __slots__ = ("kind", "fit", "queued", "outstanding", "decoding", "prompt", "cached", "predicted", "trust",
                 "itl")

    def __init__(self, kind: EngineKind):
        self.kind, self.fit = kind, kind.fit
        self.queued = 0.0        # prompt tokens sent to it and not yet answered with a first byte
        self.outstanding = 0     # requests sent to it and not ended
        self.decoding = 0        # ... of which streams past their first byte
        self.prompt = self.cached = 0          # prompt and cached tokens its answers reported
        self.predicted = 0.0                   # ... and the cached tokens this policy expected of them
        self.trust = 1.0         # how much of a predicted cache hit its answers confirm (EWMA)
        self.itl = 0.0           # seconds per output token of its streams (EWMA)

    def ttft(self, prefill: float, streams: float) -> float:
        return self.fit.predict(prefill, streams)

    def change(self, queued: float, outstanding: int) -> None:
        """Add to its prompt tokens queued and requests outstanding (never below 0), and its kind's."""
        queued = max(queued, -self.queued)
        outstanding = max(outstanding, -self.outstanding)
        self.queued += queued
        self.outstanding += outstanding
        kind = self.kind
        kind.queued = max(0.0, kind.queued + queued)
        kind.outstanding = max(0, kind.outstanding + outstanding)
        if kind.outstanding:
            kind.lately += (kind.queued / kind.outstanding - kind.lately) * 0.05


class _Pick:
    """What TTFTPolicy keeps of one request across its attempts (RoutedRequest.memo)."""

    __slots__ = ("chain", "size", "keyed", "affinity", "opens", "earlier", "previous", "home", "moved", "session",
                 "work", "streams", "uncached", "held", "answering", "started", "path")

    def __init__(self, chain: List[bytes], size: int):
        self.chain, self.size = chain, size   # its prompt's block hashes, and its rendered bytes
        self.keyed = False                    # affinity and earlier read (only where there is a choice)
        self.affinity: Optional[bytes] = None # its affinity_key
        self.opens = False                    # ... a client's key this ingress had not seen lately
        self.earlier = self.previous = 0     # earlier_turns: answered, and the last turn's prompt
        self.home = -1                        # the candidate its affinity key names (-1: none)
        self.moved = False                    # ... and another is known to hold more of it, whole
        self.session = ""                     # the session of the attempt scored last
        self.work = self.uncached = 0.0       # ... the prefill it counted there, of which this prompt's
        self.streams = 0.0                    # ... and the streams it counted there
        self.held = 0                         # ... the prompt bytes it thought cached there
        self.path = 0.0                       # ... and the round trip of the path there (seconds)
        self.answering = False                # the attempt's first byte came
        self.started = 0.0                    # when the attempt started


class TTFTPolicy(Policy):
    """The session with the lowest estimated time to first token: the part of this prompt its
    engine has not cached (what this ingress sent it lately, PrefixIndex, and what its node
    publishes it was sent by anyone, `prefixes`), the work queued ahead of it (this ingress's
    requests not yet answered, other ingresses' from the node's published `load`) and the
    measured speed of its kind of engine (SpeedFit, from the answers, seeded by the node's
    published `speed`). A hot prefix spreads to a second engine once the queue at
    the first costs more than computing the prefix again. Among estimates within TIE of the
    best, the one holding the fewest requests (decode balance), and among those the one the
    prompt's first block hashes highest with (rendezvous hashing), so that ingresses that see
    none of each other's traffic tend to send a new prefix to the same engine.

    Locality: every estimate adds the round trip of the path from this ingress to the session,
    as this member's overlay measures it (Node.round_trip: its direct probes, through the relays
    for a relayed session, so a relayed path pays its relay legs), and the fit learns the engine's
    own time, the first byte's wait less that round trip. An engine at this ingress's site (a
    round trip under a millisecond) therefore wins unless another site's saves more queue and
    prefill than the crossing costs; no site is configured. A session not probed yet costs the
    farthest round trip measured among the candidates (a new session far away is not free).
    Where nothing is measured (a policy without an ingress) every path costs 0."""

    wants_body = True
    TIE = 0.02
    # A prefix computed again costs more than its time now: the engine's cache holds it twice,
    # and later requests split between two homes. A session that holds the prompt keeps it until
    # the queue there costs MISS_WEIGHT times the prompt's uncached time elsewhere.
    MISS_WEIGHT = 1.0
    # A conversation that comes back (its prompt holds a whole earlier prompt sent to a session)
    # is worth more there: its next turns will hold this one too, and chats are many and small,
    # so keeping each on its engine unbalances nothing (measured: multi-turn chat on 8 emulated
    # H100s, turn 2 of 125 chats stayed on its engine 78 times of 125 without it).
    CONTINUED_WEIGHT = 2.0
    # A conversation's own engine (the rendezvous choice of its affinity_key, which every ingress
    # makes alike) is kept while its score is within this share of the best: its turns meet their
    # prefix there even when the ingress that sent the last one never said so.
    AFFINITY_TIE = 0.25
    OPENED_KEYS = 65_536     # clients' keys and prompts' first blocks remembered (~9 MB each at most)
    INDEX_BLOCKS = 100_000   # ~25 MB at most
    MAX_ENGINES = 4096       # estimates kept before the sessions gone are forgotten

    def __init__(self):
        self.key = b""
        self.index = PrefixIndex(self.INDEX_BLOCKS)
        self.engines: Dict[str, EngineEstimate] = {}
        self.kinds: Dict[Tuple[str, float], EngineKind] = {}   # (model, hardware weight) -> its speed
        self.tokens_per_byte = 0.25   # prompt tokens per byte of rendered prompt (EWMA over answers)
        self.registry: Any = None
        self.published = PublishedPrefixes(self.MAX_ENGINES)   # what the nodes say their engines hold
        self.opened: collections.OrderedDict[bytes, None] = collections.OrderedDict()   # keys seen, oldest first
        self.openers: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # first block -> first key
        self.round_trip: Callable[[str], Optional[float]] = lambda session: None   # seconds, measured
        self._paths: tuple = (None, None, [])   # (candidates, round_trip, paths) last read

    def attach(self, ingress: Any) -> None:
        self.registry = getattr(ingress.node, "registry", None)   # records as they are now (VIEW_FIELDS)
        measured = getattr(ingress.node, "round_trip", None)      # the overlay's probes (read only)
        if callable(measured):
            self.round_trip = measured
        config = getattr(ingress.node, "config", None)   # the ingress tier's secret: nodes cannot hash
        tier = getattr(config, "ingress_keys", None)      # prompts as the ingresses do (see prefix_line)
        key = tier[0] if tier else getattr(config, "key", None)
        self.key = otela_node.prefix_key(key if isinstance(key, bytes) else secrets.token_bytes(32))

    def _engine(self, candidate: Candidate, model: str) -> EngineEstimate:
        est = self.engines.get(candidate.session)
        if est is None:
            if len(self.engines) >= self.MAX_ENGINES:
                self.stats()   # forgets the sessions gone
            name = (model, candidate.weight)
            kind = self.kinds.get(name)
            if kind is None:
                if len(self.kinds) >= self.MAX_ENGINES:
                    self.kinds.clear()
                speed = candidate.record.get("speed")   # what its node measured, when it says
                prefill = speed.get("prefill") if isinstance(speed, dict) else None
                kind = self.kinds[name] = EngineKind(SpeedFit(candidate.weight,
                                                              prefill if _positive(prefill) else None))
            est = self.engines[candidate.session] = EngineEstimate(kind)
        return est

    def _prompt(self, request: RoutedRequest) -> _Pick:
        memo = request.memo
        if memo is None:
            text = otela_node.prompt_text(request.body) if isinstance(request.body, dict) else ""
            chain = otela_node.prompt_chain(text, self.key) if text else []
            memo = request.memo = _Pick(chain, len(text.encode("utf-8", "surrogatepass")))
        return memo

    def paths(self, candidates: List[Candidate]) -> List[float]:
        """The round trip to each candidate in seconds (see Locality above), read again for each
        list of candidates (the ingress's list of a model's is rebuilt at least every
        CANDIDATE_TTL_S: probes take about as long to move a round trip)."""
        held = self._paths
        if held[0] is candidates and held[1] is self.round_trip:
            return held[2]
        measured = [self.round_trip(c.session) for c in candidates]
        measured = [float(t) if _positive(t) or (t == 0 and not isinstance(t, bool)) else None for t in measured]
        farthest = max((t for t in measured if t is not None), default=0.0)
        paths = [farthest if t is None else t for t in measured]
        self._paths = (candidates, self.round_trip, paths)
        return paths

    def estimates(self, candidates: List[Candidate],
                  request: RoutedRequest) -> List[Tuple[float, float, float, float, int, int, float]]:
        """Per candidate: (its score: the estimated TTFT in seconds, the path's round trip
        included, plus MISS_WEIGHT x the time of the prompt's uncached part, the prefill counted
        in prompt tokens, the streams counted, this prompt's uncached tokens there, blocks of the
        prompt it is thought to hold, the requests it holds from every ingress, the path's round
        trip)."""
        memo = self._prompt(request)
        chain = memo.chain
        matched = self.index.match(chain, [c.session for c in candidates]) if chain else {}
        tpb, block = self.tokens_per_byte, otela_node.PREFIX_BLOCK_CHARS
        out = []
        registry, published = self.registry, self.published
        model = request.model
        records = []
        if len(published.sessions) >= published.limit:
            self.stats()   # forgets the sessions gone
        for c in candidates:
            record = (registry.get(c.session) if registry is not None else None) or c.record
            published.update(c.session, record)
            records.append(record)
        summary = published.match(chain) if chain else {}
        memo.home = -1
        if len(candidates) > 1 and not memo.keyed:   # (one candidate: nothing to keep together)
            memo.keyed, memo.affinity = True, affinity_key(request)
            memo.opens = self._opens(memo.affinity, chain[0] if chain else None)
            memo.earlier, memo.previous = earlier_turns(request.body)
        if memo.affinity is not None and len(candidates) > 1:
            memo.home = home = rendezvous(memo.affinity, [c.session_bytes for c in candidates])
            # where another ingress sent its earlier turns, unless this one knows where the last
            # of them ended (a prompt that ended shallower is older news: the conversation moved on)
            earlier, previous = min(memo.earlier // block, len(chain)), memo.previous // block
            if earlier and not any(whole and depth >= previous for views in (matched, summary)
                                   for depth, whole in views.values()):
                matched[candidates[home].session] = (earlier, True)
        deepest = [0, 0]   # the deepest whole prompt held: at the home, elsewhere
        paths = self.paths(candidates)
        for n, (c, record) in enumerate(zip(candidates, records)):
            est = self._engine(c, model)
            blocks, whole = matched.get(c.session, (0, False))
            seen = summary.get(c.session)
            if seen is not None and seen[0] >= blocks:   # the deeper of what it was sent by anyone
                blocks, whole = seen[0], seen[1] or (whole and seen[0] == blocks)
            if whole:
                deepest[n != memo.home] = max(deepest[n != memo.home], blocks)
            uncached = max(0.0, memo.size - blocks * block * est.trust) * tpb
            load = record.get("load")
            others = max(0, load - est.outstanding) if isinstance(load, int) and not isinstance(load, bool) else 0
            work = est.queued + others * est.kind.queued_per_request() + uncached
            streams = est.decoding + others
            held = (memo.size * tpb - uncached) if whole else 0.0   # a conversation continued here
            out.append((est.ttft(work, streams) + paths[n] + est.fit.theta[1] * (self.MISS_WEIGHT * uncached -
                                                                                 self.CONTINUED_WEIGHT * held),
                        work, streams, uncached, blocks, est.outstanding + others, paths[n]))
        memo.moved = deepest[1] > deepest[0]
        return out

    def _opens(self, key: Optional[bytes], first: Optional[bytes]) -> bool:
        """Whether a request opens a conversation (see _keeps_home): a client's key new here (not
        among the last OPENED_KEYS seen) on a prompt whose first block came here first with
        another key (a system prompt that many conversations share); both now seen."""
        if key is None or key[:1] == b"o":
            return False
        digest = hashlib.blake2b(key, digest_size=16).digest()
        opened, openers = self.opened, self.openers
        new = digest not in opened
        opened[digest] = None
        opened.move_to_end(digest)
        shared = False
        if first is not None:
            owner = openers.setdefault(first, digest)
            openers.move_to_end(first)
            shared = owner != digest
        for seen in (opened, openers):
            if len(seen) > self.OPENED_KEYS:
                seen.popitem(last=False)
        return new and shared

    def pick(self, candidates, request):
        scored = self.estimates(candidates, request)
        i = 0
        home = request.memo.home
        if len(candidates) > 1:
            best = min(s[0] for s in scored)
            near = [i for i, s in enumerate(scored) if s[0] <= best + abs(best) * self.TIE + 1e-6]
            i = near[0]
            memo = request.memo   # (a lone prompt under one block has nothing worth keeping together)
            if home >= 0 and (memo.chain or memo.earlier) and self._keeps_home(candidates, scored, home, request):
                near = [home]   # the conversation's own engine, while it is about as good as the best
                i = home
            if len(near) > 1:   # the most of this prompt held (a tie is no reason to move a chat)
                most = max(scored[i][4] for i in near)
                near = [i for i in near if scored[i][4] == most]
                i = near[0]
            if len(near) > 1:   # the fewest requests held (their decoding slows every token there)
                fewest = min(scored[i][5] for i in near)
                near = [i for i in near if scored[i][5] == fewest]
                i = near[0]
            if len(near) > 1:
                chain = request.memo.chain
                if chain:
                    i = near[rendezvous(chain[0], [candidates[i].session_bytes for i in near])]
                else:
                    i = near[random.randrange(len(near))]
        choice, memo = candidates[i], request.memo
        _, memo.work, memo.streams, memo.uncached, blocks, _, memo.path = scored[i]
        memo.session, memo.held = choice.session, blocks * otela_node.PREFIX_BLOCK_CHARS
        return choice

    def _keeps_home(self, candidates: List[Candidate], scored: List[Tuple[float, float, float, float, int, int, float]],
                    home: int, request: RoutedRequest) -> bool:
        """Whether the affinity key's engine is about as good as the best. A key the client
        gave (it says its requests belong together: their prefix is computed there once) keeps
        a conversation's later turn there within AFFINITY_TIE by the queue alone, unless the
        conversation is known to have moved to another engine (which holds a whole turn of it
        deeper). So does a request that opens a conversation (_opens: a key new here, on a
        system prompt another key brought first), by the queue and its own prompt counted
        whole at every engine: it decides where the turns to come, most of the conversation's
        work, are computed, and keys spread over the engines as hashing does, where the engine
        holding the shared system prompt (the score's choice: one prefill saved) drew every
        loop of an app (measured: 11 of 24 agent loops opened on one of 8 engines, its queue
        the TTFT p99). (The prompt counted keeps the margin as wide as a first turn's tie by
        the score was: by the queue alone more openings left their key's engine, for one the
        next turn's ingress did not know.) Any other request without earlier turns (a key's
        own group of one-shot prompts, the first on its prefix or a later one) is scored as an
        unkeyed one is: where the prefix is held and the decode balance spread such groups
        more evenly than hashing (a shared prefix workload held at its keys' engines hit 0.71
        of prompt tokens, scored 0.79). Without a client's key a later turn keeps it within
        AFFINITY_TIE by the score (what is cached where counts), and a first turn or a lone
        request goes there on a tie only (TIE)."""
        memo = request.memo
        if memo.affinity[:1] != b"o" and (memo.earlier or memo.opens) and not memo.moved:
            whole = 0.0 if memo.earlier else memo.size * self.tokens_per_byte   # an opening: as if held nowhere
            queues = [self.engines[c.session].ttft(s[1] - s[3] + whole, s[2]) + s[6]   # (a far site's crossing
                      for c, s in zip(candidates, scored)]                              # counts as its queue)
            return queues[home] <= min(queues) * (1 + self.AFFINITY_TIE) + 1e-6
        best = min(s[0] for s in scored)
        return scored[home][0] <= best + abs(best) * (self.AFFINITY_TIE if memo.earlier else self.TIE) + 1e-6

    def on_request_start(self, candidate, request):
        memo = request.memo
        if memo is None or memo.session != candidate.session:   # not our pick: scored now
            self.pick([candidate], request)
            memo = request.memo
        est = self._engine(candidate, request.model)
        est.change(memo.uncached, 1)
        memo.answering, memo.started = False, time.monotonic()
        if memo.chain:
            self.index.add(memo.chain, candidate.session)

    def on_first_byte(self, candidate, request):
        memo, est = request.memo, self.engines.get(candidate.session)
        if memo is None or est is None or memo.answering or memo.session != candidate.session:
            return
        memo.answering = True
        est.change(-memo.uncached, 0)
        est.decoding += 1

    def on_request_end(self, candidate, request, ok):
        memo, est = request.memo, self.engines.get(candidate.session)
        if memo is None or est is None or memo.session != candidate.session or not memo.started:
            return
        now = time.monotonic()
        if memo.answering:
            est.change(0.0, -1)
            est.decoding = max(0, est.decoding - 1)
        else:
            est.change(-memo.uncached, -1)
        if not ok:
            return
        prompt, cached = request.prompt_tokens, request.cached_tokens
        if prompt and memo.size:
            self.tokens_per_byte += (min(prompt / memo.size, 4.0) - self.tokens_per_byte) * 0.05
        uncached = memo.uncached
        if prompt and cached is not None:
            uncached = max(prompt - cached, 0)
            est.prompt += prompt
            est.cached += cached
            expected = memo.held * self.tokens_per_byte
            if expected > 0:
                est.predicted += expected
                est.trust += (min(cached / expected, 1.0) - est.trust) * 0.1
        first, started = request.first_at, memo.started
        if first is not None and first >= started:
            ttft = max(0.0, first - started - memo.path)   # the engine's own time: the crossing is the path's
            done = request.completion_tokens
            if done and done > 1 and now > first:
                est.itl += ((now - first) / (done - 1) - est.itl) * 0.1
            est.fit.learn(memo.work - memo.uncached + uncached, memo.streams, ttft)
        elif first is None:   # a whole answer: its first token came no later than its end
            est.fit.bound(memo.work - memo.uncached + uncached, max(0.0, now - started - memo.path))

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per session this ingress routed to and still in the registry: its answers' prompt and
        cached tokens, the cache hit rate they make, the queue and the estimates."""
        registry = self.registry
        if registry is not None:   # sessions gone from the registry (or LEFT) are forgotten
            for session in [s for s, est in self.engines.items()
                            if not est.outstanding and (registry.get(s) or {}).get("state") in (None, crdt.LEFT)]:
                del self.engines[session]
            for session in [s for s in self.published.sessions
                            if (registry.get(s) or {}).get("state") in (None, crdt.LEFT)]:
                self.published.forget(session)
        out = {}
        for session, est in self.engines.items():
            out[session] = {
                "prompt_tokens": est.prompt, "cached_tokens": est.cached,
                "cache_hit_rate": est.cached / est.prompt if est.prompt else 0.0,
                "queued_prompt_tokens": est.queued, "outstanding": est.outstanding,
                "ttft_estimate_seconds": est.ttft(est.queued, est.decoding),
                "prefill_tokens_per_second": 1.0 / est.fit.theta[1],
                "ttft_base_seconds": est.fit.theta[0], "ttft_per_stream_seconds": est.fit.theta[2],
                "decode_tokens_per_second": 1.0 / est.itl if est.itl > 0 else 0.0,
                "round_trip_seconds": self.round_trip(session) or 0.0}
        return out


POLICIES = {"random": RandomPolicy, "round_robin": RoundRobinPolicy, "hardware": HardwarePolicy,
            "least_loaded": LeastLoadedPolicy, "ttft": TTFTPolicy}


def job_ending(record: Dict[str, Any], now: float) -> bool:
    """Whether a session is inside its job's last ENDING_S (its record's ends_at, unix time), or
    in the second half of its life where that is shorter."""
    ends = record.get("ends_at")
    if not isinstance(ends, (int, float)):
        return False
    started = record.get("started")
    window = min(ENDING_S, (ends - started) / 2) if isinstance(started, (int, float)) else ENDING_S
    return ends - now < window


def serving_worker(record: Dict[str, Any]) -> bool:
    """A worker session whose lifecycle state takes requests (crdt.ROUTABLE, from its table)."""
    return record.get("state") in crdt.ROUTABLE and record.get("role", "worker") == "worker"


def load_policy(spec: str) -> Policy:
    """A built-in name, or `module:Class` for a user's own (importable from sys.path or the
    current directory)."""
    if spec in POLICIES:
        return POLICIES[spec]()
    module_name, colon, class_name = spec.partition(":")
    if not colon or not module_name or not class_name:
        raise ValueError(f"unknown policy {spec!r}: use one of {', '.join(POLICIES)} or module:Class")
    if os.getcwd() not in sys.path:   # a policy file beside where the user runs the ingress
        sys.path.append(os.getcwd())
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {spec!r}: {exc}") from exc
    policy = cls()
    if not callable(getattr(policy, "pick", None)):
        raise ValueError(f"policy {spec!r} has no pick(candidates, request) method")
    for hook in ("on_request_start", "on_request_end"):
        if not callable(getattr(policy, hook, None)):
            setattr(policy, hook, lambda *args: None)
    return policy


class PassiveHealth:
    """Sessions that keep failing here, whatever their health checks say, sit out a while.

    Two failures in a row put a session out of this ingress's rotation for SICK_BACKOFF_S; when
    that runs out it is probed back in by the next request (retried elsewhere if it fails, so
    the client never pays for the probe); each relapse doubles the time out, any success ends it.
    Failures count against the path they happened on (the session's address then): once its
    record names another (a private node's relayed address), they count no more (`moved`).
    """

    def __init__(self, limits: Optional[Limits] = None):
        self.limits = limits or Limits()   # (sick_after_failures, sick_backoff_s, sick_backoff_max_s)
        self.failures: Dict[str, int] = {}
        self.backoff: Dict[str, float] = {}
        self.sick_until: Dict[str, float] = {}
        self.paths: Dict[str, str] = {}   # session -> the address its failures were on
        self.answered: Dict[str, float] = {}   # session -> when it last answered here (monotonic)

    def failed(self, session: str, now: float, path: str = "") -> None:
        if self.paths.get(session, path) != path:   # the first failure on a new path
            self.succeeded(session)
        self.paths[session] = path
        count = self.failures.get(session, 0) + 1
        self.failures[session] = count
        limits = self.limits
        if count >= limits.sick_after_failures:
            backoff = self.backoff.get(session, limits.sick_backoff_s / 2) * 2
            backoff = min(backoff, limits.sick_backoff_max_s)
            self.backoff[session] = backoff
            self.sick_until[session] = now + backoff

    def succeeded(self, session: str, now: Optional[float] = None) -> None:
        if now is not None:
            if len(self.answered) >= 65536:   # bounded: sessions that answered lately
                self.answered.clear()
            self.answered[session] = now
        if session in self.failures:
            del self.failures[session]
            self.backoff.pop(session, None)
            self.sick_until.pop(session, None)
            self.paths.pop(session, None)

    def moved(self, session: str, path: str) -> None:
        """The session's record names `path` now: failures on another path are forgotten."""
        if self.paths.get(session, path) != path:
            self.succeeded(session)

    def is_sick(self, session: str, now: float) -> bool:
        until = self.sick_until.get(session)
        return until is not None and now < until

    def sick(self, now: float) -> List[str]:
        return [s for s, until in self.sick_until.items() if now < until]

    def healthy(self, candidates: List[Candidate]) -> List[Candidate]:
        """The candidates not out of rotation for failing (all of them if every one is)."""
        if not self.sick_until:
            return candidates
        now = time.monotonic()
        return [c for c in candidates if not self.is_sick(c.session, now)] or candidates


# =============================================================================================
# Fair queue: requests wait at the ingress, in weighted fair order, while engines are saturated
# =============================================================================================
# When the session the policy picks for a request is full (FairQueue.full: the prefill queued at
# its engine would take over QUEUE_WAIT_S, or this ingress has QUEUE_SESSION_DEPTH requests there),
# the request waits here instead of joining the engine's first-come-first-served queue, and so
# does every request that arrives while others wait (none overtakes them on the fast path).
# Waiting requests go out (Ingress.dispatch_waiting: after each finished request, and every
# QUEUE_TICK_S while any waits) in this order:
#
#   1. class: interactive, then standard, then batch (PRIORITY_RANK); a class rises one class per
#      QUEUE_AGE_S its oldest request has waited, so none waits behind a higher class forever. The
#      whole class rises, not the old request alone: within a class the order stays by share, and
#      a flood's backlog, old by then, does not overtake a newcomer of its own class (measured,
#      bench_tenants --duration 30: B's TTFT p99 3.6x unloaded, 43x when a request rose alone);
#   2. within a class, the tenant (a key's user) with the least service: its virtual token counter,
#      tokens served divided by its weight (VTC, "Fairness in Serving LLMs", OSDI '24: prompt
#      tokens charged as a request goes out, output tokens and the prompt's true count at its
#      end). A tenant that starts waiting is lifted to the least counter among those waiting, so
#      service it did not ask for while idle is no credit, and to the counter of the last tenant
#      served when none waits. What other ingresses served it counts as if served here: each
#      ingress publishes its tenants' service (the `t` subjects of ClusterFlow's flow entries,
#      every FLOW_PUBLISH_S) and adds to a tenant's counter what the others' total GREW by since
#      it last looked (`heard`). Only the growth: the total is cumulative since each peer
#      started, and added whole to a counter that is lifted it would charge a tenant forever for
#      service it had long before it waited (and a peer restarting, its total falling, is no
#      credit either). So the counter means the same at every ingress: service since the
#      tenant's lift, wherever given. Its error: a peer's service is heard FLOW_PUBLISH_S + d
#      late, so a tenant served at rate R elsewhere is ahead of its true counter by at most
#      R x (FLOW_PUBLISH_S + d) tokens, and the shares over a window of W seconds are off by at
#      most (FLOW_PUBLISH_S + d) / W of the capacity per ingress (0.5 s in 30 s: under 2 %);
#   3. within a tenant and class, a conversation's next turn (its body holds an assistant message:
#      an agent's tool call coming back) before the tenant's first turns and bare prompts, then
#      first come first served. An agent's turn comes seconds after its answer, while the engine
#      that served it still holds the conversation's KV; behind the tenant's cold requests it
#      would wait while their prefill pushes that KV out of the engine's cache, and its whole
#      context be computed again. A cold request goes back to first come first served once it
#      has waited QUEUE_AGE_S (a tenant replaying transcripts cannot hold its own first turns
#      back forever), and other tenants' order is not touched (the share decides first).
#      It holds while a flood's backlog is shorter than QUEUE_AGE_S (bench_routing's warm case).
#
# Where a session's engine schedules by priority (its record says `scheduling: priority`, and
# every session a request may try does), the body's `priority` says more than the class: the
# engine's queue, not only this one, is ordered by share. Its number (engine_priority) is the
# class's base (ENGINE_PRIORITY, bands ENGINE_PRIORITY_SPREAD wide, so a class never overtakes a
# higher one) plus the tenant's standing: the bit length of its requests now in flight at such
# engines (this ingress's and, as published, the others'), divided by its weight, capped to the
# band. Not the VTC counter: a newcomer is lifted to the flood's counter, and the flood's queued
# requests were sent with counters below it, so they would keep their place. By requests in
# flight, a tenant holding none (a newcomer) sends at the band's base and overtakes a flood that
# holds 100 (base + 7) at the engine, which then preempts the least urgent (the flood's) when
# its memory runs out; two floods end at the cap and share the engine first come first served,
# as the order here shares what is sent. The scale is logarithmic so the numbers stay in a band
# of 10 whatever the load. With newcomers served first there, such a session could hold more
# of a flood (its own bound, QUEUE_PRIORITY_WAIT_S); measured, a looser one fills the engine's
# running batch and costs the newcomers more than the flood gains (see the knob), so it is as
# tight as QUEUE_WAIT_S by default. What priority scheduling does buy: a request of a tenant
# with fewer than ENGINE_PRIORITY_FIRST requests at such engines (so at most its class's base + 1
# there) and none waiting here does not wait here at all (FairQueue.overtakes): it goes at once
# and the engine runs it before the flood's queued requests, so a newcomer waits neither here
# nor there. It adds at most ENGINE_PRIORITY_FIRST requests per tenant (weighted) to an engine,
# and never past QUEUE_SESSION_DEPTH; within a tenant it keeps first come first served (a tenant
# with requests waiting here waits too).
#
# Running slots (QUEUE_SESSION_SLOTS, off by default): while two tenants or more hold requests from
# here or wait here (contended), a session is full too when this ingress has that many requests
# in flight there, decoding or not. Past them, and past the prefill bound, a request goes at once
# (overtakes, at any engine; up to QUEUE_SESSION_DEPTH) when its tenant waits here for none and
# holds fewer requests in flight from here (`held`, kept only while slots are on) than
# ENGINE_PRIORITY_FIRST or, contended, than its share of the slots (slot_share: the slots of the
# model's sessions by weight among the tenants present). So a flood holds what the others leave
# of the slots, and a tenant below its share neither waits here nor finds the engine's batch
# full of the flood. Why by count: a newcomer's TTFT is the steps it shares with what the engine
# carries (the flood's prefill chunks and decodes), not only the prefill queued ahead of it, and
# a request that waits here for the prefill bound waits twice (here, then behind the bound
# there). Measured straight at the engines (bench_tenants frontier: A holding c requests per
# engine, a closed loop) a newcomer's p99 is 1.3x its unloaded one at c = 1-2 (A gets 0.15-0.3 of
# the capacity left), 2.2x at c = 4 (0.42), 4x at c = 8 (0.77), whatever the engine's priority:
# the floor for an admission that only counts requests. With the slots the ingress does better
# than that closed loop (the flood's next prompts come as the prefill bound lets them, not in
# bursts as its requests end): 16 per session kept B and C at 1.3-1.9x with A at 0.68-0.72 (--quick,
# three runs; off: 2.7-3.4x at 0.57-0.61), but a count that fits 16-token answers starves 128-token
# ones (see the knob): what a session can run at once is not learned here yet, so it is off.
# Alone, a tenant goes past no bound for its share: the slots are there to protect one tenant
# from another, and an ingress that sees only a flood spread over several ingresses holds it by
# the prefill bound (measured: that share let the flood's half at a second ingress fill the
# engines, B 8.8x). So with the flood spread over two ingresses the one that sees it alone does
# not count slots, and B and C were no better than with the slots off (5-6x at 0.71-0.95 of the
# capacity, off 4.4-4.5x at 0.84): the tenants present at other ingresses are not heard here.
#
# The guard (QUEUE_GUARD_WAIT_S, off by default): a newcomer's TTFT beside a flood is the steps it
# shares with the flood's prefill (a decode of a memory-bound model costs little per sequence
# more; a prompt's tokens are compute). So while a tenant with none waiting here (below its
# share: it is sent all it asks) has requests in flight from here, a tenant with more than one
# waiting goes to a session only where the prompts this ingress sent it that await their first
# token come to under QUEUE_GUARD_WAIT_S of prefill (FairQueue.guarded; below one prompt: one at a
# time): the flood keeps its running batch, its decodes go on, but its next prompt goes after
# the newcomer's first token, and a newcomer finds at most one of the flood's prompts ahead of it,
# not QUEUE_WAIT_S of them. A first byte then dispatches at once (not at the next tick). And such
# a tenant goes at once (overtakes) while it holds fewer of the requests in flight from here
# than its weighted share of them (held_share), past the prefill bound the flood keeps full. The
# requests in flight per tenant (`held`) are counted while guarding, as for the slots; off, the
# path does no more. A guard lasts to the first byte: a whole answer (not streamed) guards its
# session to its end, one of the flood's prompts at a time there. Off by default: it halves B's
# and C's TTFT p99 beside a flood with chat-length answers and gives the flood more, but does not
# reach 1.5x of A-absent, and with 16-token answers it is no better beyond the spread between runs
# (tests/bench_tenants.py's docstring has the figures).
#
# A request whose model's sessions are all full is passed over, not the queue: others' models go
# on. Waiting is bounded in count and bytes, per key and overall, and in time (QUEUE_*): past a
# bound the request gets 429 with Retry-After. A client that leaves while waiting is removed at
# once (its connection's `waiting` is cancelled) and counted as a client abort, with no ledger
# row (it was never served). A retry or a stream's continuation never waits again: they are
# attempts of a request already dispatched (_Exchange), not new requests.
class Waiting:
    """One request waiting in the FairQueue: what sending it needs (`send`, called with nothing
    when it goes out), its tenant, class and size. `cancel` (its client went away) removes it."""

    __slots__ = ("queue", "send", "key", "tenant", "rank", "since", "size", "model", "client", "lane", "ticket",
                 "cold")

    def __init__(self, queue: FairQueue, send: Callable[[], Optional[bool]], key: Key, rank: int, since: float,
                 size: int, model: str, client: Any, ticket: Optional[Ticket] = None, warm: bool = False):
        self.queue, self.send, self.key, self.tenant, self.rank = queue, send, key, key.user, rank
        self.since, self.size, self.model, self.client = since, size, model, client
        self.lane: Optional[collections.deque] = None
        self.ticket = ticket   # its booking in the limits' windows, handed to its exchange when it goes
        self.cold = not warm   # not a conversation's next turn (FairQueue.order: warm turns first)

    def cancel(self) -> None:
        if self.lane is not None:
            self.queue.remove(self)
            self.queue.aborted[self.tenant] += 1
        self.unbook()

    def unbook(self) -> None:
        """It will not be served: out of its limits' windows (nothing served, in flight no more)."""
        if self.ticket is not None:
            ClusterFlow.release(self.ticket, 0)
            self.ticket = None


class FairQueue:
    """The requests waiting at this ingress, and the fair share of service between tenants (see
    above). Pure bookkeeping with a clock passed in: the ingress sends and answers."""

    # a tenant's warm turns before its cold requests (order's rule 3); off only in the routing
    # bench, which measures what the rule gives against first come first served (its warm case)
    _warm_first = True

    def __init__(self, limits: Limits, engines: Optional[Dict[str, EngineEstimate]]):
        self.limits = limits
        self.engines = engines   # the TTFT policy's estimates (None: another policy, nothing waits)
        self.on = engines is not None and limits.queue_max > 0
        self.lanes: Dict[Tuple[int, str, bool], collections.deque] = {}   # (class, tenant, cold) -> its requests
        self.counters: Dict[str, float] = {}   # tenant -> tokens served / weight (VTC)
        self.weights: Dict[str, float] = {}    # tenant -> the weight of its latest key
        self.backlog: Dict[str, int] = {}      # tenant -> requests waiting
        self.per_key: Dict[str, List[int]] = {}   # key id -> [requests, bytes] waiting
        self.count = self.bytes = 0
        self.last = 0.0   # the counter of the tenant served last
        self.heard: Dict[str, float] = {}      # tenant -> the others' service total when last looked
        self.inflight: Dict[str, int] = {}     # tenant -> its requests at priority engines from here
        # where sessions have fewer running slots than their depth, or while guarding (below):
        # tenant -> its requests at any engine from here (overtakes, guarded; counted only then,
        # so the default path does no more)
        self.slotted = self.on and limits.queue_session_slots < limits.queue_session_depth
        self.held: Dict[str, int] = {}
        # where the guard's bound is tighter than the prefill bound (guarded): `held` is kept too
        self.guarding = self.on and limits.queue_guard_wait_s < limits.queue_wait_s
        self.counting = self.slotted or self.guarding
        self.held_back = False   # a request was held by the guard in this dispatch (dispatch_waiting)
        self.note: Optional[Callable[[str, float], None]] = None   # service given here, to publish
        # for /metrics: per tenant
        self.service: Dict[str, int] = collections.defaultdict(int)   # tokens served
        self.waited: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0])   # seconds, requests
        self.throttled: Dict[str, int] = collections.defaultdict(int)   # 429s from the queue's bounds
        self.aborted: Dict[str, int] = collections.defaultdict(int)     # clients gone while waiting

    def remote_service(self, tenant: str) -> float:
        """Tokens other ingresses served `tenant` in all, as last heard (its growth counts here as
        this ingress's own service: standing). 0 alone; the Ingress assigns ClusterFlow's."""
        return 0.0

    def remote_inflight(self, tenant: str) -> int:
        """Requests of `tenant` other ingresses have at priority engines (0: none heard of)."""
        return 0

    def standing(self, tenant: str) -> float:
        """Its counter, with what other ingresses served it since this one last looked added."""
        counter = self.counters.get(tenant, 0.0)
        total = self.remote_service(tenant)
        heard = self.heard.get(tenant)
        if heard != total:
            self.heard[tenant] = total
            if heard is not None and total > heard:
                counter = self.counters[tenant] = counter + (total - heard) / self.weights.get(tenant, 1.0)
        return counter

    def engine_priority(self, key: Key, rank: int) -> int:
        """The engine's `priority` for a request of `key` in class `rank` (see above)."""
        held = self.inflight.get(key.user, 0) + self.remote_inflight(key.user)
        return ENGINE_PRIORITY[rank] + min(ENGINE_PRIORITY_SPREAD - 1, int(held / key.weight).bit_length())

    def overtakes(self, candidate: Candidate, left: List[Candidate], key: Key) -> bool:
        """Whether a request that would wait goes at once (see above): its tenant waits here for
        none, the session has room (QUEUE_SESSION_DEPTH), and the tenant holds fewer than
        ENGINE_PRIORITY_FIRST requests (by its weight) at priority engines, where the engine puts
        it first, or, where sessions are full at fewer running slots (QUEUE_SESSION_SLOTS), fewer
        at any engine from here than that or its share of the slots (slot_share), however much
        prefill is queued there: the slots left free for it are what keeps its wait short; or,
        while guarding, fewer at any engine from here than its share of those (held_share)."""
        if self.backlog.get(key.user):
            return False
        est = self.engines.get(candidate.session)
        if est is not None and est.outstanding >= self.limits.queue_session_depth:
            return False
        if candidate.by_priority and all(c.by_priority for c in left):
            held = self.inflight.get(key.user, 0) + self.remote_inflight(key.user)
            return held / key.weight < ENGINE_PRIORITY_FIRST
        if self.guarding and self.held.get(key.user, 0) / key.weight < self.held_share(key):
            return True
        if not self.slotted:
            return False
        held = self.held.get(key.user, 0) / key.weight
        return held < ENGINE_PRIORITY_FIRST or (held < self.slot_share(key, len(left)) and self.contended(key.user))

    def contended(self, tenant: str = "") -> bool:
        """Whether two tenants or more (`tenant` among them) hold requests from here or wait here:
        the running slots, and a tenant's share of them, count only then, so a tenant alone has
        the engines' whole batch and goes past no bound. (Each ingress sees its own: one that
        sees only a flood spread over several holds it by the prefill bound alone.)"""
        held = self.held
        if len(held) > 1:
            return True
        present = set(held).union(self.backlog)
        if tenant:
            present.add(tenant)
        return len(present) > 1

    def slot_share(self, key: Key, sessions: int) -> float:
        """The running slots of `sessions` sessions per unit of weight among the tenants holding
        requests from here or waiting here, `key`'s among them: a tenant below it holds less than
        its weighted share, so a flood filling the slots does not make it wait (a tenant at 20 %
        of the capacity holds its rate times its answers' seconds: about 2 per engine in
        bench_tenants --quick, more for long answers). Over the tenants' requests at any model
        (held is not kept per model)."""
        weights = self.weights
        tenants = set(self.held).union(self.backlog)
        tenants.add(key.user)
        total = sum(key.weight if t == key.user else weights.get(t, 1.0) for t in tenants)
        return self.limits.queue_session_slots * sessions / total

    def held_share(self, key: Key) -> float:
        """The requests in flight from here per unit of weight among the tenants holding requests
        from here or waiting here, `key`'s among them: while guarding, a tenant waiting for none
        that holds fewer than this (by its weight) goes at once (overtakes), so it waits neither
        here nor, with the flood guarded, behind the flood's prefill there."""
        weights = self.weights
        tenants = set(self.held).union(self.backlog)
        tenants.add(key.user)
        total = sum(key.weight if t == key.user else weights.get(t, 1.0) for t in tenants)
        return sum(self.held.values()) / total

    def began(self, tenant: str) -> None:
        """A request of `tenant` went to a priority engine (engine_priority counts it till `ended`)."""
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1

    def ended(self, tenant: str) -> None:
        self.released(tenant, self.inflight)

    def holds(self, key: Key) -> None:
        """A request of `key`'s tenant went to a session (counted till `released`, while slotted)."""
        self.weights[key.user] = key.weight
        self.held[key.user] = self.held.get(key.user, 0) + 1

    @staticmethod
    def released(tenant: str, counts: Dict[str, int]) -> None:
        left = counts.get(tenant, 0) - 1
        if left > 0:
            counts[tenant] = left
        else:
            counts.pop(tenant, None)

    def full(self, candidate: Candidate, routed: RoutedRequest) -> bool:
        """Whether the session the policy picked should not be sent more now: the prompt tokens this
        ingress sent it that have had no first token yet (EngineEstimate.queued) would take over
        QUEUE_WAIT_S to prefill at its kind's learned speed, or QUEUE_SESSION_DEPTH of this
        ingress's requests are in flight there, or QUEUE_SESSION_SLOTS while contended (its
        running slots: past them only a tenant below its share goes, overtakes)
        (QUEUE_PRIORITY_WAIT_S where the engine schedules by priority). The speed is the fit's,
        or faster where whole answers showed it (a fit left at its prior by answers that are not streamed judged a fast engine full at 3
        requests, and the queue halved the ingress's throughput). Only this ingress's own work counts: other ingresses' (their nodes' `load`)
        is heard seconds late, and counting it held requests back from engines that had drained
        meanwhile (measured: a flood's engines ran at a third of their capacity); with k
        ingresses an engine holds up to k x the bound. A session holding none of
        this ingress's requests is never full: what frees it is not seen here, and a request must
        go somewhere for the queue to move."""
        est = self.engines.get(candidate.session)
        if est is None or not est.outstanding:
            return False
        limits = self.limits
        return est.outstanding >= limits.queue_session_depth or \
            est.queued * est.fit.per_token() > (limits.queue_priority_wait_s if candidate.by_priority else limits.queue_wait_s) \
            or (est.outstanding >= limits.queue_session_slots and self.contended())

    def guarded(self, entry: Waiting, candidate: Candidate) -> bool:
        """Whether `entry` may not go to `candidate`'s session though it is not full (see above): its
        tenant has more waiting here, another tenant with none waiting has requests in flight from
        here (it is below its share: it is sent all it asks), and the prompts this ingress sent the
        session that have had no first token would take over QUEUE_GUARD_WAIT_S."""
        if not self.guarding or self.backlog.get(entry.tenant, 0) <= 1:
            return False
        est = self.engines.get(candidate.session)
        if est is None or est.queued * est.fit.per_token() <= self.limits.queue_guard_wait_s:
            return False
        backlog, tenant = self.backlog, entry.tenant
        return any(t != tenant and not backlog.get(t) for t in self.held)

    def unguarded(self, passed: Iterable[str]) -> List[Waiting]:
        """The first requests of the tenants no guard holds (one waiting here) for the models in
        `passed`, oldest first: passing a model over when a flood's request was held by the guard
        passed them over too, and they are the ones it keeps room for."""
        backlog = self.backlog
        heads = [lane[0] for (_, tenant, _), lane in self.lanes.items()
                 if backlog.get(tenant, 0) <= 1 and lane[0].model in passed]
        return sorted(heads, key=lambda entry: entry.since)

    def refusal(self, key: Key, size: int) -> Optional[HTTPError]:
        """Why a request of `key` with `size` bytes cannot wait (a bound reached), or None."""
        limits = self.limits
        held = self.per_key.get(key.id, (0, 0))
        if self.count >= limits.queue_max or self.bytes + size > limits.queue_max_bytes:
            what = "The ingress's queue is full"
        elif held[0] >= limits.queue_max_per_key or held[1] + size > limits.queue_key_bytes:
            what = "This key has as many requests waiting as it may"
        else:
            return None
        self.throttled[key.user] += 1
        return HTTPError(429, f"{what}: the engines are saturated; try again later", "rate_limit_exceeded",
                         headers=[(b"retry-after", str(QUEUE_RETRY_AFTER_S).encode())], etype="requests")

    def add(self, entry: Waiting) -> None:
        """Queue `entry` (its bounds checked: refusal)."""
        tenant = entry.tenant
        self.weights[tenant] = entry.key.weight
        if not self.backlog.get(tenant):   # starts waiting: no credit for the service it did not ask for
            lowest = min((self.counters.get(t, 0.0) for t, n in self.backlog.items() if n), default=self.last)
            self.counters[tenant] = max(self.standing(tenant), lowest)
        self.backlog[tenant] = self.backlog.get(tenant, 0) + 1
        lane = self.lanes.get((entry.rank, tenant, entry.cold))
        if lane is None:
            lane = self.lanes[(entry.rank, tenant, entry.cold)] = collections.deque()
        lane.append(entry)
        entry.lane = lane
        held = self.per_key.setdefault(entry.key.id, [0, 0])
        held[0] += 1
        held[1] += entry.size
        self.count += 1
        self.bytes += entry.size

    def remove(self, entry: Waiting) -> None:
        """Take `entry` out (it goes out, times out, or its client left)."""
        lane = entry.lane
        if lane is None:
            return
        entry.lane = None
        if lane and lane[0] is entry:
            lane.popleft()
        else:
            lane.remove(entry)
        if not lane:
            del self.lanes[(entry.rank, entry.tenant, entry.cold)]
        tenant = entry.tenant
        left = self.backlog[tenant] - 1
        if left:
            self.backlog[tenant] = left
        else:
            del self.backlog[tenant]
        held = self.per_key[entry.key.id]
        held[0] -= 1
        held[1] -= entry.size
        if not held[0]:
            del self.per_key[entry.key.id]
        self.count -= 1
        self.bytes -= entry.size

    def rank(self, entry: Waiting, now: float) -> int:
        """Its class now: one higher per QUEUE_AGE_S waited."""
        return max(0, entry.rank - int((now - entry.since) / self.limits.queue_age_s))

    def order(self, now: float, passed: Iterable[str] = (), skipped: Container[Waiting] = ()) -> Optional[Waiting]:
        """The request to send next, skipping those for the models in `passed` (their sessions
        are full) and those in `skipped` (the session each picked is full: a lane's next request
        stands in for its head, up to QUEUE_LOOKAHEAD in), or None."""
        oldest: Dict[int, float] = {}   # class -> when its oldest waiting request came (a lane's head)
        first: Dict[Tuple[int, str], float] = {}   # (class, tenant) -> ... of the tenant's, warm or cold
        for (rank, tenant, _), lane in self.lanes.items():
            since = lane[0].since
            if since < oldest.get(rank, math.inf):
                oldest[rank] = since
            if since < first.get((rank, tenant), math.inf):
                first[(rank, tenant)] = since
        age = self.limits.queue_age_s
        risen = {rank: max(0, rank - int((now - since) / age)) for rank, since in oldest.items()}
        best: Optional[Tuple[int, float, float, bool, float]] = None
        chosen = None
        for (rank, tenant, cold), lane in self.lanes.items():
            head = lane[0]
            if head.model in passed:
                continue
            if head in skipped:
                head = next((e for e in itertools.islice(lane, QUEUE_LOOKAHEAD) if e not in skipped), None)
                if head is None:
                    continue
            # between tenants: class, share, then the older request, as if each had one lane;
            # within one: its warm turns first, unless its cold head has waited QUEUE_AGE_S
            place = (risen[rank], self.standing(tenant), first[(rank, tenant)],
                     cold and self._warm_first and now - head.since < age, head.since)
            if best is None or place < best:
                best, chosen = place, head
        return chosen

    def went(self, entry: Waiting, prompt_tokens: float, now: float) -> None:
        """`entry` goes out now: out of the queue, its wait booked, its prompt charged."""
        self.remove(entry)
        waited = self.waited[entry.tenant]
        waited[0] += now - entry.since
        waited[1] += 1
        self.charge(entry.tenant, prompt_tokens)
        self.last = self.counters.get(entry.tenant, 0.0)

    def charge(self, tenant: str, tokens: float) -> None:
        """Service given to `tenant` (tokens; negative: a prompt charged at its estimate, corrected)."""
        if tokens:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)
            self.service[tenant] += int(tokens)
            if self.note is not None:
                self.note(tenant, tokens)

    def expired(self, now: float) -> List[Waiting]:
        """The requests that have waited QUEUE_TIMEOUT_S, taken out (the oldest are at lane heads)."""
        limit = now - self.limits.queue_timeout_s
        out = []
        for lane in list(self.lanes.values()):
            while lane and lane[0].since < limit:
                out.append(lane[0])
                self.remove(lane[0])
        for entry in out:
            self.throttled[entry.tenant] += 1
        return out

    def tenants(self) -> List[str]:
        """Every tenant with something to show on /metrics."""
        return sorted(set(self.backlog) | set(self.service) | set(self.throttled) | set(self.waited)
                      | set(self.aborted))


def request_class(key: Key, fields: Dict[bytes, bytes], request: Any) -> int:
    """The class (PRIORITY_RANK) a request runs in: X-Otela-Priority's, else its body's `priority`
    (vLLM's integer: below 0 interactive, 0 standard, above 0 batch), else its key's. A key may
    ask for its own class, a lower one (it hurts nobody) or one its record lists (`priorities`);
    an admin key any. A header asking for another is refused (403), a body's `priority` only
    capped at the key's class (vLLM clients send it for the engine, not for us)."""
    asked = fields.get(PRIORITY_HEADER)
    if asked is not None:
        rank = PRIORITY_RANK.get(asked.strip().lower().decode("latin-1"))
        if rank is None:
            raise HTTPError(400, f"X-Otela-Priority must be one of {', '.join(crdt.PRIORITY_CLASSES)}",
                            "invalid_priority")
        if rank < key.priority and rank not in key.priorities and not key.admin:
            raise HTTPError(403, f"This key may not ask for the class {crdt.PRIORITY_CLASSES[rank]}",
                            "priority_not_allowed")
        return rank
    number = request.get("priority") if isinstance(request, dict) else None
    if type(number) is int:
        rank = 0 if number < 0 else 1 if number == 0 else 2
        if rank < key.priority and rank not in key.priorities and not key.admin:
            return key.priority
        return rank
    return key.priority


def with_engine_priority(body: bytes, request: Any, number: int) -> bytes:
    """The body for an engine that schedules by priority: its `priority` `number` (the client's
    own value is replaced: a key's class and share, not its client, decide where it runs)."""
    if isinstance(request, dict) and request.get("priority") == number and type(request["priority"]) is int:
        return body
    if isinstance(request, dict) and "priority" not in request and body[:1] == b"{":
        rest = body[1:]
        return b'{"priority":%d,' % number + rest if rest.lstrip()[:1] != b"}" else b'{"priority":%d}' % number
    try:
        parsed = crdt.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict):
        return body
    parsed["priority"] = number
    return crdt.dumps(parsed)


# =============================================================================================
# Metrics (Prometheus text exposition, no dependency)
# =============================================================================================
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0)


class Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total, self.n = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
        self.total += value
        self.n += 1

    def samples(self, model: str) -> List[Tuple[str, Any]]:
        """Its cumulative buckets, sum and count, for a model's (escaped) name."""
        out, cumulative = [], 0
        for bound, count in zip(LATENCY_BUCKETS, self.counts):
            cumulative += count
            out.append((f'_bucket{{model="{model}",le="{bound:g}"}}', cumulative))
        return out + [(f'_bucket{{model="{model}",le="+Inf"}}', self.n), (f'_sum{{model="{model}"}}', repr(self.total)),
                      (f'_count{{model="{model}"}}', self.n)]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self):
        self.requests: Dict[Tuple[str, int], int] = collections.defaultdict(int)
        self.errors: Dict[str, int] = collections.defaultdict(int)
        self.retries = 0
        self.stream_cuts = 0
        self.stream_resumes = 0
        self.tokens: Dict[Tuple[str, str], int] = collections.defaultdict(int)
        self.latency: Dict[str, Histogram] = {}
        self.ttfb: Dict[str, Histogram] = {}
        self.connections = 0
        self.inflight = 0
        self.headless_evicted = 0   # connections with no complete head cut for a newcomer
        self.usage_bounded: Dict[Tuple[str, str], int] = collections.defaultdict(int)   # (session, reason)
        self.fallbacks: Dict[Tuple[str, str], int] = collections.defaultdict(int)   # (model, the next one)

    def forget(self, session: str) -> None:
        """The series of a session that left (its sessions' count by state stays, as LEFT)."""
        for key in [k for k in self.usage_bounded if k[0] == session]:
            del self.usage_bounded[key]

    def observe(self, table: Dict[str, Histogram], model: str, value: float) -> None:
        hist = table.get(model)
        if hist is None:
            hist = table[model] = Histogram()
        hist.observe(value)

    def render(self, sessions: Dict[str, int], suspected: int, sick: int, ledger_failures: int = 0,
               ledger_pending: int = 0, ledger_dropped: int = 0) -> bytes:
        families = [
            ("otela_requests_total", "counter", "Requests answered, by model and HTTP status.",
             [(f'{{model="{_label(model)}",code="{code}"}}', n) for (model, code), n in sorted(self.requests.items())]),
            ("otela_errors_total", "counter", "Error responses, by OpenAI error code.",
             [(f'{{code="{_label(code)}"}}', n) for code, n in sorted(self.errors.items())]),
            ("otela_tokens_total", "counter", "Tokens reported by engines, by direction.",
             [(f'{{model="{_label(model)}",direction="{direction}"}}', n)
              for (model, direction), n in sorted(self.tokens.items())]),
            ("otela_engine_usage_bounded_total", "counter", "Answers whose token count was over what this "
             "ingress saw (prompt: its bytes; completion: the answer's bytes, max_tokens; cached: the prompt), "
             "booked at the bound, by the session that said it and the count.",
             [(f'{{session="{_label(session)}",reason="{reason}"}}', n)
              for (session, reason), n in sorted(self.usage_bounded.items())]),
            ("otela_fallbacks_total", "counter", "Requests moved to the next model of their fallback list "
             "(an alias's, or --fallback) after every attempt at a model failed before the first byte.",
             [(f'{{model="{_label(model)}",to="{_label(to)}"}}', n) for (model, to), n in sorted(self.fallbacks.items())]),
            ("otela_request_duration_seconds", "histogram", "Time from request to last byte.",
             [line for model, hist in sorted(self.latency.items()) for line in hist.samples(_label(model))]),
            ("otela_time_to_first_byte_seconds", "histogram", "Time to the first streamed byte.",
             [line for model, hist in sorted(self.ttfb.items()) for line in hist.samples(_label(model))]),
            ("otela_sessions", "gauge", "Sessions in the registry, by lifecycle state.",
             [(f'{{state="{state}"}}', n) for state, n in sorted(sessions.items())])]
        families += [(name, kind, help_text, [("", value)]) for name, kind, help_text, value in (
            ("otela_retries_total", "counter", "Attempts moved to another session.", self.retries),
            ("otela_stream_cuts_total", "counter", "Streams ended by an error event mid-way.", self.stream_cuts),
            ("otela_stream_resumes_total", "counter",
             "Streams whose provider failed mid-way, continued on another session.", self.stream_resumes),
            ("otela_suspected_sessions", "gauge", "Live sessions the failure detector suspects.", suspected),
            ("otela_sick_sessions", "gauge", "Sessions out of this ingress's rotation for failing.", sick),
            ("otela_ledger_commit_failures_total", "counter",
             "Usage ledger batches SQLite refused (kept in the journal and retried).", ledger_failures),
            ("otela_ledger_pending_rows", "gauge", "Usage rows journalled but not yet in SQLite.", ledger_pending),
            ("otela_ledger_dropped_rows_total", "counter", "Usage rows (and replicated records) SQLite could "
             "never take, dropped so that the ones after them are written.", ledger_dropped),
            ("otela_connections", "gauge", "Open client connections.", self.connections),
            ("otela_headless_evicted_total", "counter", "Connections cut with no complete request head, "
             "the oldest of MAX_HEADLESS for a newcomer (slowloris).", self.headless_evicted),
            ("otela_inflight_requests", "gauge", "Requests being proxied now.", self.inflight))]
        return exposition(families)


def exposition(families: Iterable[Tuple[str, str, str, Iterable[Tuple[str, Any]]]]) -> bytes:
    """Prometheus text of (name, kind, help, samples) families; a sample is (what follows the
    name: a suffix and labels, or "", its value)."""
    out = []
    for name, kind, help_text, samples in families:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f"{name}{tail} {value}" for tail, value in samples]
    return ("\n".join(out) + "\n").encode()


REFUSAL_REASONS = ("unsigned", "plane", "unknown_full", "sessions_full", "seal", "eviction_without_evidence",
                   "bind", "grant", "unbound", "forged_own", "revocations_full")   # (crdt.Binder's)


FLOODERS_SHOWN = 8   # senders named on /metrics for replay-cache refusals (the most refused first)


# The policy's view per session (Policy.stats) on /metrics: name in stats -> (family, kind, help)
ROUTING_FAMILIES = (
    ("prompt_tokens", "otela_session_prompt_tokens_total", "counter",
     "Prompt tokens of the session's answers to this ingress."),
    ("cached_tokens", "otela_session_cached_tokens_total", "counter",
     "Of those, the tokens its engine reported cached (its prefix cache's hits)."),
    ("queued_prompt_tokens", "otela_session_queued_prompt_tokens", "gauge",
     "Uncached prompt tokens this ingress sent and the session has not answered yet."),
    ("outstanding", "otela_session_outstanding_requests", "gauge", "Requests this ingress has in flight there."),
    ("ttft_estimate_seconds", "otela_session_ttft_estimate_seconds", "gauge",
     "The policy's estimate of a fully cached request's time to first token there now."),
    ("prefill_tokens_per_second", "otela_session_prefill_tokens_per_second", "gauge",
     "Prompt tokens per second, fitted from its answers."),
    ("decode_tokens_per_second", "otela_session_decode_tokens_per_second", "gauge",
     "Output tokens per second of one stream, from its answers."),
    ("round_trip_seconds", "otela_session_round_trip_seconds", "gauge",
     "The path's round trip from this ingress, as its overlay's probes measure it (counted in routing)."))


def queue_metrics(queue: FairQueue) -> bytes:
    """The fair queue per tenant (a key's user): waiting now, time waited, service, refusals."""
    tenants = [(t, _label(t)) for t in queue.tenants()]
    return exposition([
        ("otela_queue_waiting", "gauge", "Requests waiting at the ingress for a free engine, by tenant.",
         [(f'{{tenant="{label}"}}', queue.backlog.get(t, 0)) for t, label in tenants]),
        ("otela_queue_wait_seconds", "summary", "Time requests waited at the ingress before going out, by tenant.",
         [line for t, label in tenants if t in queue.waited for line in (
             (f'_sum{{tenant="{label}"}}', repr(queue.waited[t][0])), (f'_count{{tenant="{label}"}}', queue.waited[t][1]))]),
        ("otela_queue_service_tokens_total", "counter", "Tokens served (prompt and completion), by tenant: "
         "the fair queue's share of service.", [(f'{{tenant="{label}"}}', queue.service.get(t, 0)) for t, label in tenants]),
        ("otela_queue_throttled_total", "counter", "Requests answered 429 by the queue's bounds (count, bytes, "
         "time), by tenant.", [(f'{{tenant="{label}"}}', queue.throttled.get(t, 0)) for t, label in tenants]),
        ("otela_queue_aborted_total", "counter", "Clients that left while their request waited, by tenant.",
         [(f'{{tenant="{label}"}}', queue.aborted.get(t, 0)) for t, label in tenants])])


def routing_metrics(stats: Dict[str, Dict[str, float]]) -> bytes:
    if not stats:
        return b""
    return exposition((name, kind, help_text, [
        (f'{{session="{_label(str(session))}"}}', f"{value:g}") for session, view in sorted(stats.items())
        for value in (view.get(field) if isinstance(view, dict) else None,)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)])
        for field, name, kind, help_text in ROUTING_FAMILIES)


def overlay_metrics(node: Any) -> bytes:
    """The overlay node's refusals as Prometheus families, so an operator sees an attack on the
    gossip port or the relay: datagrams and frames dropped (by reason), connections and join
    answers refused, envelopes not relayed, the senders whose replay-cache share is full, and
    registry entries refused (unsigned: a key or usage record without the ingress tier's
    signature; plane: ingress-plane traffic from or to a member that is not a proven ingress;
    unknown_full: entries of unknown kinds over crdt.MAX_UNKNOWN; sessions_full: new sessions
    over crdt.MAX_SESSIONS; seal: a session's end, or another seal, not written by its owner;
    eviction_without_evidence: crdt, the end of a session). Nothing for a stand-in node without them."""
    wire, overlay = getattr(node, "wire", None), getattr(node, "overlay", None)
    if wire is None or overlay is None:
        return b""
    registry = overlay.refused + overlay.map.refused
    families = [(name, "counter", help_text,
                 [(f'{{{label}="{_label(str(key))}"}}', n) for key, n in sorted(counts.items())])
                for name, help_text, counts, label in (
            ("otela_gossip_dropped_total", "Gossip datagrams and frames dropped, by reason.", wire.dropped, "reason"),
            ("otela_gossip_refused_total", "Gossip and tunnel connections, frames and join answers refused, "
             "by reason.", node.refused, "reason"),
            ("otela_relay_refused_total", "Envelopes this relay did not pass on, by reason.",
             {k: node.relayed[k] for k in ("refused", "stale", "not_member", "replayed")}, "reason"),
            ("otela_gossip_flooded_total", "Authentic datagrams refused because their sender's share of the "
             "replay cache was full, by sender.", dict(wire.flooders.most_common(FLOODERS_SHOWN)), "sender"),
            ("otela_registry_refused_total", "Registry entries and exchanges refused, by reason.",
             {why: registry.get(why, 0) for why in REFUSAL_REASONS}, "why"))]
    families.append(("otela_gossip_bytes_total", "counter", "Gossip bytes this member sent and received "
                     "(datagrams and frames, relayed ones included).",
                     [('{direction="sent"}', node.bytes_sent), ('{direction="received"}', node.bytes_received)]))
    families.append(("otela_registry_entries", "gauge", "Registry entries held, by plane (routing: sessions; "
                     "ingress: API keys and usage counters).",
                     [(f'{{plane="{plane}"}}', overlay.map.plane_size(plane)) for plane in crdt.PLANES]))
    return exposition(families)


# =============================================================================================
# Trace context: W3C traceparent in and out, Server-Timing, spans to an OTLP collector
# =============================================================================================
# Each proxied request is a span of this ingress: it continues the client's trace (traceparent),
# or starts one, and the engine gets a traceparent naming our span as its parent, with the
# client's tracestate, X-Request-Id, User-Agent and X-Session-Id. The trace id is in the request's
# ledger row and its log lines; with --otlp-endpoint its spans go to a collector
# (otela_node.SpanExporter).
_TRACEPARENT = otela_node.TRACEPARENT
_HEADER_VALUE = re.compile(rb"[\x20-\x7e]{1,512}")   # a header value passed on as it is: printable, bounded
_NO_TRACE, _NO_SPAN = b"0" * 32, b"0" * 16   # (all zeros: invalid, as W3C says)


def trace_context(fields: Dict[bytes, bytes], request_id: bytes) -> Tuple[bytes, bytes, bytes, bytes]:
    """(trace id, the client's span it continues (b"": none), this ingress's span, the header
    lines for the engine): the client's traceparent when valid, else a trace started here."""
    ids = b"%048x" % (random.getrandbits(192) | 1)   # a trace id (if one is started here) and our span's
    span = ids[32:]
    given = fields.get(b"traceparent")
    found = _TRACEPARENT.fullmatch(given) if given is not None else None
    if found is not None and found.group(1) != b"ff" and found.group(2) != _NO_TRACE and found.group(3) != _NO_SPAN:
        trace, parent = found.group(2), found.group(3)
        lines = b"traceparent: 00-%s-%s-%s\r\n" % (trace, span, found.group(4))
        state = fields.get(b"tracestate")
        if state is not None and _HEADER_VALUE.fullmatch(state):
            lines += b"tracestate: %s\r\n" % state
    else:
        trace, parent = ids[:32], b""
        lines = b"traceparent: 00-%s-%s-01\r\n" % (trace, span)
    lines += b"x-request-id: %s\r\n" % request_id
    for name in (b"user-agent", AFFINITY_HEADER):   # the session key: an engine's router may read it too
        value = fields.get(name)
        if value is not None and _HEADER_VALUE.fullmatch(value):
            lines += b"%s: %s\r\n" % (name, value)
    return trace, parent, span, lines


def server_timing(ex: _Exchange) -> bytes:
    """The Server-Timing line of an answer: the ingress's time before the request went upstream
    (reading, checks, routing), and the engine's to its answer's head, in milliseconds."""
    return b"server-timing: ingress;dur=%.3f, upstream;dur=%.3f\r\n" % (
        (ex.sent_at - ex.t0) * 1000.0, (ex.head_at - ex.sent_at) * 1000.0)


def ingress_spans(item: tuple, nanos: Callable[[float], str]) -> List[Dict[str, Any]]:
    """One request's spans (OTLP/JSON; see _Exchange.finish for the tuple): the ingress's (the
    server span the engine's traceparent names), its route choice and the upstream's time to the
    first byte."""
    trace, parent, span, name, t0, routed_at, sent_at, head_at, end, model, status, session, attempts = item
    trace, span = trace.decode(), span.decode()
    attributes = [{"key": "otela.model", "value": {"stringValue": model}},
                  {"key": "http.response.status_code", "value": {"intValue": str(status)}},
                  {"key": "otela.session", "value": {"stringValue": session}},
                  {"key": "otela.attempts", "value": {"intValue": str(attempts)}}]
    root = {"traceId": trace, "spanId": span, "name": name, "kind": 2, "startTimeUnixNano": nanos(t0),
            "endTimeUnixNano": nanos(end), "attributes": attributes,
            "status": {"code": 2 if status >= 500 else 1}}
    if parent:
        root["parentSpanId"] = parent.decode()
    spans = [root]
    if routed_at:
        spans.append({"traceId": trace, "spanId": otela_node.new_span_id(), "parentSpanId": span,
                      "name": "otela.route", "kind": 1, "startTimeUnixNano": nanos(t0),
                      "endTimeUnixNano": nanos(routed_at)})
    if sent_at and head_at >= sent_at:
        spans.append({"traceId": trace, "spanId": otela_node.new_span_id(), "parentSpanId": span,
                      "name": "otela.upstream.first_byte", "kind": 3, "startTimeUnixNano": nanos(sent_at),
                      "endTimeUnixNano": nanos(head_at),
                      "attributes": [{"key": "otela.session", "value": {"stringValue": session}}]})
    return spans


# =============================================================================================
# Streams: watch SSE bytes for token usage without re-serialising them
# =============================================================================================
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_DONE = b"data: [DONE]"
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')   # a usage-only chunk
# The generated text of a chunk (a "content" or "text" string, still JSON-escaped: joined, the
# pieces are one JSON string's inside). Engines send one per token, so counting the non-empty ones
# measures a stream whose engine ignores include_usage; kept, they are what a cut stream's
# continuation starts from (see _Exchange.resume).
_TEXT = re.compile(rb'"(?:content|text)"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"')
# A chunk whose output is not plain text (a reasoning part, a tool call): such a stream is not
# continued elsewhere, as its text alone does not say where the answer stood.
_NOT_PLAIN = re.compile(rb'"(?:reasoning_content|reasoning|tool_calls|function_call)"\s*:\s*(?!null|\[\])')
_CHUNK_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')
RESUME_TEXT_MAX = 1024 * 1024   # bytes of a stream read for its text, to continue it; a longer one is cut


# the usage an answer reports (either API's names), read by the codec's side (otela_node: a node
# reads it too)
cached_of = otela_node.cached_of
usage_of = otela_node.usage_of


class StreamWatch:
    """Passes SSE bytes through event by event; reads the usage chunk and, if the client did
    not ask for usage (we injected include_usage), drops that usage-only chunk.

    Bytes go out as soon as an event is complete; only the unfinished tail of a read is held
    back (bounded by SSE_CARRY_MAX), so the client sees exactly the engine's bytes minus the
    chunk it did not ask for.
    """

    __slots__ = ("strip", "carry", "prompt_tokens", "completion_tokens", "cached_tokens", "events", "saw_usage",
                 "text", "kept", "first_id", "swap", "before", "seen")

    def __init__(self, strip: bool):
        self.strip = strip
        self.carry = b""
        self.prompt_tokens = self.completion_tokens = 0
        self.cached_tokens: Optional[int] = None
        self.events = 0          # chunks with text: the token estimate when no usage comes
        self.saw_usage = False
        self.text: Optional[List[bytes]] = []   # the text that went out (None: not to be continued)
        self.kept = 0            # ... its bytes
        self.first_id: Optional[bytes] = None   # the stream's chunk id, as its client saw it
        self.swap: Any = None    # a continuation: True, then (its chunk id, first_id)
        self.before = 0          # chunks with text before the continuation
        self.seen = 0            # bytes the engines sent (what bounds their completion count)

    def tokens(self) -> Tuple[int, int]:
        """(prompt, completion): the engine's usage, or for an engine that ignores
        stream_options (llama-cpp-python), one completion token per chunk with text and an
        unknown prompt (None: NULL in the ledger, left out of the token statistics). A continued
        stream's engine counted the text before it as prompt: it is the completion's."""
        if self.saw_usage:
            before = self.before
            return max(0, self.prompt_tokens - before), self.completion_tokens + before
        return None, self.events

    def feed(self, piece: bytes) -> bytes:
        self.seen += len(piece)
        if self.swap is not None:
            piece = self._swap_id(piece)
        if self.carry:
            piece = self.carry + piece
            self.carry = b""
        cut = piece.rfind(b"\n\n")
        end = cut + 2
        if cut < 0:
            cut = piece.rfind(b"\r\n\r\n")
            end = cut + 4
        if cut < 0:
            if len(piece) > SSE_CARRY_MAX:
                self.text = None   # its text is not read: the stream is not continued
                return piece
            self.carry = piece
            return b""
        if end < len(piece):
            self.carry = piece[end:]
            piece = piece[:end]
        self._read_text(piece)
        if _USAGE.search(piece) is None:
            return piece
        return self._take_usage(piece)

    def flush(self) -> bytes:
        piece, self.carry = self.carry, b""
        self._read_text(piece)
        if piece and _USAGE.search(piece) is not None:
            return self._take_usage(piece)
        return piece

    def _read_text(self, piece: bytes) -> None:
        """The text of `piece`, the events that hold some and whether the stream is still plain
        (only an event without text may be a reasoning part or a tool call)."""
        found = _TEXT.findall(piece)
        said = len(found) - found.count(b"")
        self.events += said
        text = self.text
        if text is None:
            return
        if self.first_id is None:
            match = _CHUNK_ID.search(piece)
            self.first_id = match.group(1) if match else b""
        text += found
        self.kept += len(piece)
        if self.kept > RESUME_TEXT_MAX or (said < piece.count(b"data:") and _NOT_PLAIN.search(piece)):
            self.text = None

    def generated(self) -> Optional[str]:
        """The text that went out, if the stream may be continued from it."""
        if self.text is None or not self.first_id:
            return None
        try:
            return crdt.loads(b'"' + b"".join(self.text) + b'"')
        except ValueError:
            return None

    def continued(self) -> None:
        """The stream goes on from another engine's continuation: what was cut is dropped, its
        chunks take the id the client saw (_swap_id), its usage counts the text before."""
        self.carry = b""
        self.before = self.events
        self.swap = True

    def _swap_id(self, piece: bytes) -> bytes:
        swap = self.swap
        if swap is True:
            match = _CHUNK_ID.search(piece)
            if match is None:
                return piece
            whole, at = match.group(0), match.start(1) - match.start(0)
            swap = self.swap = (whole, whole[:at] + self.first_id + b'"')
        return piece.replace(*swap)

    def _take_usage(self, piece: bytes) -> bytes:
        """Read the usage of each event of `piece` that carries one, and drop a usage-only one
        the client did not ask for. Only those events are cut out: the ones around them (a
        whole stream's worth, in one read from a fast engine) pass as one slice."""
        kept, at = [], 0
        for match in _USAGE.finditer(piece):
            where = match.start()
            if where < at:   # in the event just read
                continue
            lf, crlf = piece.find(b"\n\n", where), piece.find(b"\r\n\r\n", where)
            end = min(lf + 2 if lf >= 0 else len(piece), crlf + 4 if crlf >= 0 else len(piece))
            if end < match.end():   # "usage" ends one event, the object starts another: none
                continue
            lf, crlf = piece.rfind(b"\n\n", at, where), piece.rfind(b"\r\n\r\n", at, where)
            start = max(lf + 2 if lf >= 0 else at, crlf + 4 if crlf >= 0 else at)
            event = piece[start:end]
            self.prompt_tokens, self.completion_tokens = usage_of(event)
            self.cached_tokens = cached_of(event)
            self.saw_usage = True
            kept.append(piece[at:start])
            if not (self.strip and _EMPTY_CHOICES.search(event)):
                kept.append(event)
            at = end
        kept.append(piece[at:])
        return b"".join(kept)


def cut_events(path: bytes, message: str) -> bytes:
    """The events that end a stream cut after bytes went out, in its route's own shape: for the
    Responses API (which has no [DONE]) its `error` event and `response.failed`; elsewhere an
    `error` object in a data event, then [DONE] (chat, completions, SGLang's native stream)."""
    if path.endswith(b"/responses"):
        failed = {"type": "response.failed", "response": {"object": "response", "status": "failed", "output": [],
                                                          "error": {"code": "server_error", "message": message}}}
        return (b"event: error\ndata: " + crdt.dumps({"type": "error", "code": "stream_cut", "message": message,
                                                      "param": None})
                + b"\n\nevent: response.failed\ndata: " + crdt.dumps(failed) + b"\n\n")
    error = crdt.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "stream_cut"}})
    return b"data: " + error + b"\n\ndata: [DONE]\n\n"


# =============================================================================================
# Upstream: one keep-alive pool per provider address, a lean HTTP/1.1 response reader, and the
# relay of a stream from it to a client
# =============================================================================================
class UpstreamFailure(Exception):
    """The provider failed before answering (connect, reset, EOF, protocol error, timeout)."""


class Continuation(UpstreamFailure):
    """The provider failed mid-stream, and the stream is to be continued on another session."""


# The upstream side reads with otela_node's codec rather than h11: the peer is our own node (or
# an engine) and the request is ours, so the codec's strict subset suffices (status line, fields,
# Content-Length / chunked / until-close bodies), and h11's general machinery was half of the CPU
# time of a proxied request. Clients, which may send anything, get the codec first and h11 after.
UpstreamHead = otela_node.MessageHead     # status, reason, headers, fields (lower-case names), framing
_NO_BODY = otela_node.BodyReader(otela_node.NO_BODY)   # done: what a connection holds between answers


class _UpstreamProtocol(asyncio.Protocol):
    """Puts what the provider sends straight into its Upstream's buffer and calls the exchange
    reading it (on_data: the _Exchange's answer reader, or a _Relay's pump), in the step that
    read it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: Any = None
        self.buf = bytearray()
        self.eof = False
        self.exc: Optional[BaseException] = None
        self.paused = False
        self.on_data: Optional[Callable[[], None]] = None   # set while an exchange reads this

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if len(buf) > 2 * READ_CHUNK and not self.paused:   # the reader is behind: stop reading
            self.paused = True
            self.transport.pause_reading()
        if self.on_data is not None:
            self.on_data()

    def eof_received(self) -> bool:
        self.eof = True
        if self.on_data is not None:
            self.on_data()
        return False

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.eof = True
        self.exc = exc
        if self.on_data is not None:
            self.on_data()


class Upstream:
    """One kept-alive connection to a provider, and the reader of its responses."""

    __slots__ = ("addr", "transport", "proto", "reused", "last", "buf", "body", "keep_alive", "pin")

    def __init__(self, addr: str, transport: Any, proto: _UpstreamProtocol, pin: Optional[str] = None):
        self.addr, self.transport, self.proto, self.pin = addr, transport, proto, pin
        self.reused = False
        self.last = time.monotonic()
        self.buf = proto.buf      # the protocol appends what arrives
        self.body = _NO_BODY      # the reader of the response body being read (its framing)
        self.keep_alive = True

    @property
    def done(self) -> bool:
        """The last response was read to its end."""
        return self.body.done

    def send(self, data: bytes) -> None:
        """Write a request; a connection the provider closed under us (a reset right after it
        opened) is an UpstreamFailure: uvloop raises RuntimeError on a closed transport, asyncio
        would drop the bytes unsaid."""
        if self.transport.is_closing():
            raise UpstreamFailure(f"{self.addr}: connection closed before the request went out")
        try:
            self.transport.write(data)
        except (RuntimeError, OSError) as exc:
            raise UpstreamFailure(f"{self.addr}: {exc.__class__.__name__}: {exc}") from None

    def resume_reading(self) -> None:
        proto = self.proto
        if proto.paused:
            proto.paused = False
            self.transport.resume_reading()

    def pause_reading(self) -> None:
        proto = self.proto
        if not proto.paused and not proto.eof:
            proto.paused = True
            self.transport.pause_reading()

    def parse_head(self) -> Optional[UpstreamHead]:
        """Consume and parse the final response head at the front of the buffer (after any 1xx
        ones), or None while it is incomplete; UpstreamFailure for a bad one."""
        try:
            head = otela_node.parse_response(self.buf)
        except otela_node.HTTPViolation as exc:
            raise UpstreamFailure(f"{self.addr}: {exc}") from None
        if head is not None:
            del self.buf[:head.size]
            self.keep_alive = head.keep_alive
            self.body = otela_node.BodyReader(head.framing, head.length)
        return head

    def take(self) -> Optional[bytes]:
        """The body bytes complete in the buffer now (b"" when there are none yet), or None once
        the body has ended. Raises UpstreamFailure on bad framing (after the good bytes before
        it were taken)."""
        try:
            return self.body.take(self.buf)
        except otela_node.HTTPViolation as exc:
            raise UpstreamFailure(f"{self.addr}: {exc}") from None

    def end_of_stream(self) -> None:
        """The connection ended with everything buffered taken: the end of an until-close body,
        else an UpstreamFailure."""
        try:
            self.body.end_of_stream()
        except otela_node.HTTPViolation:
            exc = self.proto.exc
            raise UpstreamFailure(f"{self.addr}: connection closed mid-body" + (f" ({exc})" if exc else "")) \
                from None

    def close(self) -> None:
        transport = self.transport
        if not transport.is_closing():
            transport.abort()


def prefix_line(routed: Optional[RoutedRequest]) -> bytes:
    """The header telling a node which prompt prefixes its engine is sent (otela_node.PREFIX_HEADER):
    the anchors of the prompt's chain as the ingresses hash it (a key of the ingress tier: a compute
    job cannot compute another application's anchors, it only hears of the prompts it is sent)."""
    memo = getattr(routed, "memo", None)
    chain = getattr(memo, "chain", None)
    if not chain:
        return b""
    return b"%s: %s\r\n" % (otela_node.PREFIX_HEADER, otela_node.encode_prefixes(
        otela_node.prefix_anchors(chain)).encode())


class UpstreamPool:
    """Kept-alive connections per provider address, and the writer of the requests sent on them."""

    def __init__(self, tls: Any = None, open_relayed: Any = None, tunnel_header: Any = None,
                 limits: Optional[Limits] = None):
        self.ssl = tls         # an ssl.SSLContext: connections to nodes are TLS (with a deadline)
        self.limits = limits = limits or Limits()
        self.open_relayed = open_relayed   # a private node ("relay/…"): a socket spliced through its relay
        # without TLS, the cluster's static credential is a header line on every request
        self.tunnel_line = b"".join((v.encode() if isinstance(v, str) else v)
                                    for v in (tunnel_header[0], b": ", tunnel_header[1], b"\r\n")) \
            if tunnel_header and tls is None else b""
        self._request_heads: Dict[Tuple[bytes, str, bool], Tuple[bytes, bytes]] = {}   # _request_head
        self._tls_options = {"ssl": tls, "server_hostname": otela_node.TLS_SERVER_NAME,
                             "ssl_handshake_timeout": limits.upstream_connect_timeout_s} if tls is not None else {}
        self._idle: Dict[str, List[Upstream]] = {}
        self.impostors = 0   # connections cut: the certificate was not the one the session's grant pins
        self.active: set = set()   # exchanges in progress, for the idle-timeout sweep
        self._retiring: set = set()   # in use on a path a better one replaced: closed when released

    def take_idle(self, addr: str, pin: Optional[str] = None) -> Optional[Upstream]:
        """A kept-alive connection to addr (that showed the certificate `pin` names), or None."""
        idle = self._idle.get(addr)
        while idle:
            up = idle.pop()
            if not up.transport.is_closing() and not up.proto.eof and up.pin == pin:
                up.reused = True
                up.last = time.monotonic()
                self.active.add(up)
                return up
            up.close()
        return None

    async def acquire(self, addr: str, fresh: bool = False, pin: Optional[str] = None) -> Upstream:
        """A connection to addr; `pin`: the sha256 of the certificate its session's grant names,
        which the node must show (anything else, though the cluster's pair signed it, is cut)."""
        up = None if fresh else self.take_idle(addr, pin)
        if up is not None:
            return up
        host, _, port = addr.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            if self.open_relayed is not None and otela_node.is_relayed(addr):
                sock = await asyncio.wait_for(self.open_relayed(addr), self.limits.upstream_connect_timeout_s)
                connect = loop.create_connection(lambda: _UpstreamProtocol(loop), sock=sock, **self._tls_options)
            else:
                connect = loop.create_connection(lambda: _UpstreamProtocol(loop), host.strip("[]"), int(port),
                                                 **self._tls_options)
            transport, proto = await asyncio.wait_for(connect, self.limits.upstream_connect_timeout_s)
        except (OSError, ValueError, RuntimeError, asyncio.TimeoutError) as exc:   # RuntimeError: uvloop's
            raise UpstreamFailure(f"{addr}: connect failed: {exc.__class__.__name__}: {exc}") from None
        if pin is not None and self.ssl is not None:
            tls = transport.get_extra_info("ssl_object")
            shown = tls.getpeercert(binary_form=True) if tls is not None else None
            if shown is None or otela_node.certificate_fingerprint(shown) != pin:
                transport.abort()
                self.impostors += 1
                raise UpstreamFailure(f"{addr}: the node showed another tunnel certificate than its grant names")
        up = Upstream(addr, transport, proto, pin)   # asyncio and uvloop set TCP_NODELAY themselves
        self.active.add(up)
        return up

    def send_request(self, up: Upstream, path: bytes, stream: bool, body: bytes,
                     routed: Optional[RoutedRequest] = None, method: bytes = b"POST", lines: bytes = b"",
                     ctype: Optional[bytes] = None) -> Optional[UpstreamFailure]:
        """Send a request on `up`; the failure (the connection discarded) when it could not go.
        `path`: the target (with its query); `routed`: its prompt's prefix anchors, when the policy
        hashed it, go with it (PREFIX_HEADER); `lines`: whole header lines of this request (trace
        context); `ctype`: the client's content type when it is not JSON (b"": none)."""
        try:
            up.send(self._request_head(path, up.addr, stream, body, prefix_line(routed) + lines, method, ctype)
                    + body)
        except UpstreamFailure as exc:
            self.discard(up)
            return exc
        return None

    def _request_head(self, path: bytes, addr: str, stream: bool, body: bytes, extra: bytes = b"",
                      method: bytes = b"POST", ctype: Optional[bytes] = None) -> bytes:
        """The head of a request upstream: the same but for its length per (method, target,
        session, streaming), so it is formatted once (bounded: routes x sessions in use)."""
        frame = self._request_heads.get((path, addr, stream, method))
        if frame is None:
            if len(self._request_heads) >= 4096:
                self._request_heads = {}
            before, after = otela_node.request_format(method, path, addr.encode(), self.tunnel_line + (
                b"accept: text/event-stream\r\n" if stream else b""))
            frame = self._request_heads[(path, addr, stream, method)] = (before, b"\r\n" + after)   # (one % less)
        if ctype is not None:   # a form, a file, or no body: the client's own type, not JSON's
            frame = (frame[0].replace(b"content-type: application/json\r\n",
                                      b"content-type: %s\r\n" % ctype if ctype else b"", 1), frame[1])
        if extra:
            return b"%s%d\r\n%s%s" % (frame[0], len(body), extra, frame[1][2:])
        return b"%s%d%s" % (frame[0], len(body), frame[1])

    def retire(self, addr: str) -> None:
        """A better path to addr appeared (a punched tunnel, otela_node's relay rule 5): its idle
        connections close now, the ones in use once their exchange is done; new ones take it."""
        for up in self._idle.pop(addr, []):
            up.close()
        self._retiring.update(up for up in self.active if up.addr == addr)

    def release(self, up: Upstream) -> None:
        self.active.discard(up)
        up.proto.on_data = None
        if self._retiring and up in self._retiring:
            self._retiring.discard(up)
            up.close()
            return
        if up.done and up.keep_alive and not up.buf:
            idle = self._idle.setdefault(up.addr, [])
            if len(idle) < self.limits.pool_idle_per_provider:
                idle.append(up)
                return
        up.close()

    def discard(self, up: Upstream) -> None:
        self.active.discard(up)
        self._retiring.discard(up)
        up.close()

    def sweep(self, now: float) -> None:
        timeout = self.limits.upstream_idle_timeout_s
        for up in [u for u in self.active if now - u.last > timeout]:
            self.discard(up)

    def close(self) -> None:
        for idle in self._idle.values():
            for up in idle:
                up.close()
        self._idle.clear()
        for up in list(self.active):
            self.discard(up)


class _Relay:
    """Relays one SSE answer to the client from the upstream protocol's data_received: the
    chunk framing off, the watch's filter, the client's framing on, one write per read; no task
    wakes up per chunk. Ends by calling on_end once with True (the whole stream went out),
    False (cut after bytes went out: the client got an error event), a Continuation (failed after
    bytes went out: the caller continues it elsewhere), an UpstreamFailure (failed
    before any byte went out: the caller may retry elsewhere) or another exception (the client
    went away, or a bug)."""

    __slots__ = ("ex", "up", "head", "on_end", "watch", "held", "ended")

    def __init__(self, ex: _Exchange, up: Upstream, head: UpstreamHead, on_end: Callable[[Any], None]):
        self.ex, self.up, self.head, self.on_end = ex, up, head, on_end
        self.watch = ex.watch or StreamWatch(ex.strip_usage)   # (a continuation's: the stream's)
        self.held = b""        # "data: [DONE]" waits until the ledger row is journalled
        self.ended = False
        up.proto.on_data = self.pump
        ex.client.relay = self

    def pump(self) -> None:
        """Send on what has arrived; end the relay when the stream, the engine or the client
        did."""
        if self.ended:
            return
        try:
            self._pump()
        except Exception as exc:   # from a data_received callback: hand it to the owner
            self._end(exc, discard=True)

    def _pump(self) -> None:
        up, client = self.up, self.ex.client
        if client.closed:
            return self._client_gone()
        up.last = time.monotonic()   # a stream longer than UPSTREAM_IDLE_TIMEOUT_S is not idle
        while True:   # twice when good chunks came before bad framing: they go out first
            try:
                piece = up.take()
            except UpstreamFailure as exc:
                return self._fail(str(exc))
            if not piece:
                break
            self._send(piece)
            if up.done or not up.buf:
                break
        if up.done:
            return self._finish()
        if up.proto.eof:   # everything buffered was taken, and no more will come
            try:
                up.end_of_stream()
            except UpstreamFailure as exc:
                return self._fail(str(exc))
            return self._finish()
        if client.write_paused:
            up.pause_reading()   # the client reads slower than the engine writes: so do we

    def _send(self, piece: bytes) -> None:
        out = self.watch.feed(piece)
        if not out:
            return
        if self.held:
            self.held += out
            return
        done_at = out.find(_DONE)
        if done_at >= 0:
            self.held, out = out[done_at:], out[:done_at]
            if not out:
                return
        ex = self.ex
        client = ex.client
        if ex.sent:
            client.transport.write(client.conn.data(out))
        else:   # (the head first: it sets the framing of the data)
            head = ex.stream_head(self.head)
            client.transport.write(head + client.conn.data(out))

    def _end(self, result: Any, discard: bool = False) -> None:
        self.ended = True
        up = self.up
        up.proto.on_data = None
        self.ex.client.relay = None
        if discard:
            self.ex.ingress.pool.discard(up)
        else:
            self.ex.ingress.pool.release(up)
        self.on_end(result)

    def _finish(self) -> None:
        ex, watch = self.ex, self.watch
        tail = watch.flush() + self.held
        if not self.held and _DONE not in tail and ex.path in STREAMABLE_PATHS:   # the engine ended
            tail += b"data: [DONE]\n\n"                                         # without [DONE]: say so
        ex.took(watch)
        conn = ex.client.conn
        start = b"" if ex.sent else ex.stream_head(self.head)
        ex.finish("ok", start + conn.data(tail) + conn.end())
        self._end(True)

    def _fail(self, reason: str) -> None:
        ex = self.ex
        if not ex.sent:
            self.up.reused = False   # not a stale pooled connection: no second try on this session
            self._end(UpstreamFailure(reason), discard=True)
            return
        if ex.resume(self.watch):   # another session continues it from the text that went out
            self._end(Continuation(reason), discard=True)
            return
        ex.cut_stream(reason, self.watch)
        self._end(False, discard=True)

    def _client_gone(self) -> None:
        ex = self.ex
        ex.took(self.watch)   # what was generated is metered
        ex.finish("gone")
        self._end(ConnectionResetError("the client closed the connection"), discard=True)


# =============================================================================================
# Client connections: one parser per connection (the codec, h11 inside it for odd requests),
# the connection protocol, and the loop that serves its requests
# =============================================================================================
# A request head is the codec's own MessageHead (method, target, headers with lower-case names,
# fields as a dict), whichever parser read it: h11's Request is turned into one.
_Request = otela_node.MessageHead


_WHOLE_ANSWER = otela_node.whole_answer_format(SESSION_HEADER)
_EOM = h11.EndOfMessage()


class _ClientConn:
    """The parser of one client connection and the writer of its answers: the codec for the
    requests a proxy sees all day, h11 inside it for a request only h11 judges.

    h11's general machinery was over a third of the CPU time of a proxied request, so the codec
    (otela_node.parse_request) reads every head first. It takes HTTP/1.1 with a Host field, a
    Content-Length or chunked body (or none), kept alive, no Expect or Upgrade. A head it
    refuses (a framing that could smuggle a request) raises h11.RemoteProtocolError, as h11
    would (400 and close). A request it leaves to h11 (or a head incomplete at the end of the
    connection) goes, with the bytes buffered, to an h11.Connection made for it, so every odd
    case keeps h11's exact behaviour; at the next request boundary the codec takes the bytes
    h11 buffered back. Either way the caller sees one parser with h11's face: next_event gives
    a MessageHead, h11.Data, h11.EndOfMessage, NEED_DATA or ConnectionClosed; our_state and
    their_state are h11's state objects; head, data and end frame the answer.
    """

    __slots__ = ("buf", "our_state", "their_state", "waiting_for_continue", "extra", "max_header",
                 "_head", "_body", "_chunked", "_close", "_eof", "_h11")

    def __init__(self, max_header: int = MAX_HEADER_BYTES):
        self.max_header = max_header   # a request head's bytes at most (Limits.max_header_bytes)
        self.buf = bytearray()
        self.our_state = self.their_state = h11.IDLE
        self.waiting_for_continue = False   # the request said Expect: 100-continue (h11 reads it)
        self.extra = b""   # header lines every answer to this request carries (_Client.tag)
        self._head: Any = None   # the request being read
        self._body = _NO_BODY    # its body's reader: made when a body is read piece by piece
        self._chunked = self._close = self._eof = False
        self._h11: Optional[h11.Connection] = None   # while it reads a request the codec left to it

    @property
    def eof(self) -> bool:
        """The client closed its side."""
        return self._eof

    @property
    def by_h11(self) -> bool:
        """The request being read is h11's."""
        return self._h11 is not None

    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return len(self.buf) if self._h11 is None else len(self._h11.trailing_data[0])

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
        if self._h11 is not None:
            self._h11.receive_data(data)
        elif data:
            self.buf += data

    def next_event(self) -> Any:
        if self._h11 is not None:
            return self._h11_event()
        state = self.their_state
        buf = self.buf
        try:
            if state is h11.SEND_BODY:
                body = self._body
                if body is None:   # (whole_body takes a buffered body without one)
                    head = self._head
                    body = self._body = otela_node.BodyReader(head.framing, head.length)
                piece = body.take(buf)
                if piece is None:
                    self.their_state = h11.DONE
                    return _EOM
                if piece:
                    return h11.Data(data=piece)
                if self._eof:
                    raise h11.RemoteProtocolError("peer closed the connection mid-body")
                return h11.NEED_DATA
            if state is not h11.IDLE:
                return h11.PAUSED
            head = otela_node.parse_request(buf, self.max_header)
        except otela_node.HTTPViolation as exc:
            raise h11.RemoteProtocolError(str(exc), error_status_hint=400) from None
        if head is None:
            if self._eof:
                return self._hand_to_h11() if buf else h11.ConnectionClosed()
            return h11.NEED_DATA
        if head is otela_node.H11_JUDGES or not head.keep_alive:   # h11 writes the Connection: close
            return self._hand_to_h11()   # (its framing passed the codec's check already)
        del buf[:head.size]
        self._head, self._body = head, None
        self.their_state = h11.SEND_BODY
        self.our_state = h11.SEND_RESPONSE
        return head

    def whole_request(self, data: bytes, limit: int) -> Optional[_Request]:
        """The common request read from `data`, one read, without touching the buffer (a
        bytearray: its methods are other code than bytes' for a cold CPU to run): when `data` is
        exactly one plain POST to a proxied route with a body of at most `limit` bytes and
        nothing is buffered before it, its head, the request then read whole (its body is
        data[head.size:]); else None, nothing done (receive_data takes `data`, as any other)."""
        if self._h11 is not None or self.buf or self.their_state is not h11.IDLE:
            return None
        try:
            head = otela_node.parse_request(data, self.max_header)
        except otela_node.HTTPViolation:   # refused by next_event, with its answer
            return None
        if head is None or head is otela_node.H11_JUDGES or not head.keep_alive \
                or head.framing is not otela_node.LENGTH or head.size + head.length != len(data) \
                or head.length > limit or head.target not in PROXIED_PATHS:
            return None
        self._head, self._body = head, None   # as next_event and whole_body leave it
        self.their_state, self.our_state = h11.DONE, h11.SEND_RESPONSE
        return head

    def whole_body(self, limit: int) -> Optional[bytes]:
        """The body of the request just parsed when it has a Content-Length of at most `limit`
        and all of it is buffered (the request is then complete), else None (nothing consumed)."""
        head, buf = self._head, self.buf
        if self._h11 is not None or self.their_state is not h11.SEND_BODY or self._body is not None \
                or head.framing is not otela_node.LENGTH or head.length > len(buf) or head.length > limit:
            return None
        self.their_state = h11.DONE
        return otela_node.BodyReader(otela_node.LENGTH, head.length).take(buf) or b""   # (None: empty)

    def continue_(self) -> bytes:
        """The interim 100 Continue a client that asked for it waits for before its body, or
        b"" when it did not ask."""
        if not self.waiting_for_continue:
            return b""
        self.waiting_for_continue = False
        return self._h11_send(h11.InformationalResponse(status_code=100, headers=[]))

    def head(self, status: int, headers: List[Tuple[bytes, bytes]]) -> bytes:
        """The response head (what h11 would write for h11.Response(...), without building one)."""
        if self._h11 is not None:
            extra = self.extra
            if extra:
                headers = headers + [tuple(line.split(b": ", 1)) for line in extra.split(b"\r\n") if line]
            return self._h11_send(h11.Response(status_code=status, headers=headers, reason=otela_node.REASONS.get(status, b"")))
        head, self._chunked, self._close = otela_node.answer_head(status, headers, self.extra)
        self.our_state = h11.SEND_BODY
        return head

    def whole_answer(self, status: int, content_type: bytes, session: bytes, payload: bytes) -> bytes:
        """A complete Content-Length answer with the ingress's headers, in one format."""
        if self._h11 is not None:
            return self.head(status, [(b"content-type", content_type), (b"content-length", b"%d" % len(payload)),
                                      (SESSION_HEADER, session)]) + self.data(payload) + self.end()
        self._chunked = self._close = False
        self.our_state = h11.DONE
        return _WHOLE_ANSWER % (status, otela_node.REASONS.get(status, b""), content_type, len(payload), session,
                                self.extra, payload)

    def data(self, data: bytes) -> bytes:
        """Body bytes framed for the client."""
        if self._h11 is not None:
            return self._h11_send(h11.Data(data=data))
        if self._chunked:
            return b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        return data

    def end(self) -> bytes:
        """The end of the response body, framed for the client."""
        if self._h11 is not None:
            return self._h11_send(_EOM)
        self.our_state = h11.MUST_CLOSE if self._close else h11.DONE
        return b"0\r\n\r\n" if self._chunked else b""

    def start_next_cycle(self) -> None:
        if self.our_state is not h11.DONE or self.their_state is not h11.DONE:
            raise h11.LocalProtocolError("not in a reusable state")
        if self._h11 is not None:   # the codec again, with what h11 buffered after its request
            self.buf += self._h11.trailing_data[0]
            self._h11 = None
            self.extra, self.waiting_for_continue = b"", False
        self.our_state = self.their_state = h11.IDLE

    # -- h11, for the request the codec left to it -------------------------------------------------
    def _hand_to_h11(self) -> Any:
        conn = self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_header)
        conn.receive_data(bytes(self.buf))
        self.buf.clear()
        if self._eof:
            conn.receive_data(b"")
        return self._h11_event()

    def _h11_event(self) -> Any:
        conn = self._h11
        try:
            event = conn.next_event()
        finally:
            self.our_state, self.their_state = conn.our_state, conn.their_state
        if type(event) is not h11.Request:
            return event
        self.waiting_for_continue = conn.they_are_waiting_for_100_continue
        headers = otela_node.header_items(event.headers)
        # h11 bounds only a head that arrives in pieces; one that came whole in a single read is
        # measured here. Its framing is checked as the codec's is (a head after blank lines, say).
        if len(event.target) + sum(len(name) + len(value) + 4 for name, value in headers) > self.max_header:
            raise h11.RemoteProtocolError("Request headers too large", error_status_hint=431)
        error = otela_node.framing_error(headers)
        if error is not None:
            raise h11.RemoteProtocolError(error, error_status_hint=400)
        head = _Request(headers, dict(headers), 0)
        head.method, head.target = event.method, event.target
        return head

    def _h11_send(self, event: Any) -> bytes:
        conn = self._h11
        try:
            return conn.send(event)
        finally:
            self.our_state, self.their_state = conn.our_state, conn.their_state


class _BodyRead:
    """A request body being read as it arrives (each data_received takes what came), and what
    the request does with it once whole (`then(body)`)."""

    __slots__ = ("then", "parts", "size")

    def __init__(self, then: Callable[[bytes], None]):
        self.then = then
        self.parts: List[bytes] = []
        self.size = 0


class _Client(asyncio.Protocol):
    """One client connection, served from its protocol callbacks alone.

    data_received feeds the connection's parser (_ClientConn) and `serve` moves the requests
    on: a plain proxied request whose whole body is buffered goes upstream at once
    (Ingress.proxy); any other head is routed (Ingress.route), and a body still arriving is
    taken piece by piece by each data_received (`reading`, under its deadline and the size
    limit); the answer comes back in the upstream connection's callbacks (see _Exchange), or a
    _Relay's for a stream. What waits on something else (a new upstream connection, a usage
    query in an executor) is a future whose completion calls one method back; no task owns the
    connection, nothing is handed over or back. Backpressure: reading pauses while a client is
    far ahead of us (pause_reading), and serving stops while our writes to it are over their
    limit (pause_writing), going on from resume_writing.
    """

    __slots__ = ("ingress", "conn", "transport", "address", "deadline", "idle", "busy", "closed", "ending",
                 "serving", "relay", "exchange", "reading", "waiting", "lingering", "head_only",
                 "write_paused", "read_paused", "request_id", "headless", "limits", "handshaking")

    def __init__(self, ingress: Ingress):
        self.ingress = ingress
        self.limits = limits = ingress.limits
        self.conn = _ClientConn(limits.max_header_bytes)
        self.transport: Any = None
        self.address = ""                # the client's IP address (its share of the connections)
        # when the sweep closes the connection unless a request is being answered: the head is
        # due (head_timeout_s), its body (request_timeout_s), or it idles between requests
        self.deadline = time.monotonic() + limits.head_timeout_s
        self.idle = False                # between requests with nothing of the next one yet
        self.busy = False                # a request is being answered (its body is read)
        self.closed = False              # connection_lost was called
        self.ending = False              # we closed (or are closing) it: nothing more is served
        self.serving = False             # serve is on the stack for this connection
        self.relay: Optional[_Relay] = None       # the stream being relayed to this client, if any
        self.exchange: Optional[_Exchange] = None  # the proxied request in flight (not relaying)
        self.reading: Optional[_BodyRead] = None   # the request body being read, if any
        self.waiting: Optional[asyncio.Future] = None   # a GET endpoint's result being computed
        self.lingering = False           # answered and half-closed: what arrives is dropped
        self.head_only = False           # the request being answered is a HEAD
        self.request_id = b""            # the X-Request-Id of the request being answered
        self.write_paused = self.read_paused = False
        self.headless = False            # among the ingress's connections with no complete head
        self.handshaking: Any = None     # its TLS handshake under way (--tls-cert): nothing is served

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        ingress = self.ingress
        peer = transport.get_extra_info("peername")
        address = self.address = otela_node.address_group(peer[0]) if peer else ""
        if len(ingress.clients) >= ingress.limits.max_connections:
            return self._refuse(503, "Too many connections to the ingress", "too_many_connections")
        held = ingress.per_address.get(address, 0)
        if held >= ingress.max_per_address:
            return self._refuse(429, f"Too many connections from {address}", "too_many_connections")
        ingress.per_address[address] = held + 1
        transport.set_write_buffer_limits(high=STREAM_DRAIN_ABOVE)   # TCP_NODELAY: set by the loop
        ingress.clients.add(self)
        ingress.metrics.connections += 1
        self.await_head()
        if ingress.tls is not None:   # counted and under the head's deadline from its first byte on
            # (not paused here: asyncio on 3.9 would then let start_tls's protocol read the
            # ClientHello before its connection_made, and drop it; a read before start_tls takes
            # over goes to _early)
            loop = asyncio.get_running_loop()
            handshake = self.handshaking = asyncio.ensure_future(loop.start_tls(
                transport, self, ingress.tls, server_side=True, ssl_handshake_timeout=self.limits.head_timeout_s))
            handshake.add_done_callback(functools.partial(self._secured, transport))

    def _early(self, data: bytes, taken: bool = False, turns: int = 0) -> None:
        """Handshake bytes the loop read before start_tls took the connection over (uvloop reads
        right after connection_made, asyncio on 3.9 too): handed to its TLS protocol once that
        has started: a turn of the loop after it took over (its connection_made runs first)."""
        if self.closed or not self.handshaking:
            return
        if len(data) > SSE_CARRY_MAX or turns > 16:   # no ClientHello is this long; start_tls never came
            self.transport.abort()
            return
        tls = self.transport.get_protocol()
        if tls is self or not taken:
            asyncio.get_running_loop().call_soon(self._early, data, tls is not self, turns + 1)
            return
        if hasattr(tls, "buffer_updated"):   # a BufferedProtocol (asyncio >= 3.11, uvloop)
            view = memoryview(data)
            while view:
                buf = tls.get_buffer(len(view))
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                tls.buffer_updated(n)
                view = view[n:]
        else:
            tls.data_received(data)

    def _secured(self, raw: Any, handshake: asyncio.Future) -> None:
        """TLS on an accepted connection (--tls-cert) is up, or failed. It was inside the
        connection's limits throughout: it held its place among the connections and the headless
        ones, and a handshake slower than the head's deadline was cut (the sweep, and start_tls's
        own timeout)."""
        secure = None
        if not handshake.cancelled() and handshake.exception() is None:
            secure = handshake.result()
        if secure is None:   # failed, or the connection ended first (aborted at the deadline: no error)
            self.ingress.metrics.errors["tls_handshake_failed"] += 1
            raw.abort()
            self.connection_lost(None)
            return
        if self.closed:   # (the client went away meanwhile)
            return
        self.handshaking = None
        self.transport = secure
        secure.set_write_buffer_limits(high=STREAM_DRAIN_ABOVE)
        if self.conn.buffered() or self.conn.eof:
            self.serve()

    def await_head(self) -> None:
        """The connection has sent no complete head (yet; or, found by the sweep, not since its
        last request): it is one of at most MAX_HEADLESS such; over it, the oldest is cut whose
        address holds at least its share of them (a client's one new connection is not cut for
        an attacker's many). A request's head takes it out (tag)."""
        ingress = self.ingress
        headless, per = ingress.headless, ingress.headless_per
        if len(headless) >= self.limits.max_headless:
            share = len(headless) / len(per)
            victim = next(iter(headless))
            for other in itertools.islice(headless, HEADLESS_SCAN):
                if per[other.address] >= share:
                    victim = other
                    break
            ingress.headed(victim)
            ingress.metrics.headless_evicted += 1
            victim.transport.abort()
        headless[self] = None
        per[self.address] = per.get(self.address, 0) + 1
        self.headless = True

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer a connection over a cap with an error, and close it without a reset (its request
        may be on the way already: see linger); a TLS one is closed (it speaks no HTTP yet)."""
        if self.ingress.tls is not None:
            self.ingress.metrics.errors[code] += 1
            self.transport.abort()
            return
        self.transport.write(otela_node.whole_response(status, otela_node.error_body(status, message, code),
                                                       close=True, headers=((b"retry-after", b"1"),)))
        self.ingress.metrics.errors[code] += 1
        self.linger()

    def data_received(self, data: bytes) -> None:
        if self.closed or self.lingering:
            return
        if self.handshaking:
            if self.transport.get_protocol() is self:   # the ClientHello, read before start_tls took over
                return self._early(data)
            self.conn.receive_data(data)   # decrypted before start_tls handed us its transport: served
            return                         # once it has (_secured)
        if self.idle:   # the first byte of the next request: its head is due
            self.idle = False
            self.deadline = time.monotonic() + self.limits.head_timeout_s
        if self.busy:
            self.conn.receive_data(data)
        else:
            self.serve(data)
        if not self.read_paused and self.conn.buffered() > 2 * READ_CHUNK and not self.transport.is_closing():
            # a client far ahead of us (pipelining while a request is in flight, or while it
            # does not read our answers) waits in its socket, not in our memory
            self.read_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.lingering:
            return False   # the client read our answer and closed: close too
        if isinstance(self.waiting, Waiting):   # it left while its request waited in the fair queue:
            self.waiting.cancel()                # out at once (HTTP clients do not half-close and
            self.waiting = None                  # wait; one that did would hold a place for nobody)
            return False
        if self.exchange is not None or self.relay is not None:
            # the client's end while its request is at an engine: it left (a closed socket reads
            # as this EOF until a write to it is reset), as nginx (proxy_ignore_client_abort off)
            # and vLLM's server take it; connection_lost stops the engine's work now, not once
            # the answer is written to nobody
            self.transport.abort()
            return False
        self.data_received(b"")
        return self.ingress.tls is None   # half-closed: the answer may still go out (TLS has no half-close)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self.closed:
            return
        self.closed = self.ending = True
        self.conn.receive_data(b"")
        ingress = self.ingress
        # the engine's work for a client that left is wasted GPU time: drop its connection
        if self.relay is not None:
            self.relay.pump()   # it sees the client gone and stops the engine's stream
        elif self.exchange is not None:
            self.exchange.abandon()
        if self.waiting is not None:
            self.waiting.cancel()
        if self.headless:
            ingress.headed(self)
        if self in ingress.clients:
            ingress.clients.discard(self)
            ingress.metrics.connections -= 1
            held = ingress.per_address.pop(self.address, 1) - 1
            if held:
                ingress.per_address[self.address] = held

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.relay is not None:
            self.relay.up.resume_reading()
        elif not self.busy:
            self.serve()   # pipelined requests waited for the client to read

    # -- serving: the requests of this connection, one after the other ---------------------------
    def serve(self, data: Optional[bytes] = None) -> None:
        """Serve what is buffered on the connection, after `data` (what just arrived, if
        anything): parse heads, read bodies, answer or send upstream, until more bytes are
        needed, a request is in flight, our writes to the client are over their limit, or the
        connection ends. Called from callbacks, where a bug must cost this connection a 500, not
        go unseen."""
        if self.serving:   # called back from inside itself: the loop below goes on
            if data is not None:
                self.conn.receive_data(data)
            return
        self.serving = True
        try:
            # the common request, one read holding exactly one plain proxied request, is read
            # from the read's own bytes (see _ClientConn.whole_request); anything else is buffered
            if data is not None and not (data.startswith(b"POST /v1/") and self._serve_whole(data)):
                self.conn.receive_data(data)
            self._serve_buffered()
        except OSError:   # its socket failed under us (write_eof after a reset, say): it is gone
            if self.exchange is not None:
                self.exchange.abandon()
            self.ending = True
            self.transport.abort()
        except Exception as exc:
            self.internal_error(exc)
        finally:
            self.serving = False

    def _serve_whole(self, data: bytes) -> bool:
        if self.ending or self.write_paused:
            return False
        head = self.conn.whole_request(data, self.limits.max_body_bytes)
        if head is None:
            return False
        self.ingress.proxy(self, head.target, head.fields, data[head.size:], time.monotonic())   # (and tag)
        return True

    def _serve_buffered(self) -> None:
        ingress = self.ingress
        while not self.busy and not self.ending and not self.write_paused:
            if self.reading is not None:
                if not self._read_step():
                    return
                continue
            conn = self.conn
            try:
                head = conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint if exc.error_status_hint in otela_node.REASONS else 400
                self.error(HTTPError(431, "Request headers too large", "headers_too_large") if status == 431 else
                           HTTPError(status, f"Bad HTTP request: {exc}", "bad_request"))
                self.close()
                return
            if head is h11.NEED_DATA:
                self.resume_reading()
                return
            if type(head) is not _Request:   # ConnectionClosed, or PAUSED after a protocol switch we never accept
                self.close()
                return
            if head.method == b"POST" and head.target in PROXIED_PATHS:
                body = conn.whole_body(self.limits.max_body_bytes)
                if body is not None:   # the common case: the whole request is here
                    ingress.proxy(self, head.target, head.fields, body, time.monotonic())
                    continue
            t0 = time.monotonic()
            self.deadline = t0 + self.limits.request_timeout_s   # for its body
            self.tag(head.fields)   # X-Request-Id and CORS (see tag)
            try:
                ingress.route(self, head, t0)
            except HTTPError as exc:
                if exc.code == "invalid_api_key" and ingress.await_key(
                        self, functools.partial(ingress.route, self, head, t0)):
                    return   # (it goes on when the keys were read)
                self.error(exc)
                self.finish()

    def read_body(self, fields: Dict[bytes, bytes], then: Callable[[bytes], None]) -> None:
        """Read the request's body as it arrives (see _read_step), then `then(body)`."""
        length = fields.get(b"content-length")
        limit = self.limits.max_body_bytes
        if length is not None and int(length) > limit:
            raise HTTPError(413, f"Request body over the limit of {limit} bytes", "request_too_large")
        go_on = self.conn.continue_()   # b"" unless the client waits for a 100 Continue
        if go_on:
            self.transport.write(go_on)
        self.reading = _BodyRead(then)

    def _read_step(self) -> bool:
        """Take what arrived of the body being read; once it is whole, go on with its request.
        False while more of it is due (or the connection ended)."""
        reading, conn, limit = self.reading, self.conn, self.limits.max_body_bytes
        try:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    if self.closed or conn.eof:   # the client went away mid-body
                        self.reading = None
                        self.close()
                        return False
                    raise HTTPError(400, f"Bad HTTP request body: {exc}", "bad_request") from None
                if event is h11.NEED_DATA:
                    self.resume_reading()
                    return False
                t = type(event)
                if t is h11.Data:
                    reading.size += len(event.data)
                    if reading.size > limit:
                        raise HTTPError(413, f"Request body over the limit of {limit} bytes", "request_too_large")
                    reading.parts.append(event.data)
                elif t is h11.EndOfMessage:
                    self.reading = None
                    self.busy = True   # from here on the request is ours: no client timeout
                    parts = reading.parts
                    body = parts[0] if len(parts) == 1 else b"".join(parts)
                    try:
                        reading.then(body)
                    except HTTPError as exc:   # (a key the CLI made a moment ago: see await_key)
                        if exc.code != "invalid_api_key" or not self.ingress.await_key(
                                self, functools.partial(reading.then, body)):
                            raise
                    return True
                else:   # the client closed mid-request
                    self.reading = None
                    self.close()
                    return False
        except HTTPError as exc:
            self.reading = None
            self.error(exc)
            self.finish()
            return True

    def got(self, answer: asyncio.Future) -> None:
        """A GET endpoint's computed answer: to the client, then on to the next request."""
        self.waiting = None
        if self.closed or answer.cancelled():
            return
        exc = answer.exception()
        if exc is not None and not isinstance(exc, HTTPError):
            return self.internal_error(exc)
        if exc is not None:
            self.error(exc)
        else:
            status, content_type, payload = answer.result()
            self.answer(status, payload, content_type)
        self.serve_next()

    def serve_next(self) -> None:
        """A request was answered from a callback other than this connection's (the upstream's,
        a future's): on to the next request the client sent meanwhile."""
        self.exchange = None
        if self.finish():
            if not self.idle:   # bytes of the next request are here already
                self.serve()
            elif self.read_paused:
                self.resume_reading()

    # -- answers ---------------------------------------------------------------------------------
    def answer(self, status: int, payload: bytes, content_type: bytes = b"application/json",
               extra: Sequence[Tuple[bytes, bytes]] = ()) -> None:
        if self.closed:   # nobody to tell (and uvloop raises on a closed transport)
            return
        conn = self.conn
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(payload))]
        headers.extend(extra)
        if conn.their_state is not h11.DONE and conn.their_state is not h11.MUST_CLOSE:
            headers.append((b"connection", b"close"))   # the request body was left unread
        out = conn.head(status, headers)
        if self.head_only:   # the length a GET would get, and no body
            self.transport.write(out + conn.end())
        else:
            self.transport.write(out + conn.data(payload) + conn.end())

    def error(self, exc: HTTPError, model: str = "", counted: bool = False) -> None:
        if not counted:
            metrics = self.ingress.metrics
            metrics.errors[exc.code or str(exc.status)] += 1
            metrics.requests[(model, exc.status)] += 1
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.answer(exc.status, otela_node.error_body(exc.status, exc.message, exc.code, exc.param, exc.etype),
                        extra=exc.headers)

    def internal_error(self, exc: BaseException) -> None:
        """A bug met while serving a request: say so on stderr and to the client (500), book its
        exchange as an error, and close the connection, whose state is unknown."""
        ex = self.exchange
        trace = f", trace {ex.trace_id.decode()}" if ex is not None and ex.trace_id else ""
        print(f"otela-ingress: internal error: {exc.__class__.__name__}: {exc} "
              f"(request {self.request_id.decode() or '-'}{trace})", file=sys.stderr)
        if ex is not None:
            ex.drop()
            ex.finish("error")
        try:
            self.error(HTTPError(500, "Internal error in the ingress", "internal_error"))
        except Exception:
            pass
        self.busy = False
        self.ending = True
        self.transport.close()

    def tag(self, fields: Dict[bytes, bytes]) -> None:
        """At a request's start: its id (the client's X-Request-Id when sane, else a new one),
        returned on every answer, stored in its ledger row and named in the log; and, for an
        Origin that --cors-origin admits, the CORS headers a browser needs to read the answer.
        Its head is whole: the connection leaves the headless ones."""
        ingress = self.ingress
        if self.headless:
            ingress.headed(self)
        rid = fields.get(REQUEST_ID_HEADER)
        if rid is None or not _REQUEST_ID.fullmatch(rid):
            # unique without a system call per request: this process's random prefix, a counter
            rid = b"req_%s%x" % (_REQUEST_ID_PREFIX, next(_request_numbers))
        self.request_id = rid
        extra = b"x-request-id: %s\r\n" % rid
        origins = ingress.cors_origins
        if origins:
            origin = fields.get(b"origin")
            if origin is not None and (origin in origins or b"*" in origins):
                extra += (b"access-control-allow-origin: %s\r\nvary: origin\r\n"
                          b"access-control-expose-headers: x-request-id, x-otela-session\r\n" % origin)
        self.conn.extra = extra

    # -- the connection's state ------------------------------------------------------------------
    def resume_reading(self) -> None:
        if self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()

    def between_requests(self) -> None:
        """An answer went out: the next head is due (bytes of it are here), or the client idles."""
        self.busy = self.head_only = False
        self.idle = not self.conn.buffered()
        limits = self.limits
        self.deadline = time.monotonic() + (limits.idle_timeout_s if self.idle else limits.head_timeout_s)

    def finish(self) -> bool:
        """After an answer: ready for the next request (True), or the connection is closed."""
        self.between_requests()
        conn = self.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE and not self.closed:
            conn.start_next_cycle()
            return True
        self.close()
        return False

    def close(self) -> None:
        """Close gracefully after a complete answer, abort in the middle of one."""
        self.busy = False
        self.ending = True
        if self.conn.our_state is h11.DONE or self.conn.our_state is h11.MUST_CLOSE:
            self.linger()
        else:
            self.transport.abort()

    def linger(self) -> None:
        """Close after a complete answer without a reset: send our FIN, then read and drop what
        the client still sends until it closes too, or for LINGER_S."""
        self.ending = True
        transport = self.transport
        if transport.is_closing() or self.lingering:
            return
        if not transport.can_write_eof():
            transport.close()
            return
        self.lingering = True
        transport.write_eof()   # after what is buffered: the answer goes out first
        self.resume_reading()
        asyncio.get_running_loop().call_later(self.limits.linger_s, transport.abort)


# =============================================================================================
# The exchange: one proxied request, its lifecycle as a table, and the one place it is booked
# =============================================================================================
RECEIVED, ROUTED, SENT, HEAD, BODY, STREAM, RETRIED, DONE, FAILED = (
    "received", "routed", "sent", "head", "body", "stream", "retried", "done", "failed")
# state -> the states it may go to. Every proxied request runs down this table, moved by the
# client's and the upstream's protocol callbacks; a move not in it is a bug (RuntimeError -> 500).
EXCHANGE_LIFECYCLE = {
    RECEIVED: (ROUTED, FAILED),              # authenticated, parsed; candidates known
    ROUTED: (SENT, RETRIED, FAILED),         # the policy picked a session
    SENT: (SENT, HEAD, RETRIED, FAILED),     # the request went upstream (again, on a fresh
                                             # connection, when a pooled one was stale)
    HEAD: (BODY, STREAM, DONE, RETRIED, FAILED),   # the answer's head is in and judged
    BODY: (DONE, RETRIED, FAILED),           # a plain body being read whole
    STREAM: (DONE, RETRIED, FAILED),         # an SSE stream being relayed
    RETRIED: (ROUTED, FAILED),               # that session failed or refused: maybe another
    DONE: (),                                # the client has its answer
    FAILED: (),                              # it has an error, a cut stream, or is gone
}
# How a request ends -> (state, status it is booked with (None: the engine's), ok for the policy,
# the passive health of the session that answered, whether sessions that refused it with a 5xx
# are blamed, whether it is metered and gets a ledger row).
OUTCOMES = {
    "ok": (DONE, None, True, "succeeded", True, True),          # answered (a 4xx is an answer)
    "poison": (DONE, None, False, None, False, True),           # two sessions refused it: the
                                                                # engine's 5xx, nobody blamed
    "cut": (FAILED, 502, False, "failed", False, True),         # the stream broke after bytes
    "gone": (FAILED, 499, False, None, False, True),            # the client left first
    "exhausted": (FAILED, 502, False, None, True, True),        # every attempt failed
    "error": (FAILED, 500, False, None, False, False),          # a bug (or a policy's); its 500
                                                                # is counted where it is written
}


class _Exchange:
    """One proxied request across its attempts: its state in EXCHANGE_LIFECYCLE, and `finish`,
    the one place where its end is booked (in-flight count, policy, passive health, metrics,
    ledger row), once."""

    # What every exchange starts with, as class attributes rather than slots set per request: an
    # exchange is made per request, and what it does not change costs nothing (see MessageHead).
    state = RECEIVED
    attempts = 0
    candidate: Optional[Candidate] = None
    status = 0
    prompt_tokens: Optional[int] = 0
    completion_tokens = 0
    cached_tokens: Optional[int] = None   # the engine's cached prompt tokens, when it said
    answer_bytes = 0                      # the bytes its answer came in (bound_usage)
    completion_cap: Optional[int] = None  # the completion tokens the request asked for at most
    ticket: Optional[Ticket] = None       # its booking in the limits' windows (ClusterFlow.admit)
    ranked = False                        # counted in its tenant's requests at priority engines
    slotted = False                       # ... in its tenant's requests in flight (FairQueue.held)
    sent = False            # the stream's head went out: no other session may answer now
    row_head: Optional[tuple] = None   # (candidate, first ledger fields, their JSON)
    refusal: Optional[Tuple[UpstreamHead, bytes]] = None   # this attempt's 5xx answer
    refused: Sequence[Candidate] = ()   # sessions that answered this request with a 5xx
    unanswered: Sequence[str] = ()      # sessions that failed to answer it (connect, reset…)
    left: Sequence[Candidate] = ()      # the sessions it may still try
    up: Optional[Upstream] = None       # the connection this attempt's answer comes on
    connecting: Optional[asyncio.Future] = None   # a new connection being opened for it
    head: Optional[UpstreamHead] = None   # this attempt's answer head
    parts: Sequence[bytes] = ()           # ... and its plain body so far
    watch: Optional[StreamWatch] = None   # a stream being continued on another session (resume)
    method = b"POST"                      # the request's method, ...
    target = b""                          # ... its target upstream (the path and its query) ...
    lines = b""                           # ... its header lines of its own (trace context) ...
    ctype: Optional[bytes] = None         # ... and its content type when not JSON (b"": none)
    chain: Sequence[str] = ()             # the models to fall back to, in order (fall_back)
    first_try = 0                         # attempts made before the current model's first
    pinned = False                        # an admin sent it to one session (x-otela-session): no other
    trace_id = b""                        # its W3C trace id (hex), the client's or one made (trace_context)
    parent_span = b""                     # ... the client's span it continues (b"": it started the trace)
    span_id = b""                         # ... this ingress's span, the engine's parent
    routed_at = sent_at = head_at = 0.0   # when the policy picked, the last attempt went out, its head came
    charged = 0.0                         # prompt tokens charged to its tenant as it left the fair queue
    queued = False                        # it waited in the fair queue ...
    waited_ms = 0.0                       # ... this long (its ledger row says so)

    def __init__(self, ingress, client, path, body, key, routed, strip_usage, tracked, t0):
        self.ingress, self.client, self.path, self.body, self.key = ingress, client, path, body, key
        self.routed, self.strip_usage, self.tracked, self.t0 = routed, strip_usage, tracked, t0
        self.request_id: bytes = client.request_id   # X-Request-Id (see Ingress._tag)
        ingress.metrics.inflight += 1

    def to(self, state: str) -> None:
        if state not in EXCHANGE_LIFECYCLE[self.state]:
            raise RuntimeError(f"a request cannot go from {self.state} to {state}")
        self.state = state

    def pick(self, pool: List[Candidate]) -> Candidate:
        """The next attempt: the policy picks a session (a user's policy may raise)."""
        return self.begin(self.ingress.policy.pick(pool, self.routed))

    def begin(self, candidate: Candidate) -> Candidate:
        """An attempt on `candidate`, which the policy picked, starts."""
        ingress = self.ingress
        self.to(ROUTED)
        attempt = self.attempts
        self.candidate = candidate
        self.attempts = attempt + 1
        if attempt:   # (a first attempt starts from the defaults)
            self.routed.attempt = attempt
            self.status = 0
            self.refusal = None
            ingress.metrics.retries += 1
        ingress.policy.on_request_start(candidate, self.routed)
        self.routed_at = time.monotonic()
        return candidate

    # Who is to blame decides what happens next: a session that fails to answer (connect, reset,
    # bad framing) counts against its passive health and the request moves on; an engine's 4xx
    # is the request's (passed through, never retried); a 5xx answer is held against nobody
    # until another session judges the same request: a success there blames the first, a
    # second 5xx blames the request (a poison one), whose client gets that answer as it is.
    def retry(self, blame: bool, failure: str) -> None:
        """This attempt is over without an answer for the client: the next session is tried
        (next_attempt). `blame`: its session failed to answer (connect, reset, bad framing),
        which counts against its passive health; else it refused with a 5xx, held against nobody
        until another session judges the request."""
        candidate = self.candidate
        self.to(RETRIED)
        ingress = self.ingress
        if blame:
            ingress.health.failed(candidate.session, time.monotonic(), candidate.addr)
            self.unanswered = (*self.unanswered, candidate.session)
        else:
            self.refused = [*self.refused, candidate]
        ingress.policy.on_request_end(candidate, self.routed, False)
        self.left = [c for c in self.left if c is not candidate] or (self.spares() if blame else [])
        self.next_attempt(failure)

    def spares(self) -> List[Candidate]:
        """Every session the request could try failed to answer: the others that serve it now
        (out of rotation for failing, or new since it was routed), so that a connect failure
        is retried on another session when one exists."""
        if self.pinned:
            return []
        try:
            candidates = self.ingress.candidates(self.routed.model, self.key)
        except HTTPError:
            return []
        tried = {*self.unanswered, *(c.session for c in self.refused)}
        return [c for c in candidates if c.session not in tried]

    def finish(self, outcome: str, last: bytes = b"") -> bool:
        """Book the end of the request (OUTCOMES) around `last`, the client's last bytes: the
        ledger row is journalled before they go out (a kill -9 after the client has its answer
        loses no row), the rest right after them, in the same callback, so no other event (no
        request of this client or another) sees the counts before they are right, and the
        answer does not wait for them. False when it was finished already: nothing is booked
        twice."""
        client = self.client
        if self.state is DONE or self.state is FAILED:
            if last and not client.closed:
                client.transport.write(last)
            return False
        state, status, ok, health, blame_refused, booked = OUTCOMES[outcome]
        attempt_open = self.state is not RECEIVED and self.state is not RETRIED
        self.bound_usage()
        self.to(state)
        if status is not None:
            self.status = status
        ingress = self.ingress
        now = time.monotonic()
        row = self.journal_row(now) if booked else None   # journalled; queued for SQLite below
        try:
            if last and not client.closed:   # uvloop raises on a closed transport
                client.transport.write(last)
        finally:   # a journalled row that is never queued would be lost to SQLite
            ingress.metrics.inflight -= 1
            if row is not None:
                ingress.ledger.queue(row)
            if self.ticket is not None:
                ClusterFlow.release(self.ticket, (self.prompt_tokens or 0) + (self.completion_tokens or 0))
        if booked:
            self.account(now)
        candidate = self.candidate
        tracer = ingress.tracer
        if tracer is not None and self.trace_id:
            tracer.add((self.trace_id, self.parent_span, self.span_id, self.routed.path, self.t0, self.routed_at,
                        self.sent_at, self.head_at, now, self.routed.model, self.status,
                        candidate.session if candidate is not None else "", self.attempts))
        if attempt_open and health == "succeeded":
            ingress.health.succeeded(candidate.session, now)
        elif attempt_open and health == "failed":
            ingress.health.failed(candidate.session, now, candidate.addr)
        if blame_refused:   # it refused what another session served, or all failed
            for other in self.refused:
                ingress.health.failed(other.session, now, other.addr)
        if attempt_open:    # last: a user's policy that raises here costs nothing booked
            routed = self.routed
            routed.prompt_tokens, routed.completion_tokens = self.prompt_tokens, self.completion_tokens
            routed.cached_tokens = self.cached_tokens
            ingress.policy.on_request_end(candidate, routed, ok)
        if self.queued or ingress.queue.count:   # (what went out while none waited is not charged: VTC
            ingress.served(self)                 # lifts a tenant that starts waiting past it anyway)
        if self.ranked:   # (its tenant's standing at priority engines: FairQueue.engine_priority)
            ingress.queue.ended(self.key.user)
            ingress.flow.note_inflight(self.key.user, -1)
        if self.slotted:
            ingress.queue.released(self.key.user, ingress.queue.held)
        return True

    # -- booking: the engine's counts bounded, the ledger row (its head made while the engine works),
    #    the counters --------------------------------------------------------------------------
    def took(self, watch: StreamWatch) -> None:
        """A stream's usage, and the bytes it came in, for finish to book."""
        self.prompt_tokens, self.completion_tokens = watch.tokens()
        self.cached_tokens = watch.cached_tokens
        self.answer_bytes = watch.seen

    def bound_usage(self) -> None:
        """The engine's counts held to what this ingress saw ("Engine numbers"): one over its
        bound is booked at the bound, and counted against the session that said it."""
        prompt, completion, cached = self.prompt_tokens, self.completion_tokens, self.cached_tokens
        body = self.body
        size = len(body)
        if prompt is not None and prompt > size:   # (an honest prompt is rarely more tokens than bytes)
            limit = prompt_bound(body)
            if prompt > limit:
                self.prompt_tokens = prompt = self._bounded("prompt", limit)
        if cached is not None and cached > (size if prompt is None else prompt):
            most = prompt_bound(body) if prompt is None else prompt
            if cached > most:
                self.cached_tokens = self._bounded("cached", most)
        if completion:
            cap = self.completion_cap
            limit = min(self.answer_bytes, crdt.MAX_REQUEST_TOKENS, crdt.MAX_REQUEST_TOKENS if cap is None else cap)
            if completion > limit:
                self.completion_tokens = self._bounded("completion", limit)

    def _bounded(self, reason: str, limit: int) -> int:
        session = self.candidate.session if self.candidate is not None else ""
        self.ingress.metrics.usage_bounded[(session, reason)] += 1
        return limit

    def prepare_row(self, candidate: Candidate) -> None:
        """Serialise the fields of the ledger row known before the answer, so that what is left
        between the engine's answer and the client's last byte is a little formatting."""
        if self.ingress.ledger is None:
            return
        head = (time.time(), self.key.id, self.key.user, self.routed.model, candidate.session,
                candidate.record.get("owner", ""))
        self.row_head = (candidate, head, crdt.dumps(head)[:-1])

    def journal_row(self, now: float) -> Optional[tuple]:
        """Journal the ledger row (called before the client gets the last byte). Returns the row,
        for Ledger.queue right after that byte went out, when it is not queued already."""
        ledger = self.ingress.ledger
        if ledger is None:
            return None
        candidate = self.candidate
        row_head = self.row_head
        if row_head is not None and candidate is row_head[0] and self.prompt_tokens is not None and not self.queued:
            # the latency in whole microseconds, written as milliseconds with three decimals from
            # the integer (a float's repr costs more than the rest of the line): the same number
            # in the journal and in SQLite
            micros = round((now - self.t0) * 1e6)
            status, prompt, completion = self.status, self.prompt_tokens, self.completion_tokens
            stream, attempts, tracked = int(self.routed.stream), self.attempts, int(self.tracked)
            # the request id is of JSON-safe characters (_REQUEST_ID), the trace id hex: no escaping needed
            ledger.journal(b'%s,%d,%d,%d,%d.%03d,%d,%d,%d,"%s","%s"]\n' % (
                row_head[2], status, prompt, completion, micros // 1000, micros % 1000, stream, attempts, tracked,
                self.request_id, self.trace_id))
            return row_head[1] + (status, prompt, completion, micros / 1000, stream, attempts, tracked,
                                  self.request_id.decode(), self.trace_id.decode())
        ledger.record((
            time.time(), self.key.id, self.key.user, self.routed.model,
            candidate.session if candidate else "", candidate.record.get("owner", "") if candidate else "",
            self.status, self.prompt_tokens, self.completion_tokens, round((now - self.t0) * 1000.0, 3),
            int(self.routed.stream), self.attempts, int(self.tracked), self.request_id.decode(),
            self.trace_id.decode() or None) + ((round(self.waited_ms, 3),) if self.queued else ()))
        return None

    def account(self, now: float) -> None:
        """The request in the metrics, the cluster's usage counters and the usage statistics."""
        model, status = self.routed.model, self.status
        prompt, completion = self.prompt_tokens, self.completion_tokens
        ingress = self.ingress
        metrics = ingress.metrics
        metrics.requests[(model, status)] += 1
        if status >= 400:
            metrics.errors["upstream_" + str(status)] += 1
        metrics.observe(metrics.latency, model, now - self.t0)
        ingress.cluster.count(self.key, model, prompt, completion)   # the G-Counter slot
        if prompt:
            metrics.tokens[(model, "input")] += prompt
        if completion:
            metrics.tokens[(model, "output")] += completion
        if status == 200:
            ingress.stats.add(model, now, prompt, completion)


    # -- sending: an attempt on a kept-alive connection to its session, or on a new one -----------
    def send(self, candidate: Candidate, fresh: bool) -> None:
        """Send this attempt on a kept-alive connection to its session, or on a new one once it
        is open (_connected)."""
        pool = self.ingress.pool
        up = None if fresh else pool.take_idle(candidate.addr, candidate.pin)
        if up is None:
            connecting = self.connecting = asyncio.ensure_future(pool.acquire(candidate.addr, True, candidate.pin))
            connecting.add_done_callback(functools.partial(self._connected, candidate))
            return
        self._send_on(candidate, up)

    def _connected(self, candidate: Candidate, connecting: asyncio.Future) -> None:
        """A new connection for an attempt is open, or failed to open."""
        if self.connecting is not connecting:   # the client left (or the ingress stopped) meanwhile
            if not connecting.cancelled() and connecting.exception() is None:
                self.ingress.pool.discard(connecting.result())
            return
        self.connecting = None
        if connecting.cancelled():
            return
        try:
            exc = connecting.exception()
            if isinstance(exc, UpstreamFailure):
                return self.retry(blame=True, failure=str(exc))
            if exc is not None:
                raise exc
            self._send_on(candidate, connecting.result())
        except Exception as exc:   # a bug, from a future's callback: nobody else would see it
            self.client.internal_error(exc)

    def _send_on(self, candidate: Candidate, up: Upstream) -> None:
        failure = self.ingress.pool.send_request(up, self.target or self.path, self.routed.stream, self.body,
                                                 self.routed, self.method, self.lines, self.ctype)
        if failure is None:
            return self.sent_on(candidate, up)
        if up.reused:   # a pooled connection closed under us: again on a fresh one, no failure
            return self.send(candidate, fresh=True)
        self.retry(blame=True, failure=str(failure))

    def sent_on(self, candidate: Candidate, up: Upstream) -> None:
        """The attempt's request went out on `up`: its answer is read from there."""
        self.to(SENT)
        self.up, self.head = up, None
        self.sent_at = time.monotonic()
        proto = up.proto
        proto.on_data = functools.partial(self._on_answer, up)
        if self.row_head is None or self.row_head[0] is not candidate:
            self.prepare_row(candidate)   # while the engine works on the request
        if up.buf or proto.eof:   # it spoke (or closed) before we listened
            self._on_answer(up)

    def next_attempt(self, failure: str) -> None:
        """Try the session the policy picks next, or answer 502 once MAX_ATTEMPTS sessions (or
        every one there is) failed to answer."""
        left = self.left
        if not left or self.attempts - self.first_try >= self.ingress.limits.max_attempts:
            if self.sent:   # a stream that no other session could continue
                self.cut_stream(failure, self.watch)
                return self.client.serve_next()
            if self.chain and self.fall_back(failure):
                return
            exc = HTTPError(502, f"Every provider attempt failed ({self.attempts} tried; last: {failure})",
                            "upstream_failed")
            self.finish("exhausted")
            self.client.error(exc, self.routed.model, counted=True)
            return self.client.serve_next()
        self.send(self.pick(left), fresh=False)

    def fall_back(self, failure: str) -> bool:
        """Every attempt at this model failed before the first byte (5xx, no answer, no session
        left): the request goes to the next model of its chain that has sessions, its body naming
        it; the answer names it (x-otela-model), the ledger books it. False when none is left."""
        ingress, before = self.ingress, self.routed.model
        while self.chain:
            model, self.chain = self.chain[0], self.chain[1:]
            try:
                candidates = ingress.health.healthy(ingress.candidates(model, self.key))
            except HTTPError:
                continue
            self.body = with_model(self.body, self.ctype, model)
            if self.target:
                self.target = with_model_target(self.target, before, model)
            self.routed.model = model
            self.refused, self.unanswered, self.left, self.first_try = (), (), candidates, self.attempts
            ingress.metrics.fallbacks[(before, model)] += 1
            if _HEADER_SAFE.fullmatch(model):   # (in place of the one naming the model before)
                conn = self.client.conn
                conn.extra = _MODEL_LINE.sub(b"", conn.extra) + b"%s: %s\r\n" % (MODEL_HEADER, model.encode())
            print(f"otela-ingress: request {self.request_id.decode()} (trace {self.trace_id.decode()}) falls back "
                  f"from {before} to {model} ({failure})", file=sys.stderr)
            self.send(self.pick(candidates), fresh=False)
            return True
        return False

    # -- the answer: its head, then its plain body whole, or a stream relayed ----------------------
    def _on_answer(self, up: Upstream) -> None:
        """The upstream protocol's hook while an attempt's answer head, or its plain body, comes."""
        try:
            self._read_answer(up)
        except Exception as exc:   # from the upstream's data_received: nobody else would see it
            self.client.internal_error(exc)

    def _read_answer(self, up: Upstream) -> None:
        head = self.head
        if head is None:
            try:
                head = up.parse_head()
            except UpstreamFailure as exc:
                return self._answer_failed(up, str(exc))
            if head is None:
                if up.proto.eof:
                    exc = up.proto.exc
                    return self._answer_failed(up, f"{up.addr}: connection closed before a response"
                                               + (f" ({exc})" if exc else ""))
                return
            self.head = head
            self.to(HEAD)
            self.status = head.status
            self.head_at = time.monotonic()
            if head.status == 200 and (self.routed.stream and self.path in STREAMABLE_PATHS
                                       or head.fields.get(b"content-type", b"").startswith(b"text/event-stream")):
                self.to(STREAM)
                self.up = self.client.exchange = None   # the relay has both from here
                _Relay(self, up, head, self._stream_end).pump()
                return
            if self.sent:   # a continuation refused: nothing but a stream can follow what went out
                self.up = None
                up.proto.on_data = None
                self.ingress.pool.discard(up)
                self.cut_stream(f"{self.candidate.addr} answered {head.status} to the stream's continuation",
                                self.watch)
                return self.client.serve_next()
            self.parts = []
        parts = self.parts
        try:
            while True:
                piece = up.take()
                if piece:
                    parts.append(piece)
                    if up.body.done:   # (the common answer: its whole body in one read, one take)
                        break
                    continue
                if piece is None:
                    break
                if not up.proto.eof:   # more is due
                    if self.state is HEAD:
                        self.to(BODY)
                    up.last = time.monotonic()
                    up.resume_reading()
                    return
                up.end_of_stream()   # the end of an until-close body, or a failure
                break
        except UpstreamFailure as exc:
            return self._answer_failed(up, str(exc))
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        self.up = None
        pool = self.ingress.pool
        if head.status in RETRY_STATUSES and not self.pinned and (not self.refused or self.chain):
            # held against nobody until another session judges the same request; a second 5xx
            # of a model with fallbacks is its last: the next model is tried (fall_back)
            pool.release(up)
            self.refusal = (head, payload)
            if self.refused:
                self.left = []
            return self.retry(blame=False, failure=f"{self.candidate.addr} answered {head.status}")
        # a 5xx from a second session is the request's fault ("poison"): its client gets it
        self._send_plain(head, payload, "ok" if head.status not in RETRY_STATUSES else "poison")
        pool.release(up)   # after the answer went out, before the next request
        self.client.serve_next()

    def _answer_failed(self, up: Upstream, reason: str) -> None:
        self.up = None
        up.proto.on_data = None
        self.ingress.pool.discard(up)
        if self.head is None and up.reused:   # a stale pooled connection: again on a fresh one, no failure
            return self.send(self.candidate, fresh=True)
        self.retry(blame=True, failure=reason)

    def _send_plain(self, head: UpstreamHead, payload: bytes, outcome: str) -> None:
        """Finish the exchange (its ledger row journalled), then send the whole answer to the
        client (its status is the exchange's already)."""
        if head.status == 200:
            self.prompt_tokens, self.completion_tokens = usage_of(payload)
            self.cached_tokens = cached_of(payload)
            self.answer_bytes = len(payload)
        client = self.client
        client.conn.extra += server_timing(self)
        out = client.conn.whole_answer(head.status, head.fields.get(b"content-type", b"application/json"),
                                       self.candidate.session_bytes, payload)
        self.finish("gone" if client.closed else outcome, out)   # "gone": answered, but nobody left to hear it

    def stream_head(self, head: UpstreamHead) -> bytes:
        """The head of a relayed stream's answer (see _Relay); from here no other session may
        answer."""
        self.sent = True
        ingress, routed = self.ingress, self.routed
        routed.first_at = now = time.monotonic()
        ingress.metrics.observe(ingress.metrics.ttfb, routed.model, now - self.t0)
        if ingress.on_first_byte is not None:
            ingress.on_first_byte(self.candidate, routed)
        return self.client.conn.head(200, [(b"content-type", head.fields.get(b"content-type", b"text/event-stream")),
                                           (b"cache-control", b"no-cache"),
                                           (SESSION_HEADER, self.candidate.session_bytes),
                                           (b"server-timing", server_timing(self)[15:-2])])

    def resume(self, watch: StreamWatch) -> bool:
        """The stream broke after bytes went out: ask another session to continue it. The
        request goes again with the text sent so far as the answer's start: a chat's messages
        end with that assistant message and `continue_final_message` (vLLM's and SGLang's
        parameter; llama.cpp's server continues a final assistant message by itself), a
        completion's prompt ends with it; max_tokens is what is left. False (the stream is cut)
        for a stream of several choices, of reasoning or tool calls, or longer than
        RESUME_TEXT_MAX, or when nothing is left to generate."""
        text = watch.generated()
        if text is None or self.attempts >= self.ingress.limits.max_attempts or self.path not in STREAMABLE_PATHS:
            return False
        try:
            request = crdt.loads(self.body)
        except ValueError:
            return False
        if request.get("n", 1) not in (None, 1):
            return False
        if self.path.endswith(b"/chat/completions"):
            messages = request.get("messages")
            if not isinstance(messages, list):
                return False
            request["messages"] = [*messages, {"role": "assistant", "content": text}]
            request["continue_final_message"], request["add_generation_prompt"] = True, False
        elif isinstance(request.get("prompt"), str):
            request["prompt"] += text
        else:
            return False
        for name in ("max_tokens", "max_completion_tokens"):
            stated = request.get(name)
            if isinstance(stated, int) and not isinstance(stated, bool):
                if stated - watch.events < 1:
                    return False
                request[name] = stated - watch.events
        self.body = crdt.dumps(request)
        self.watch = watch
        watch.continued()
        self.ingress.metrics.stream_resumes += 1
        return True

    def cut_stream(self, reason: str, watch: StreamWatch) -> None:
        """The stream broke after bytes went out: the client gets the route's error event and the end."""
        self.ingress.metrics.stream_cuts += 1
        self.took(watch)
        self.finish("cut")
        client = self.client
        client.transport.write(client.conn.data(cut_events(self.path, f"The provider failed mid-stream: {reason}"))
                               + client.conn.end())

    def _stream_end(self, result: Any) -> None:
        """The end of a relayed stream (see _Relay)."""
        client = self.client
        try:
            if isinstance(result, UpstreamFailure):   # nothing went out yet, or a continuation: the next session
                client.exchange = self
                return self.retry(blame=True, failure=str(result))
            if isinstance(result, BaseException):   # the client went away, or a bug
                self.finish("gone" if isinstance(result, OSError) else "error")
                if not isinstance(result, OSError):
                    return client.internal_error(result)
                return client.close()
            client.serve_next()   # the relay finished the exchange ("ok", or "cut")
        except Exception as exc:
            client.internal_error(exc)

    # -- the client left, or the ingress failed it -------------------------------------------------
    def drop(self) -> None:
        """Stop the attempt in flight: its upstream connection closes (the engine can stop
        working for nobody), a connection being opened is given up."""
        self.client.exchange = None
        up, connecting = self.up, self.connecting
        self.up = self.connecting = None
        if up is not None:
            up.proto.on_data = None
            self.ingress.pool.discard(up)
        if connecting is not None:
            connecting.cancel()

    def abandon(self) -> None:
        """The client left before its answer: the engine connection closes and the request is
        metered as 499."""
        self.drop()
        self.finish("gone")
        self.client.busy = False


# =============================================================================================
# LoRA adapters loaded and unloaded while serving (vLLM's routes, through the overlay)
# =============================================================================================
# POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}
# take an admin key. They go to the sessions chosen: the one x-otela-session names, else every
# session of the base model named (the body's `model`, x-otela-model or ?model=; taken out of the
# body the engine gets), else (an unload) every session that has the adapter. Each node reads its
# engine's /v1/models again once the answer passed its tunnel, and its record says the adapter
# with its base; the answer here waits (ADAPTER_SEEN_S at most) until the registry says so, so a
# request for the adapter right after it is routed.
ADAPTER_ROUTES = {b"/v1/load_lora_adapter": "load", b"/v1/unload_lora_adapter": "unload"}
ADAPTER_TIMEOUT_S = 300.0      # a load may fetch the adapter from a hub first
ADAPTER_SEEN_S = 5.0           # a load's answer waits this long for the nodes' records to say it
MAX_ADAPTER_PATH = 4096        # a path or hub id; the record keeps it only within crdt.MAX_STRING
MAX_ADAPTER_ANSWER = 64 * 1024   # bytes of an engine's answer to a load kept for the client


async def ask_session(pool: UpstreamPool, candidate: Candidate, target: bytes, body: bytes,
                      timeout: float) -> Tuple[int, bytes]:
    """One request of the ingress's own to a session through its tunnel (a new connection, closed
    after): the answer's status and body (its first MAX_ADAPTER_ANSWER bytes). UpstreamFailure
    when there is none within `timeout`."""
    up = await pool.acquire(candidate.addr, True, candidate.pin)
    arrived = asyncio.Event()
    up.proto.on_data = arrived.set
    try:
        failure = pool.send_request(up, target, False, body)
        if failure is not None:
            raise failure
        deadline = time.monotonic() + timeout
        head, kept = None, bytearray()
        while True:
            head = head or up.parse_head()
            piece = up.take() if head is not None else b""
            while piece:
                kept += piece[:MAX_ADAPTER_ANSWER - len(kept)]
                piece = up.take()
            up.resume_reading()
            if piece is None:
                return head.status, bytes(kept)
            if up.proto.eof:
                if head is None:
                    raise UpstreamFailure(f"{up.addr}: closed without an answer")
                up.end_of_stream()
                return head.status, bytes(kept)
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise UpstreamFailure(f"{up.addr}: no answer within {timeout:g} s") from None
    finally:
        up.proto.on_data = None
        up.close()
        pool.active.discard(up)


def model_facts(records: Iterable[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """What /v1/models says of a model beyond its id, from the records of the sessions serving
    it: an adapter's `parent` and `root` (as vLLM answers them), the largest `max_model_len`."""
    facts: Dict[str, Dict[str, Any]] = {}
    for record in records:
        window = record.get("max_model_len")
        adapters = record.get("adapters") or {}
        for model in record.get("models") or ():
            fact = facts.setdefault(model, {})
            if model in adapters:
                fact["parent"], fact["root"] = adapters[model][0], adapters[model][1] or model
            if window and window > fact.get("max_model_len", 0):
                fact["max_model_len"] = window
    return facts


def json_object(body: bytes) -> Dict[str, Any]:
    """An admin request's JSON object (none: {}). HTTPError 400 when it is not one."""
    try:
        request = crdt.loads(body or b"{}")
    except (ValueError, RecursionError):
        raise HTTPError(400, "The request body is not valid JSON", "invalid_json") from None
    if not isinstance(request, dict):
        raise HTTPError(400, "The request body must be a JSON object", "invalid_json")
    return request


def adapter_request(body: bytes, action: str) -> Tuple[Dict[str, Any], str]:
    """The checked body of a load or unload, and the adapter's name. HTTPError 400 when wrong."""
    request = json_object(body)
    name = request.get("lora_name")
    if not isinstance(name, str) or not name or len(name) > crdt.MAX_STRING or not name.isprintable():
        raise HTTPError(400, f"lora_name must be 1-{crdt.MAX_STRING} printable characters", "invalid_parameter",
                        "lora_name")
    path = request.get("lora_path")
    if action == "load" and (not isinstance(path, str) or not path or len(path) > MAX_ADAPTER_PATH):
        raise HTTPError(400, f"lora_path must be 1-{MAX_ADAPTER_PATH} characters", "invalid_parameter", "lora_path")
    return request, name


MAX_FALLBACKS = 16             # models one model falls back to (a chain, not a catalogue)
MAX_FALLBACK_LISTS = 4096      # models with a list set at run time


def admin_fallbacks(fallbacks: Dict[str, List[str]], method: bytes, model: str, body: bytes) -> Dict[str, Any]:
    """The admin API's fallback lists of this ingress (as --fallback sets them; not replicated):
    GET /v1/admin/fallbacks lists them, POST /v1/admin/fallbacks/MODEL {"fallbacks": [...]} sets
    one, DELETE /v1/admin/fallbacks/MODEL takes it away. HTTPError when wrong."""
    if not model:
        if method not in (b"GET", b"HEAD"):
            raise HTTPError(405, "Use GET for /v1/admin/fallbacks, or POST or DELETE for /v1/admin/fallbacks/MODEL",
                            "method_not_allowed")
        return {"object": "list", "data": [{"model": m, "fallbacks": f} for m, f in sorted(fallbacks.items())]}
    if len(model) > crdt.MAX_STRING or not model.isprintable():
        raise HTTPError(400, f"A model name is 1-{crdt.MAX_STRING} printable characters", "invalid_parameter")
    if method == b"DELETE":
        if fallbacks.pop(model, None) is None:
            raise HTTPError(404, f"The model '{model}' has no fallbacks", "not_found")
        return {"model": model, "fallbacks": [], "deleted": True}
    if method != b"POST":
        raise HTTPError(405, "Use POST or DELETE for /v1/admin/fallbacks/MODEL", "method_not_allowed")
    given = json_object(body).get("fallbacks")
    if not isinstance(given, list) or not 0 < len(given) <= MAX_FALLBACKS or not all(
            isinstance(m, str) and 0 < len(m) <= crdt.MAX_STRING and m.isprintable() for m in given):
        raise HTTPError(400, f'The body is {{"fallbacks": [MODEL, ...]}}: 1-{MAX_FALLBACKS} model names',
                        "invalid_parameter", "fallbacks")
    if model in given or len(set(given)) < len(given):
        raise HTTPError(400, "A fallback list names each model once, and not the model itself", "invalid_parameter",
                        "fallbacks")
    if model not in fallbacks and len(fallbacks) >= MAX_FALLBACK_LISTS:
        raise HTTPError(400, f"At most {MAX_FALLBACK_LISTS} models have fallbacks", "invalid_parameter")
    fallbacks[model] = list(given)
    return {"model": model, "fallbacks": fallbacks[model]}


class AdapterRoutes:
    """vLLM's load and unload of LoRA adapters through the ingress (see above), and the load asked
    first of a base's session for a request naming an adapter no session has (--adapter-on-demand)."""

    def __init__(self, sessions: Callable[[], Iterable[Tuple[str, Dict[str, Any]]]],
                 record_of: Callable[[str], Optional[Dict[str, Any]]],
                 pool: UpstreamPool, health: PassiveHealth, policy: Any,
                 candidates: Callable[[str, Key], List[Candidate]],
                 pinned: Callable[[bytes, str, Key], List[Candidate]],
                 routable: Callable[[str, Dict[str, Any]], bool],
                 model_elsewhere: Callable[[bytes, bytes, Dict[bytes, bytes], Key], Optional[str]],
                 key_read: Callable[[_Client, Callable[[], None], asyncio.Future], None],
                 loaded: Dict[str, str], on_demand: bool = False):
        self.sessions, self.record_of = sessions, record_of   # the registry's (made at start)
        self.pool, self.health, self.policy = pool, health, policy
        self.candidates, self.pinned, self.routable = candidates, pinned, routable   # the ingress's routing
        self.model_elsewhere, self.key_read = model_elsewhere, key_read
        self.on_demand = on_demand
        self.loaded = loaded   # Grants.loaded: the adapters an admin loaded through here, by base
        self.known: Dict[str, Tuple[str, str]] = {}   # adapter -> (base, path): loads seen, records read
        self.tried: Dict[str, float] = {}   # adapter -> when a load on demand was last asked (monotonic)

    def serve(self, client: _Client, path: bytes, fields: Dict[bytes, bytes], query: bytes, body: bytes) -> None:
        """A load or unload with its body (its key checked as admin on the head): answered once
        every chosen session answered (_Client.got)."""
        client.busy = True
        action = ADAPTER_ROUTES[path]
        try:
            request, name = adapter_request(body, action)
            base = request.pop("model", None) or self.model_elsewhere(b"", query, fields, ANONYMOUS)
            sessions = self._chosen(fields, name, base, action)
        except HTTPError as exc:
            client.error(exc)
            client.finish()
            return
        if action == "load" and isinstance(base, str):
            self.remember(name, base, request["lora_path"])
            if len(self.loaded) < MAX_SIGNATURES or name in self.loaded:
                self.loaded[name] = base
        elif action == "unload":
            self.loaded.pop(name, None)
        answer = client.waiting = asyncio.ensure_future(self._fan_out(path, crdt.dumps(request), sessions, name,
                                                                      action))
        answer.add_done_callback(client.got)

    def _chosen(self, fields: Dict[bytes, bytes], name: str, base: Any, action: str) -> List[Candidate]:
        key = ANONYMOUS
        pin = fields.get(SESSION_HEADER)
        if pin is not None:
            return self.pinned(pin, ANY_MODEL, key)
        if isinstance(base, str) and base:
            return self.candidates(base, key)
        if action == "unload":
            found = [Candidate(sid, record) for sid, record in self.sessions()
                     if name in (record.get("adapters") or {}) and self.routable(sid, record)]
            if found:
                return found
            raise HTTPError(404, f"No session has the adapter '{name}' loaded", "model_not_found", "lora_name")
        raise HTTPError(400, "Name the base model whose sessions load the adapter (the body's 'model', an "
                             "x-otela-model header or ?model=), or one session (x-otela-session)",
                        "missing_model", "model")

    async def _fan_out(self, path: bytes, body: bytes, sessions: List[Candidate], name: str,
                       action: str) -> Tuple[int, bytes, bytes]:
        answers = await asyncio.gather(*(ask_session(self.pool, c, path, body, ADAPTER_TIMEOUT_S)
                                         for c in sessions), return_exceptions=True)
        data, worst = [], 200
        for candidate, answer in zip(sessions, answers):
            if isinstance(answer, BaseException):
                status, text = 502, str(answer)
            else:
                status, text = answer[0], answer[1].decode("utf-8", "replace")
            data.append({"session": candidate.session, "status": status, "message": text})
            if status >= 300 and (worst < 300 or status > worst):
                worst = status
        done = [c.session for c, d in zip(sessions, data) if d["status"] < 300]
        deadline = time.monotonic() + ADAPTER_SEEN_S
        while done and time.monotonic() < deadline and not all(
                (name in ((self.record_of(sid) or {}).get("adapters") or {})) == (action == "load")
                for sid in done):
            await asyncio.sleep(0.02)
        return worst, b"application/json", crdt.dumps({"object": "lora_adapter", "lora_name": name,
                                                       "action": action, "sessions": data})

    def base_of(self, name: str) -> Optional[Tuple[str, str]]:
        """(base, path) of an adapter: from a load passed here, else any record that had it."""
        if name in self.known:
            return self.known[name]
        for _, record in self.sessions():
            found = (record.get("adapters") or {}).get(name)
            if found and found[1]:
                return found[0], found[1]
        return None

    def load_then(self, client: _Client, fields: Dict[bytes, bytes], body: bytes, key: Key,
                  again: Callable[[], None]) -> bool:
        """A request naming an adapter no session has (--adapter-on-demand): the load asked of one
        of its base's sessions (the policy's pick), then `again` routes the request. False (its
        404 stands) where the site does not allow it, the adapter's base and path are unknown, or a
        load of it was just tried."""
        if not self.on_demand:
            return False
        named = fields.get(MODEL_HEADER, b"").strip().decode("utf-8", "replace")
        try:
            named = named or crdt.loads(body).get("model")
        except (ValueError, RecursionError, AttributeError):
            return False
        found = self.base_of(named) if isinstance(named, str) else None
        now = time.monotonic()
        if found is None or self.tried.get(named, -math.inf) > now - ADAPTER_SEEN_S:
            return False
        if len(self.tried) >= 4096:
            self.tried = {}
        self.tried[named] = now
        try:
            candidates = self.health.healthy(self.candidates(found[0], key))
        except HTTPError:   # the base is not served (or not to this key): the adapter's 404 stands
            return False
        session = self.policy.pick(candidates, RoutedRequest(found[0], key.user, key.id, False, "", now))
        client.busy = True
        load = crdt.dumps({"lora_name": named, "lora_path": found[1]})
        waiting = client.waiting = asyncio.ensure_future(self._fan_out(b"/v1/load_lora_adapter", load, [session],
                                                                       named, "load"))
        waiting.add_done_callback(functools.partial(self.key_read, client, again))
        return True

    def remember(self, name: str, base: str, root: str) -> None:
        if name not in self.known and len(self.known) >= 4096:   # bounded: adapters of a site
            self.known.pop(next(iter(self.known)))
        self.known[name] = (base, root)


# =============================================================================================
# The ingress: doubted evictions, admin API, GET endpoints; dispatch, auth, routing, proxy
# =============================================================================================
class EvictionDoubts:
    """Evictions this ingress does not believe yet. An eviction of a session that answered here
    moments ago, or that no confirmer this ingress can check vouched for (unvouched), is doubted:
    the session keeps its requests at this ingress (as its owner last wrote it) for DOUBT_S, or
    until its owner serves again as a new session. Anyone holding the cluster key can evict with
    made-up evidence; a session that really died fails its next requests, which are retried, and
    sits out (PassiveHealth)."""

    def __init__(self, grants: Grants, health: PassiveHealth, lookup: Callable[[str], Optional[Dict[str, Any]]],
                 evicted_here: Optional[Callable[[str], bool]] = None):
        self.grants, self.health, self.lookup = grants, health, lookup   # lookup: the registry's get
        self.evicted_here = evicted_here   # whether this member's own failure detector evicted a session
        self.owned: Dict[str, Dict[str, Any]] = {}   # worker session -> its owner's last routable record
        self.until: Dict[str, Tuple[Dict[str, Any], float]] = {}   # evicted, still routed here
        self.by: collections.Counter = collections.Counter()   # evictions doubted, by reason

    @property
    def total(self) -> int:
        return sum(self.by.values())

    def seen(self, sid: str, record: Optional[Dict[str, Any]]) -> None:
        """A session's record changed: an eviction of one routed here is believed or doubted."""
        if record is None or record.get("role", "worker") != "worker":
            self.owned.pop(sid, None)
            return
        if record["state"] in crdt.ROUTABLE:
            if len(self.owned) >= MAX_SIGNATURES:
                self.owned.clear()
            self.owned[sid] = record
            return
        owned = self.owned.pop(sid, None)
        if owned is None or not record.get("evicted_by") or "unseal" in record:
            return
        now = time.monotonic()
        ago = now - self.health.answered.get(sid, -math.inf)
        why = "answered" if ago < DOUBT_S else self.unvouched(sid, record, owned)
        if why is None:
            return
        self.until[sid] = (owned, now + DOUBT_S)
        self.by[why] += 1
        said = f"it answered here {ago:.1f} s ago" if why == "answered" else DOUBT_REASONS[why]
        print(f"otela-ingress: eviction of {sid} by {record['evicted_by']} doubted: {said}", file=sys.stderr)

    def unvouched(self, sid: str, record: Dict[str, Any], owned: Dict[str, Any]) -> Optional[str]:
        """Why an eviction is not believed on its confirmers' vouchers (one of DOUBT_REASONS), or
        None. Believed: with nothing to check them with (no ingress secret), when this member's own
        failure detector wrote it, or on a voucher that checks under its confirmer's binding key.
        An ungranted confirmer's word counts only where ungranted sessions are believed."""
        authority = self.grants.authority
        if authority is None or (self.evicted_here is not None and self.evicted_here(sid)):
            return None
        if record["version"] < owned["version"]:
            return "unvouched"      # vouchers of a version before the one routed here: a replay
        vouched = authority.vouched(sid, record, self.lookup, self.grants.revoked)
        if vouched is None:
            return None if self.grants.allow_ungranted else "unverifiable"
        return None if vouched else "unvouched"

    def routed(self, now: float) -> Dict[str, Dict[str, Any]]:
        """Evicted sessions still routed here: session -> its owner's last record."""
        for sid in [s for s, (_, until) in self.until.items() if now >= until]:
            del self.until[sid]
        return {sid: owned for sid, (owned, _) in self.until.items()}


class AdminAPI:
    """The admin API, behind an admin key (checked on the head, see Ingress.route): the cluster's
    keys (create, list, revoke) and its usage.
        POST /v1/admin/keys {user, allow?, admin?, rate?, budget_day?, budget_month?, expires?}
        GET  /v1/admin/keys                    every key of the cluster, with use against budget
        POST /v1/admin/keys/{id}/revoke        (or DELETE /v1/admin/keys/{id})
        GET  /v1/admin/usage?key=ID&days=N     the G-Counters' totals per key and day, and per month
        GET  /v1/admin/fallbacks               this ingress's fallback lists (admin_fallbacks)
        POST /v1/admin/fallbacks/MODEL {fallbacks}   (or DELETE /v1/admin/fallbacks/MODEL)
        GET  /v1/admin/limits                  every user's and model's limits (ClusterFlow)
        PUT  /v1/admin/limits/users/NAME {rpm?, tpm?, concurrency?}   (or .../models/MODEL {..., sites?})
        DELETE /v1/admin/limits/users/NAME     (or .../models/MODEL): no limit any more
    A key's own settings (rpm, tpm, concurrency, weight, priority, priorities, sites) are given when it is
    made (POST /v1/admin/keys) or replaced later:
        PUT  /v1/admin/keys/ID/limits {rpm?, tpm?, concurrency?, weight?, priority?, priorities?, sites?}"""

    def __init__(self, cluster: ClusterKeys, usage_days: int, fallbacks: Dict[str, List[str]], flow: ClusterFlow):
        self.cluster, self.flow = cluster, flow
        if cluster.flow is None:
            cluster.use_flow(flow)
        self.usage_days = usage_days   # the longest a usage query looks back (--usage-days)
        self.fallbacks = fallbacks     # the ingress's own table (--fallback), changed in place

    def answer(self, method: bytes, path: bytes, query: bytes, body: bytes) -> Dict[str, Any]:
        """The JSON answer to an admin request with its whole body; raises HTTPError."""
        rest = path[len(ADMIN_PREFIX):].decode("utf-8", "replace").strip("/").split("/")
        if rest == ["keys"] and method == b"GET":
            return {"object": "list", "data": self.keys()}
        if rest == ["keys"] and method == b"POST":
            return self.create(body)
        if len(rest) == 3 and rest[0] == "keys" and rest[2] == "revoke" and method == b"POST" or \
                len(rest) == 2 and rest[0] == "keys" and method == b"DELETE":
            return self.revoke(rest[1])
        if len(rest) == 3 and rest[0] == "keys" and rest[2] == "limits" and method == b"PUT":
            return self.settle(rest[1], body)
        if rest == ["usage"] and method in (b"GET", b"HEAD"):
            return self.usage(query)
        if rest[0] == "fallbacks":
            return admin_fallbacks(self.fallbacks, method, unquote("/".join(rest[1:])), body)
        if rest[0] == "limits":
            return self.limits(method, rest[1:], body)
        raise HTTPError(404, f"No admin route for {method.decode('latin-1')} "
                             f"{path.decode('utf-8', 'replace')}", "unknown_url")

    def keys(self) -> List[Dict[str, Any]]:
        now = time.time()
        out = []
        for digest, record in sorted(self.cluster.records.items(), key=lambda kv: kv[1]["created"]):
            settings = self.cluster.settings_of(digest)
            view = {f: record[f] for f in ("id", "user", "created") if f in record}
            view.update(state=crdt.KEY_STATE_NAMES[record["state"]], allow=record.get("allow", []),
                        admin=record.get("admin", False), rate=record.get("rate", 0.0),
                        expires=record.get("expires"), usage=self.cluster.usage(digest, now),
                        sites=settings.get("sites", []), **{f: settings.get(f, 0) for f in crdt.LIMIT_FIELDS})
            if record["state"] == crdt.KEY_ACTIVE and not crdt.key_accepts(record, now):
                view["state"] = "expired"
            out.append(view)
        return out

    def create(self, body: bytes) -> Dict[str, Any]:
        spec = json_object(body)
        try:
            user, allow, rate, budget_day, budget_month, expires = key_spec(
                spec.get("user"), spec.get("allow"), spec.get("rate", 0.0), spec.get("budget_day", 0),
                spec.get("budget_month", 0), spec.get("expires"))
            queueing = queue_spec(spec.get("weight", 1.0), spec.get("priority"), spec.get("priorities"))
            queueing.update(sites_spec(spec.get("sites")))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "invalid_parameter") from None
        admin = spec.get("admin", False)
        if type(admin) is not bool:
            raise HTTPError(400, "admin must be true or false", "invalid_parameter", "admin")
        try:
            limits = limit_spec(spec)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "invalid_parameter", str(exc).split()[0]) from None
        token, digest, record = new_key(user, allow, admin, rate, budget_day, budget_month, expires)
        settings = key_settings(record["created"], limits, **queueing)
        if crdt.has_settings(settings):   # first: the key never works here without them
            self.flow.set_key_settings(digest, settings)
        self.cluster.publish(crdt.key_entry(digest), record)   # SQLite gets both from there
        return key_answer(token, record, settings)

    def settle(self, key_id: str, body: bytes) -> Dict[str, Any]:
        """Replace a key's settings (a field left out: its default); the answer is the key's, as
        POST /v1/admin/keys gives it, without the token."""
        digest = self._digest(key_id)
        spec, limits = self._limits_body(body, crdt.KEY_SETTINGS, "a key's settings are " + ", ".join(crdt.KEY_SETTINGS))
        try:
            queueing = queue_spec(spec.get("weight", 1.0), spec.get("priority"), spec.get("priorities"))
            queueing.update(sites_spec(spec.get("sites")))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "invalid_parameter", str(exc).split()[0]) from None
        settings = self.flow.set_key_settings(digest, key_settings(time.time(), limits, **queueing))
        answer = key_answer("", self.cluster.records[digest], settings)
        del answer["key"]
        return answer

    @staticmethod
    def _limits_body(body: bytes, fields: Sequence[str], what: str) -> Tuple[Dict[str, Any], Dict[str, int]]:
        """A PUT's JSON object of `fields` only, and the limits in it (limit_spec); else a 400."""
        spec = json_object(body)
        unknown = sorted(set(spec) - set(fields))
        if unknown:
            raise HTTPError(400, f"Unknown field {unknown[0]!r}: {what}", "invalid_parameter", unknown[0])
        try:
            return spec, limit_spec(spec)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "invalid_parameter", str(exc).split()[0]) from None

    def revoke(self, key_id: str) -> Dict[str, Any]:
        digest = self._digest(key_id)
        self.cluster.publish(crdt.key_entry(digest), crdt.revoked(self.cluster.records[digest], time.time()))
        return {"id": key_id, "object": "api_key", "state": "revoked"}

    def limits(self, method: bytes, rest: List[str], body: bytes) -> Dict[str, Any]:
        """The limits of users and models: listed, set (PUT) or cleared (DELETE)."""
        if not rest and method in (b"GET", b"HEAD"):
            users = {r["user"] for r in self.cluster.records.values()}
            return {"object": "list", "data": self.flow.listed(users)}
        kinds = {"users": "u", "models": "m"}
        if len(rest) < 2 or rest[0] not in kinds or method not in (b"PUT", b"DELETE"):
            raise HTTPError(404, "Limits are GET /v1/admin/limits, PUT or DELETE /v1/admin/limits/users/NAME "
                                 "or /v1/admin/limits/models/MODEL", "unknown_url")
        name = unquote("/".join(rest[1:]))
        if not name.strip() or not name.isprintable() or len(name) > crdt.MAX_STRING:
            raise HTTPError(400, f"A {rest[0][:-1]} name is 1 to {crdt.MAX_STRING} printable characters",
                            "invalid_parameter")
        limits, sites = dict.fromkeys(crdt.LIMIT_FIELDS, 0), {}
        if method == b"PUT":
            fields = crdt.LIMIT_FIELDS + (crdt.RESIDENCY_FIELDS if rest[0] == "models" else ())
            spec, limits = self._limits_body(body, fields, "a limit is rpm, tpm and concurrency" +
                                             (", and a model's sites" if rest[0] == "models" else ""))
            try:
                sites = sites_spec(spec.get("sites"))
            except ValueError as exc:
                raise HTTPError(400, str(exc), "invalid_parameter", "sites") from None
        try:
            return self.flow.set_limit(kinds[rest[0]], name, limits, time.time(), **sites)
        except crdt.RecordError as exc:
            raise HTTPError(400, str(exc), "invalid_parameter") from None

    def _digest(self, key_id: str) -> str:
        for digest, record in self.cluster.records.items():
            if record["id"] == key_id:
                return digest
        raise HTTPError(404, f"No key with id {key_id!r}", "key_not_found")

    def usage(self, query: bytes) -> Dict[str, Any]:
        try:
            params = {k: v[0] for k, v in parse_qs(query.decode("ascii"), errors="strict").items()}
            days = max(1, min(self.usage_days, int(params.get("days", str(self.usage_days)))))
        except (UnicodeDecodeError, ValueError):
            raise HTTPError(400, "Bad query: key=ID and days=N (an integer)", "invalid_parameter") from None
        wanted = params.get("key")
        digest = None if wanted is None else self._digest(wanted)
        since = crdt.time_day(time.time() - (days - 1) * 86400.0)
        records = self.cluster.records
        data, months = [], []
        for (key_hash, model, day), sums in sorted(self.cluster.totals(digest).items(),
                                                   key=lambda kv: (kv[0][2], kv[0][1])):
            record = records.get(key_hash, {})
            row = dict(sums, key=record.get("id", key_hash[:8]), user=record.get("user", ""),
                       model=model or "*", day=day)
            if len(day) == 7:                 # a month's totals (per model: each ingress's --db)
                del row["day"]
                months.append(dict(row, month=day))
            elif day >= since:
                data.append(row)
        totals = {f: sum(r[f] for r in data) for f in crdt.USAGE_COUNTS}
        return {"object": "list", "since": since, "data": data, "totals": totals, "months": months}


def routing_stats(policy: Any) -> Dict[str, Dict[str, float]]:
    """The policy's view per session (Policy.stats), {} for a policy without one."""
    stats = getattr(policy, "stats", None)
    view = stats() if callable(stats) else {}
    return view if isinstance(view, dict) else {}


class MetricsPage:
    """GET /metrics: this ingress's counters, its node's and its policy's, as Prometheus text."""

    def __init__(self, sessions: Callable[[], Iterable[Tuple[str, Dict[str, Any]]]],
                 is_suspected: Callable[[str], bool], overlay_metrics: Callable[[], bytes],
                 metrics: Metrics, health: PassiveHealth, grants: Grants, pool: UpstreamPool, doubts: EvictionDoubts, policy: Any, ledger: Callable[[], Optional[Ledger]],
                 tracer: Callable[[], Optional[otela_node.SpanExporter]], flow: Optional[ClusterFlow] = None,
                 queue: Optional[FairQueue] = None):
        self.sessions, self.is_suspected = sessions, is_suspected   # the registry's (made at start)
        self.overlay_metrics = overlay_metrics   # the node's refusals and entries (overlay_metrics)
        self.metrics, self.health, self.grants, self.pool = metrics, health, grants, pool
        self.flow, self.queue = flow, queue
        self.doubts, self.policy = doubts, policy
        self.ledger, self.tracer = ledger, tracer   # (made at start)

    def render(self) -> bytes:
        states: Dict[str, int] = collections.defaultdict(int)
        suspected = 0
        for sid, record in self.sessions():
            state = record.get("state")
            states[crdt.STATE_NAMES.get(state, str(state))] += 1
            if state in (crdt.JOIN, crdt.SERVING) and self.is_suspected(sid):
                suspected += 1
        ledger = self.ledger()
        rows = (ledger.failed_commits, ledger.pending(), ledger.rows_dropped) if ledger is not None else (0, 0, 0)
        body = self.metrics.render(states, suspected, len(self.health.sick(time.monotonic())), *rows)
        body += self.overlay_metrics() + routing_metrics(routing_stats(self.policy))
        if self.queue is not None:
            body += queue_metrics(self.queue)
        unrouted = collections.Counter(self.grants.unrouted(self.sessions()).values())
        families = [
            ("otela_tunnel_impostors_total", "counter", "Connections cut because the node showed another tunnel "
             "certificate than its session's grant pins.", [("", self.pool.impostors)]),
            ("otela_evictions_doubted_total", "counter", f"Evictions not believed here for {DOUBT_S:g} s, by "
             "reason: " + "; ".join(f"{why}: {what}" for why, what in DOUBT_REASONS.items()) + ".",
             [(f'{{reason="{why}"}}', self.doubts.by[why]) for why in DOUBT_REASONS])]
        tracer = self.tracer()
        if tracer is not None:
            families += [
                ("otela_otlp_spans_exported_total", "counter", "Spans the OTLP collector took.",
                 [("", tracer.exported)]),
                ("otela_otlp_spans_dropped_total", "counter", "Spans dropped: the exporter's queue was full, or "
                 "the collector failed or was slower than its timeout.", [("", tracer.dropped)])]
        families.append(("otela_sessions_unrouted", "gauge", "Live sessions routed nothing because of their "
                         "grant, by reason.",
                         [(f'{{reason="{why}"}}', unrouted.get(why, 0)) for why in UNGRANTED_REASONS]))
        if self.flow is not None:
            families += [
                ("otela_rate_limited_total", "counter", "Requests refused 429 rate_limit_exceeded by a limit "
                 "per minute or in flight (ClusterFlow), by whose limit (key, user, model) and type (requests, "
                 "tokens).", [(f'{{subject="{what}",type="{kind}"}}', self.flow.refused[(what, kind)])
                              for what in ("key", "user", "model") for kind in ("requests", "tokens")]),
                ("otela_rate_limits", "gauge", "User and model limits held (lim: entries, not cleared).",
                 [("", len(self.flow.limits))]),
                ("otela_flow_peers", "gauge", "Other ingress sessions whose windows are added to this one's.",
                 [("", len(self.flow.peers))])]
        return body + exposition(families)


def show_site(session: Dict[str, Any], believed: Optional[str]) -> None:
    """A registry view's session: `site` as routing believes it, and what its record claims
    beside it where it names another (a job naming another site than its grant's)."""
    claimed = (session.get("labels") or {}).get(crdt.SITE_LABEL)
    session["site"] = believed
    if claimed is not None and claimed != believed:
        session["site_claimed"] = claimed


class Views:
    """The GET (and HEAD) endpoints: each answers (status, content type, payload), or a future of
    it (a usage query, run in an executor); an HTTPError is its answer."""

    # The views a cluster's operator may not want public (topology, addresses, traffic): without
    # a key by default; with --require-key-for-views, any valid key, as Bearer, or as the
    # password of HTTP Basic, which a browser asks for on /dashboard and then sends itself.
    KEYED = frozenset((b"/v1/registry", b"/metrics", b"/dashboard", b"/", b"/v1/usage/stats"))

    def __init__(self, sessions: Callable[[], Iterable[Tuple[str, Dict[str, Any]]]], session: Callable[[], str],
                 registry_view: Callable[[], Dict[str, Any]],
                 grants: Grants, health: PassiveHealth, stats: UsageStats, policy: Any, metrics: Callable[[], bytes], authenticate: Callable[..., Key],
                 models: Callable[[Key], List[str]], ledger: Callable[[], Optional[Ledger]], db_path: str,
                 no_auth: bool = False, require_key: bool = False):
        self.sessions, self.session = sessions, session   # the registry's (made at start), our session id
        self.registry_view = registry_view   # the node's GET /v1/registry
        self.grants, self.health, self.stats, self.policy = grants, health, stats, policy
        self.metrics, self.authenticate, self.models, self.ledger = metrics, authenticate, models, ledger
        self.db_path, self.no_auth = db_path, no_auth
        self.require_key = require_key   # --require-key-for-views

    def handler(self, path: bytes) -> Optional[Callable[[Dict[bytes, bytes], bytes], Any]]:
        """The endpoint at `path`, None for no view of ours."""
        view = self.ROUTES.get(path)
        if view is not None:
            return functools.partial(view, self)
        if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
            # GET /v1/models/{id} (the SDK's models.retrieve); an id may hold slashes
            return functools.partial(self.model, unquote(path[len(MODEL_PREFIX):].decode("utf-8", "replace")))
        return None

    def check_key(self, path: bytes, fields: Dict[bytes, bytes]) -> None:
        """With --require-key-for-views, a keyed view needs a valid key (Bearer, or Basic's password)."""
        if not self.require_key or path not in self.KEYED:
            return
        scheme, _, credentials = fields.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"basic":
            try:
                token = base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except ValueError:
                token = b""
            fields = {**fields, b"authorization": b"Bearer " + token}
        try:
            self.authenticate(fields)
        except HTTPError as exc:
            if exc.status == 401 and path in (b"/dashboard", b"/"):   # the browser asks for the key
                exc.headers.append((b"www-authenticate", b'Basic realm="otela", charset="UTF-8"'))
            raise

    def healthz(self, fields, query):
        serving = sum(1 for _, r in self.sessions() if serving_worker(r))
        ledger = self.ledger()
        health = ledger.health() if ledger is not None else {"ok": True, "error": None, "failed_commits": 0,
                                                             "pending_rows": 0, "dropped_rows": 0}
        return 200, b"application/json", crdt.dumps({
            "status": "ok" if health["ok"] else "degraded", "session": self.session(),
            "serving_sessions": serving, "auth": not self.no_auth, "ledger": health})

    def registry(self, fields, query):
        view = self.registry_view()
        if isinstance(view, dict):
            unrouted = self.grants.unrouted(self.sessions())
            sessions = view.get("sessions", ())   # a list; a stand-in node's, a dict by session
            for sid, session in sessions.items() if isinstance(sessions, dict) else \
                    ((s.get("session"), s) for s in sessions):
                if sid in unrouted:   # shown apart: with why no request goes there
                    session["unrouted"] = unrouted[sid]
                show_site(session, self.grants.site(session))
            now = time.monotonic()
            view = dict(view, ingress={"session": self.session(), "sick": self.health.sick(now),
                                       "auth": not self.no_auth, "routing": routing_stats(self.policy)})
        return 200, b"application/json", crdt.dumps(view)

    def model_list(self, fields, query):
        created = int(time.time())
        facts = model_facts(r for _, r in self.sessions() if serving_worker(r))
        data = [{"id": m, "object": "model", "created": created, "owned_by": "otela", **facts.get(m, {})}
                for m in self.models(self.authenticate(fields))]
        return 200, b"application/json", crdt.dumps({"object": "list", "data": data})

    def model(self, name: str, fields, query):
        if name not in self.models(self.authenticate(fields)):
            raise HTTPError(404, f"The model '{name}' does not exist or no session serves it",
                            "model_not_found", "model")
        facts = model_facts(r for _, r in self.sessions() if serving_worker(r) and name in r.get("models", ()))
        return 200, b"application/json", crdt.dumps({"id": name, "object": "model", "created": int(time.time()),
                                                     "owned_by": "otela", **facts.get(name, {})})

    def usage(self, fields, query):
        self.authenticate(fields, admin=True)
        params = query_params(query)
        try:
            days = max(1, min(3660, int(params.get("days", "31"))))
        except ValueError:
            raise HTTPError(400, "days must be an integer", "invalid_parameter", "days") from None
        ledger = self.ledger()

        def flush_and_query():   # off the event loop: SQLite
            if ledger is not None:
                ledger.flush()   # every completed request is in the answer
            result = query_usage(self.db_path, days, params.get("user"), params.get("model"))
            return 200, b"application/json", crdt.dumps(result)
        return asyncio.get_running_loop().run_in_executor(None, flush_and_query)

    def usage_stats(self, fields, query):
        return 200, b"application/json", crdt.dumps(self.stats.view(time.monotonic()))

    def prometheus(self, fields, query):
        return 200, b"text/plain; version=0.0.4; charset=utf-8", self.metrics()

    def dashboard(self, fields, query):
        return 200, b"text/html; charset=utf-8", DASHBOARD_HTML

    ROUTES = {b"/healthz": healthz, b"/v1/registry": registry, b"/v1/models": model_list, b"/v1/usage": usage,
              b"/v1/usage/stats": usage_stats, b"/metrics": prometheus, b"/dashboard": dashboard, b"/": dashboard}


async def read_revocations(db_path: str, grants: Grants, publish: Callable[[str, Dict[str, Any]], None],
                           changed: Callable[[], None]) -> None:
    """Revocations `grant revoke` wrote to the --db: told to `grants` and published, as the CLI's
    keys are (one PRAGMA a poll; a small SELECT after a change); `changed` after each read."""
    db, version, seen = None, None, set()
    try:
        while True:
            try:
                db = db or open_db(db_path)
                now_version = db.execute("PRAGMA data_version").fetchone()[0]
                if now_version != version:
                    version = now_version
                    for entry_id, at in load_revocations(db):
                        if entry_id not in seen:
                            seen.add(entry_id)
                            grants.on_revocation(entry_id)
                            publish(entry_id, {"state": 0, "version": 0, "at": at})
                    changed()
            except sqlite3.Error as exc:
                print(f"otela-ingress: reading grant revocations failed (retried): {exc}", file=sys.stderr)
            await asyncio.sleep(GRANT_POLL_S)
    finally:
        if db is not None:
            db.close()


async def read_limits(db_path: str, flow: ClusterFlow, adopt: Callable[[List[Tuple[str, Dict[str, Any]]]], None]
                      ) -> None:
    """The limits this --db holds: the replicated entries once (taken back as they were), then the
    rows `limits set` and `limits clear` write, published as they change (as read_revocations)."""
    db, version, seen = None, None, {}
    try:
        while True:
            try:
                if db is None:
                    db = open_db(db_path)
                    adopt([(e, crdt.loads(r)) for e, r in db.execute("SELECT id, record FROM limit_entries")])
                now_version = db.execute("PRAGMA data_version").fetchone()[0]
                if now_version != version:
                    version = now_version
                    for kind, name, rpm, tpm, concurrency, changed, stored in db.execute(
                            "SELECT kind, name, rpm, tpm, concurrency, changed, queue FROM limits"):
                        if seen.get((kind, name)) != changed and kind in ("u", "m"):   # (keys': Ledger)
                            seen[(kind, name)] = changed
                            flow.set_limit(kind, name, {"rpm": rpm, "tpm": tpm, "concurrency": concurrency},
                                           changed, now=False, **sites_spec(crdt.loads(stored).get("sites")))
            except (sqlite3.Error, ValueError, crdt.RecordError) as exc:
                print(f"otela-ingress: reading limits failed (retried): {exc}", file=sys.stderr)
            await asyncio.sleep(GRANT_POLL_S)
    finally:
        if db is not None:
            db.close()


def store_limit(db: sqlite3.Connection, kind: str, name: str, limits: Dict[str, int], now: float,
                queueing: Optional[Dict[str, Any]] = None) -> None:
    """The CLI's limit of a user or a model (all zero: cleared), or a key's settings (kind "k",
    the name its sha256, `queueing` its fair-queue fields), for the ingress to publish."""
    db.execute("INSERT OR REPLACE INTO limits (kind, name, rpm, tpm, concurrency, changed, queue) "
               "VALUES (?, ?, ?, ?, ?, ?, ?)", (kind, name, limits["rpm"], limits["tpm"], limits["concurrency"],
                                                now, crdt.dumps(queueing or {}).decode()))


SETTINGS_ROW = "settings "   # Ledger.keep_settings's rows among the replicated entries (no entry id has a space)


def load_key_settings(db: sqlite3.Connection) -> Dict[str, Dict[str, Any]]:
    """sha256 -> the settings record of every key the CLI gave settings (store_limit, kind "k")."""
    settings = {}
    for name, rpm, tpm, concurrency, changed, queue in db.execute(
            "SELECT name, rpm, tpm, concurrency, changed, queue FROM limits WHERE kind = 'k'"):
        try:
            stored = crdt.loads(queue)   # (its fair-queue fields, and its sites)
            sites = sites_spec(stored.pop("sites", None))
            settings[name] = key_settings(changed, {"rpm": rpm, "tpm": tpm, "concurrency": concurrency},
                                          **queue_spec(**stored), **sites)
        except (ValueError, TypeError) as exc:   # a hand-edited row: the others still count
            print(f"otela-ingress: settings of key {name[:12]}... not read: {exc}", file=sys.stderr)
    return settings


class Ingress:
    """The HTTP side of the ingress: dispatch, auth, routing and answers (the GET endpoints,
    the admin API, doubted evictions and LoRA adapters are its collaborators above). `node` is an
    otela_node.Node (or anything with its registry, is_suspected, registry_view, tunnel_header,
    on_change, session_id, publish and adopt)."""

    def __init__(self, node: Any, db_path: str = DEFAULT_DB, policy: Any = None,
                 no_auth: bool = False, limits: Optional[Limits] = None,
                 require_code_hash: Optional[str] = None,
                 aliases: Optional[Dict[str, List[str]]] = None, cors_origins: Sequence[str] = (),
                 allow_ungranted: bool = False, catalogue: Sequence[str] = (),
                 fallbacks: Optional[Dict[str, List[str]]] = None, native_routes: Sequence[str] = (),
                 otlp_endpoint: Optional[str] = None, tls: Optional[ssl.SSLContext] = None,
                 usage_days: int = crdt.USAGE_RETENTION_DAYS, usage_months: int = crdt.USAGE_RETENTION_MONTHS,
                 require_key_for_views: bool = False, adapter_on_demand: bool = False):
        """`limits`: the connection, size and time limits (Limits; default: every default).
        `require_code_hash`: route only to sessions advertising this code hash ("self": what
        a worker from this checkout advertises); see --require-code-hash. For warmup_max_s after
        start, until a peer's record arrives, an unknown model is a 503.
        `allow_ungranted`: route to sessions without a grant too (see "Grants"). `catalogue`: the
        models the site offers (its site file's): one that nothing serves yet is starting (503)."""
        self.node = node
        self.limits = limits = limits or Limits()
        self.grants = Grants(None, allow_ungranted)   # the node's authority, once it has started (start)
        self.catalogue = frozenset(catalogue)
        self.usage_days, self.usage_months = usage_days, usage_months   # (--usage-days, --usage-months)
        # (a stand-in node whose registry is whole from the start needs no warm-up)
        self.warmup = 0.0 if getattr(node, "whole_registry", False) else limits.warmup_max_s
        self._warm_until = 0.0   # monotonic time the warm-up ends (cut short by a peer's record)
        self.aliases = dict(aliases or {})   # public name -> served models, tried in order
        self.fallbacks = dict(fallbacks or {})   # model or alias -> the models tried after it fails, in order
        # an engine's own routes outside /v1/ relayed like /v1/ (--native-route): "/tokenize" is
        # that path, "/get_" (a trailing "/" or "_") every path under it
        self.native_routes = frozenset(r.encode() for r in native_routes if not r.endswith(("/", "_")))
        self.native_prefixes = tuple(r.encode() for r in native_routes if r.endswith(("/", "_")))
        self.otlp_endpoint = otlp_endpoint   # spans go there (SpanExporter, made at start)
        self.tls = tls   # the public listener's TLS (--tls-cert, --tls-key; public_tls), None: plain HTTP
        self.tracer: Optional[otela_node.SpanExporter] = None
        self.cors_origins = frozenset(o.encode() for o in cors_origins)   # b"*" for any
        self.require_code_hash = otela_node.code_hash("worker") if require_code_hash == "self" \
            else require_code_hash
        self.db_path = db_path
        self.policy = policy if policy is not None else TTFTPolicy()
        self.policy_body = getattr(self.policy, "wants_body", False) is True   # RoutedRequest.body
        self.on_first_byte = getattr(self.policy, "on_first_byte", None)
        if callable(getattr(self.policy, "attach", None)):
            self.policy.attach(self)
        self.no_auth = no_auth
        self.max_per_address = limits.per_address()
        self.per_address: Dict[str, int] = {}   # open connections per client address (IPv6: /64)
        self.headless: Dict[_Client, None] = {}   # no complete head yet, oldest first (MAX_HEADLESS)
        self.headless_per: Dict[str, int] = {}    # ... how many of them per address
        # keys and usage of every ingress, through the overlay
        self.cluster = ClusterKeys(self._session_id, node.publish, node.adopt, lambda: self.ledger)
        # limits per key, user and model, and every ingress's windows
        self.flow = ClusterFlow(self._session_id, node.publish, self._record_of)
        self.cluster.use_flow(self.flow)   # (keys' settings are limit entries: the flow hands them over)
        self._digests: Dict[bytes, str] = {}   # Authorization header -> sha256 of its valid token
        self._last_miss: Optional[str] = None   # the unknown token authenticate met last (await_key)
        self._missed: Dict[str, float] = {}     # unknown token -> until when it is not looked for again
        self.metrics = Metrics()
        # requests wait here while the engines are saturated (with the TTFT policy's estimates)
        self.queue = FairQueue(limits, self.policy.engines if isinstance(self.policy, TTFTPolicy) else None)
        # ... sharing its tenants' service and requests at priority engines with the other ingresses
        queue, flow = self.queue, self.flow
        queue.remote_service, queue.remote_inflight, queue.note = \
            flow.remote_service, flow.remote_inflight, flow.note_service
        self._queue_tick: Optional[asyncio.TimerHandle] = None
        if queue.guarding and self.on_first_byte is not None:   # a first token ends a guard: the flood's next
            self.on_first_byte = self._first_byte_then_dispatch   # prompt goes then, not at the next tick
        self.stats = UsageStats()
        self.health = PassiveHealth(limits)
        # The node's tunnel is mutual TLS when the cluster certificate is there: the handshake is
        # the credential, and no static one is sent (otela_node, "Tunnel security").
        relay_client, punch = getattr(node, "relay_client", None), getattr(node, "punch", None)
        self.pool = UpstreamPool(getattr(node, "tunnel_client_ssl", None), getattr(relay_client, "open", None),
                                 getattr(node, "tunnel_header", None), limits)
        if punch is not None:
            punch.listeners.append(self.pool.retire)   # a private ingress's punched paths
        self._candidates: Dict[Tuple[str, Tuple[str, ...], Optional[frozenset]], Tuple[float, List[Candidate]]] = {}
        self._signatures: Dict[str, int] = {}   # session -> the hash of its record less VIEW_FIELDS
        self.doubts = EvictionDoubts(self.grants, self.health, self._record_of, getattr(node, "evicted_here", None))
        self.clients: set = set()
        self._server: Optional[asyncio.AbstractServer] = None
        self._sweeper: Optional[asyncio.Task] = None
        self._revocations: Optional[asyncio.Task] = None
        self._limits: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.ledger: Optional[Ledger] = None
        self.admin = AdminAPI(self.cluster, usage_days, self.fallbacks, self.flow)
        # LoRA adapters loaded through the ingress
        self.adapters = AdapterRoutes(self._sessions, self._record_of, self.pool, self.health, self.policy,
                                      self.candidates, self._pinned, self._routable, self._model_elsewhere,
                                      self._key_read, self.grants.loaded, adapter_on_demand)
        self.views = Views(self._sessions, self._session_id, node.registry_view, self.grants,
                           self.health, self.stats, self.policy,
                           MetricsPage(self._sessions, node.is_suspected, functools.partial(overlay_metrics, node),
                                       self.metrics, self.health, self.grants, self.pool, self.doubts,
                                       self.policy, lambda: self.ledger, lambda: self.tracer, self.flow,
                                       self.queue).render,
                           self.authenticate, self.models, lambda: self.ledger, db_path, no_auth,
                           require_key_for_views)
        self._stopped = False
        on_change = getattr(node, "on_change", None)
        if on_change is not None:
            on_change(self._registry_changed)

    # -- what the collaborators above read of the node, and only through these: its registry is
    # made at start, and a rejoin makes a new session id, so each is read when asked ----------
    def _sessions(self) -> Iterable[Tuple[str, Dict[str, Any]]]:
        return self.node.registry.items()

    def _record_of(self, entry_id: str) -> Optional[Dict[str, Any]]:
        return self.node.registry.get(entry_id)

    def _session_id(self) -> str:
        return self.node.session_id

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve HTTP on host:port (0 picks a free port); returns the port."""
        self._loop = asyncio.get_running_loop()
        self.grants.use(getattr(getattr(self.node, "overlay", None), "authority", None))
        if self.warmup > 0 and not any(sid != self.node.session_id and ":" not in sid
                                       for sid, _ in self.node.registry.items()):
            self._warm_until = time.monotonic() + self.warmup
        self.cluster.start(self._loop)   # (first: the ledger's thread hands it keys on this loop)
        self.flow.use(getattr(getattr(self.node, "overlay", None), "authority", None))
        self.cluster.resubject()   # (keys held already were named under no key)
        self.flow.start(self._loop)
        self.ledger = Ledger(self.db_path, self.cluster.read_records, self.cluster.read_settings)
        registry = getattr(self.node, "registry", None)
        if isinstance(registry, crdt.GMap):   # the operator's retention (--usage-days, --usage-months)
            registry.usage_days, registry.usage_months = self.usage_days, self.usage_months
            registry.key_subject = self.cluster.subject   # a key's settings compacted with it
        self.cluster.adopt_slots(load_usage_slots(self.db_path, self.usage_days, self.usage_months))
        if self.otlp_endpoint:
            self.tracer = otela_node.SpanExporter(self.otlp_endpoint, ingress_spans, "otela-ingress")
        try:
            self._server = await self._loop.create_server(lambda: _Client(self), host, port, backlog=1024)
        except OSError as exc:
            self.ledger.close()
            self.ledger = None
            raise OSError(f"cannot serve the API on {host}:{port}: {exc.strerror or exc}") from None
        self._sweeper = asyncio.ensure_future(self._sweep())
        self._revocations = asyncio.ensure_future(read_revocations(self.db_path, self.grants, self.cluster.publish,
                                                                   self._candidates.clear))
        self._limits = asyncio.ensure_future(read_limits(self.db_path, self.flow, self.cluster.adopt_slots))
        return self._server.sockets[0].getsockname()[1]

    async def stop(self, drain: float = 0.0) -> None:
        """Stop accepting; give requests in flight up to `drain` seconds; close everything."""
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + drain
        while time.monotonic() < deadline and any(c.busy for c in self.clients):
            await asyncio.sleep(0.05)
        for task in (self._sweeper, self._revocations, self._limits):
            if task is not None:
                task.cancel()
        if self._queue_tick is not None:
            self._queue_tick.cancel()
        for client in list(self.clients):
            client.transport.abort()
        self.pool.close()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self.cluster.stop()   # our last usage goes out, and into SQLite below
        self.flow.stop()
        if self.tracer is not None:
            self.tracer.stop()
        if self.ledger is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.ledger.close)

    def _registry_changed(self, sid: str = "", record: Optional[Dict[str, Any]] = None) -> None:
        if ":" in sid:   # a key record or usage slot, not a session: routing is unchanged
            kind = crdt.kind_of(sid)
            if record is not None and kind == crdt.REVOCATION:
                self.grants.on_revocation(sid)
                self._candidates.clear()
                return
            if kind == crdt.LIMIT or kind == crdt.FLOW:
                self.flow.on_entry(sid, record)
                if kind == crdt.LIMIT and record is not None and self.ledger is not None:
                    self.ledger.replicate(sid, record)   # kept in the --db (limits table)
                return
            self.cluster.on_entry(sid, record)
            return
        if sid != self.node.session_id:   # a peer's record: the registry is a peer's view now
            self._warm_until = 0.0
        if record is not None and sid in self.health.paths:   # a new path: its failures are past
            self.health.moved(sid, record.get("addr", ""))
        # a worker's published view (load, prefixes, speed) changes every few seconds and routes nothing
        # by itself (a policy reads it from the registry): the candidates stay
        # (kept as the hash of its bytes: 30,000 sessions' records would be ~15 MB as bytes)
        signature = None if record is None else \
            hash(crdt.dumps({k: v for k, v in record.items() if k not in VIEW_FIELDS}))
        if signature is not None and self._signatures.get(sid) == signature:
            return
        if signature is None:
            self._signatures.pop(sid, None)
        else:
            if len(self._signatures) >= MAX_SIGNATURES:
                self._signatures.clear()
            self._signatures[sid] = signature
        self.grants.seen(sid, record)   # (its state or grant may have changed: not on a view's change)
        self.doubts.seen(sid, record)
        self._candidates.clear()
        if record is None or record.get("state") == crdt.LEFT:
            self.metrics.forget(sid)   # a session that left takes its series off /metrics

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = time.monotonic()
            self.pool.sweep(now)
            self._cut_unreachable(now)
            for client in [c for c in self.clients if not c.busy and now > c.deadline]:
                client.transport.abort()
            # kept-alive connections part-way through a next head join the headless ones here,
            # once a second, not at each request's first byte (the common path stays as it was)
            for client in [c for c in self.clients if not (c.busy or c.idle or c.headless or c.ending)
                           and c.waiting is None and c.reading is None]:
                client.await_head()

    def _cut_unreachable(self, now: float) -> None:
        """Answers awaited from a session this ingress no longer routes to (suspected, down or
        gone: its site cut off, its host dead without a reset) and silent for GONE_SILENT_S:
        their connections close, so an attempt that had no byte yet is retried elsewhere and a
        stream is continued (as for a reset). Without this they wait UPSTREAM_IDLE_TIMEOUT_S,
        which is long for a prefill, not for a path. A session wrongly suspected loses at most
        the prefill of what it was silently working on."""
        silent = {up.addr for up in self.pool.active if now - up.last > GONE_SILENT_S}
        if not silent:
            return
        kept = set()   # addresses some session routable here still answers at (a rejoin keeps its address)
        for sid, record in self.node.registry.items():
            addr = record.get("addr")
            if addr in silent and addr not in kept and self._routable(sid, record):
                kept.add(addr)
        for up in [u for u in self.pool.active if u.addr in silent and u.addr not in kept
                   and now - u.last > GONE_SILENT_S]:
            self.pool.discard(up)

    # -- registry -> candidates --------------------------------------------------------------
    def candidates(self, model: str, key: Key) -> List[Candidate]:
        """SERVING, unsuspected sessions serving `model` that the key's allowlist admits, at the
        sites the key and the model may be served at (residency).

        Cached per (model, allowlist, sites) until the registry changes; raises HTTPError 404 for
        a model no live session knows, 403 when only the allowlist stands in the way, 503 when
        the model's sessions are all unhealthy or none is at a site the request may be served at.
        Every attempt's session comes from here (retries, continuations, fallbacks), so a request
        never leaves its sites.
        """
        sites = self.residency(model, key)
        cache_key = (model, key.allow, sites)
        now = time.monotonic()
        hit = self._candidates.get(cache_key)
        if hit is not None and now - hit[0] < CANDIDATE_TTL_S:
            return hit[1]
        node = self.node
        grants = self.grants
        found = known = outside = False
        result = []
        doubted = self.doubts.routed(now) if self.doubts.until else {}
        for sid, record in node.registry.items():
            record = doubted.get(sid, record)
            if record.get("role", "worker") != "worker" or model not in (record.get("models") or ()) \
                    or model not in grants.models(record):
                continue                    # (an ungranted session's models: as if never said)
            if record.get("state") in (crdt.JOIN, crdt.SERVING, crdt.DOWN):
                known = True
            if not self._routable(sid, record):
                continue
            found = True
            grants.served[model] = now
            if not grants.admits(key.allow, sid, record):
                continue
            if sites is not None and grants.site(record) not in sites:   # (no site label: outside)
                outside = True
                continue
            result.append(Candidate(sid, record))
        if not result and outside:
            raise self._outside(model, sites)
        if not result:
            raise self._no_candidate(model, known, found, now)
        # A session inside its job's last minutes (its record's ends_at) gets nothing new while
        # another can serve: its successor, started ahead by the placer, takes over without a gap.
        wall = time.time()
        lasting = [c for c in result if not job_ending(c.record, wall)]
        if lasting:
            result = lasting
        if len(self._candidates) > 4096:   # bounded: models x allowlists in use
            self._candidates.clear()
        self._candidates[cache_key] = (now, result)
        return result

    def residency(self, model: str, key: Key) -> Optional[frozenset]:
        """The sites a request of `key` for `model` may be served at: the key's (its settings)
        and the model's (its limits' entry), both where both are set; None: anywhere."""
        bound = self.flow.model_sites.get(model) if self.flow.model_sites else None
        if bound is None or key.sites is None:
            return key.sites if bound is None else bound
        return key.sites & bound

    @staticmethod
    def _outside(model: str, sites: frozenset) -> HTTPError:
        """No session of `model` at the sites a request may be served at, though one elsewhere
        serves it: 503, as for a model with no healthy session (the model exists and the key may
        use it; an engine at one of its sites, started or healed, serves it: a condition of the
        service, not of the request, and worth a retry), never a session outside."""
        return HTTPError(503, f"No session of '{model}' in the sites its requests may be served at "
                              f"({', '.join(sorted(sites)) or 'none in common between the key and the model'}) "
                              "right now; its requests are never served elsewhere", "no_session_in_sites",
                         headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])

    def _no_candidate(self, model: str, known: bool, found: bool, now: float) -> HTTPError:
        """Why a request for `model` has no candidate: `known`, a live session says it serves it;
        `found`, one takes requests (and the key's allowlist stands in the way)."""
        warming = bool(self._warm_until) and now < self._warm_until   # not heard from a peer yet
        if not known and model in self.catalogue:   # offered, not yet served: the placer starts it
            if not warming:   # (demand once we know nothing serves it)
                self.stats.unserved(model, time.time())
            return HTTPError(503, f"The model '{model}' is starting: the site offers it and no instance "
                                  "serves it yet (the placer's next pass submits one); retry later",
                             "model_starting", headers=[(b"retry-after", str(STARTING_RETRY_S).encode())])
        if not known and warming:
            return HTTPError(503, f"The ingress is starting and has not heard from the cluster yet: "
                                  f"'{model}' may be served; retry", "no_healthy_provider",
                             headers=[(b"retry-after", b"1")])
        if not found and self.grants.was_served(model, now):   # absent, not unknown: it comes back
            return HTTPError(503, f"No session of '{model}' is reachable right now; it was served "
                                  f"{now - self.grants.served[model]:.0f} s ago: retry", "no_healthy_provider",
                             headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])
        if not known or found:   # found: as if it did not exist, an allowlist must not show the catalogue
            return HTTPError(404, f"The model '{model}' does not exist or no session serves it",
                             "model_not_found", "model")
        return HTTPError(503, f"No healthy provider serves '{model}' right now",
                         "no_healthy_provider", headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])

    def models(self, key: Key) -> List[str]:
        names = self._served_models(key)
        names.update(alias for alias, targets in self.aliases.items() if names.intersection(targets))
        return sorted(names)

    def _served_models(self, key: Key) -> set:
        """The models a session the key may use serves (its allowlist, and each model's sites)."""
        names = set()
        grants = self.grants
        bound = key.sites is not None or bool(self.flow.model_sites)
        for sid, record in self.node.registry.items():
            if self._routable(sid, record) and grants.admits(key.allow, sid, record):
                models = grants.models(record)
                if bound:   # (residency: a model served only outside its sites is not the key's)
                    site = grants.site(record)
                    models = [m for m in models if site in (self.residency(m, key) or (site,))]
                names.update(models)
        return names

    def _routable(self, sid: str, record: Dict[str, Any]) -> bool:
        """A session requests go to: a worker whose lifecycle state takes them (serving_worker),
        not suspected, of the code --require-code-hash names (if it names one)."""
        return serving_worker(record) and not self.node.is_suspected(sid) \
            and (not self.require_code_hash or record.get("code_hash") == self.require_code_hash) \
            and self.grants.refusal(sid, record, time.time()) is None

    # -- routes: what a request head asks for ------------------------------------------------
    def route(self, client: _Client, request: otela_node.MessageHead, t0: float) -> None:
        """A request head other than a plain proxied request with its body buffered, tagged
        (_Client.tag): its body read if it has one we take, then proxied, an admin request or a
        GET endpoint. Raises HTTPError for the client."""
        path, _, query = request.target.partition(b"?")
        method, fields = request.method, request.fields
        if not normal_path(path):
            raise HTTPError(400, f"The path {path.decode('utf-8', 'replace')!r} is not in normal form (no '.' or "
                                 "'..' segment, no '//', no '\\', encoded or not)", "invalid_path")
        if method == b"OPTIONS" and self.cors_origins:   # a browser's CORS preflight
            client.answer(204, b"", extra=self._preflight(fields))
            client.finish()
            return
        if method == b"POST" and path in ADAPTER_ROUTES:   # (admin keys only: AdapterRoutes)
            self.authenticate(fields, admin=True)
            return client.read_body(fields, lambda body: self.adapters.serve(client, path, fields, query, body))
        if method == b"POST" and path in PROXIED_PATHS or method != b"HEAD" and self._passes_through(path):
            if _ENCODED_SEPARATOR.search(path):
                raise HTTPError(400, f"The path {path.decode('utf-8', 'replace')!r} hides a separator ('%2F', "
                                     "'%5C'): the engine would decode it into another route", "invalid_path")
            self.authenticate(fields)   # on the head: a stranger's body is never read
            return client.read_body(fields, lambda body: self.proxy(client, path, fields, body, t0, tag=False,
                                                                    method=method, query=query))
        # a GET's stray small body (or its empty one) is read, to keep the connection; a bigger
        # one is never read: the answer closes the connection
        length = fields.get(b"content-length") or b"0"
        small = client.conn.their_state is h11.SEND_BODY and b"transfer-encoding" not in fields \
            and int(length) <= self.limits.max_header_bytes
        if path.startswith(ADMIN_PREFIX):   # the admin API (see _admin)
            self.authenticate(fields, admin=True)   # on the head, like the proxy
            if method == b"POST" or method == b"PUT" or small:
                return client.read_body(fields, lambda body: self._admin(client, method, path, query, body))
            return self._admin(client, method, path, query, b"")
        if small:
            return client.read_body(fields, lambda _: self._get(client, method, path, query, fields))
        self._get(client, method, path, query, fields)

    def _get(self, client: _Client, method: bytes, path: bytes, query: bytes, fields: Dict[bytes, bytes]) -> None:
        """A GET (or HEAD) endpoint: answered here, or, for one whose answer is computed
        elsewhere (a usage query in an executor), when its future is done (_Client.got)."""
        client.busy = True
        client.head_only = method == b"HEAD"   # a GET whose answer has no body
        handler = self.views.handler(path)
        shown = path.decode("utf-8", "replace")
        if handler is None:
            if path in PROXIED_PATHS:
                raise HTTPError(405, f"Use POST for {shown}", "method_not_allowed", headers=[(b"allow", b"POST")])
            raise HTTPError(404, f"No route for {method.decode('latin-1')} {shown}", "unknown_url")
        if method != b"GET" and not client.head_only:
            raise HTTPError(405, f"Use GET for {shown}", "method_not_allowed", headers=[(b"allow", b"GET, HEAD")])
        self.views.check_key(path, fields)
        answer = handler(fields, query)
        if isinstance(answer, asyncio.Future):
            client.waiting = answer
            answer.add_done_callback(client.got)
            return
        status, content_type, payload = answer
        client.answer(status, payload, content_type)
        client.finish()

    # -- auth --------------------------------------------------------------------------------
    def authenticate(self, fields: Dict[bytes, bytes], admin: bool = False) -> Key:
        if self.no_auth:
            return ANONYMOUS
        header = fields.get(b"authorization", b"")
        digest = self._digests.get(header)   # the hash of a token seen before: sha256 costs more
        if digest is None:
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                raise HTTPError(401, "Missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
            digest = hashlib.sha256(token.strip()).hexdigest()
        key = self.cluster.keys.get(digest)   # looked up each time: a revoked key stops working at once
        if key is None:
            if digest not in self.cluster.records:   # unknown here: maybe made by the CLI a moment ago
                self._last_miss = digest
            raise self.cluster.refusal(digest)   # revoked, expired or unknown
        if header not in self._digests:
            if len(self._digests) >= 4096:   # bounded: keys in use, not every token ever tried
                self._digests.clear()
            self._digests[header] = digest
        if admin and not key.admin:
            raise HTTPError(403, "This needs an admin key", "admin_required")
        return key

    # A key `keys create` wrote to SQLite a moment ago is unknown until the next read of it
    # (KEYS_RELOAD_S): its first request waits for a read made at once, then runs again, instead of
    # a 401. One read per token and second at most: a stream of made-up tokens costs a PRAGMA each.
    def await_key(self, client: _Client, again: Callable[[], None]) -> bool:
        """The request whose token authenticate just found unknown runs `again` once the keys
        were read from SQLite (Ledger.reload_keys); False (refuse it now) when this token was
        looked for within KEYS_RELOAD_S, or too many wait."""
        digest, self._last_miss = self._last_miss, None
        ledger, now = self.ledger, time.monotonic()
        if digest is None or ledger is None or self._missed.get(digest, 0.0) > now:
            return False
        if len(self._missed) >= 4096:   # bounded: tokens tried within a second
            self._missed = {}
        self._missed[digest] = now + KEYS_RELOAD_S
        future = ledger.reload_keys()
        if future is None:
            return False
        client.busy = True
        waiting = client.waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(functools.partial(self._key_read, client, again))
        return True

    def _key_read(self, client: _Client, again: Callable[[], None], waiting: asyncio.Future) -> None:
        client.waiting = None
        if client.closed or waiting.cancelled():
            return
        client.busy = False   # (again, as when its head came: a body to read is read by serve)
        try:
            again()
        except HTTPError as exc:
            client.error(exc)
            client.finish()
        except Exception as exc:   # a bug, from a future's callback: nobody else would see it
            return client.internal_error(exc)
        if not client.busy and not client.ending:
            client.serve()   # what the client sent meanwhile

    def _pinned(self, pin: bytes, model: str, key: Key) -> List[Candidate]:
        """The one session an admin's x-otela-session names, if it is routable and serves the
        model (any model, for a request that names none)."""
        sid = pin.strip().decode("ascii", "replace")
        record = self.node.registry.get(sid) if sid and ":" not in sid else None
        if record is None or record.get("role", "worker") != "worker":
            raise HTTPError(404, f"No session {sid!r} in the registry", "session_not_found")
        if model != ANY_MODEL and model not in self.grants.models(record):
            raise HTTPError(404, f"The session {sid!r} does not serve '{model}'", "model_not_found", "model")
        if not self._routable(sid, record):
            raise HTTPError(503, f"The session {sid!r} takes no requests now (state, suspicion, grant or code)",
                            "no_healthy_provider", headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])
        sites = self.residency(model, key)
        if sites is not None and self.grants.site(record) not in sites:   # an admin's key is bound too
            raise HTTPError(403, f"The session {sid!r} is outside the sites this request may be served at "
                                 f"({', '.join(sorted(sites))})", "outside_sites")
        return [Candidate(sid, record)]

    # -- the proxy ---------------------------------------------------------------------------
    def _prepare(self, client: _Client, path: bytes, fields: Dict[bytes, bytes], body: bytes, t0: float,
                 query: bytes = b"") -> Tuple[RoutedRequest, Key, bytes, bool, List[Candidate], Optional[int],
                                              Sequence[str], Optional[bytes]]:
        """Check a proxied request (key, rate, body, model) and find its candidates: what the
        policy sees, the key, the body to send (include_usage or a model's name spliced in), whether
        the stream's usage is ours to strip, the candidates, the completion tokens it asks for at
        most (completion_cap), the models to fall back to, and the content type to send when the
        body is not JSON (None: JSON; b"": none). Raises HTTPError for the client.

        The model is the JSON body's `model`, else a multipart form's field `model` (an audio
        upload), else the x-otela-model header, the query's `model`, or a path segment naming one;
        a request that names none (GET /v1/files, /tokenize) goes to any session serving one of
        the key's models."""
        key = self.authenticate(fields)
        if key.rate > 0 and not key.take(t0):
            raise HTTPError(429, f"Rate limit of {key.rate:g} requests/s exceeded for this key",
                            "rate_limit_exceeded", headers=[(b"retry-after", b"1")])
        if key.budget_day or key.budget_month:
            self.cluster.check_quota(key)   # token budgets, on the cluster's use (ClusterKeys)
        request, model, ctype = self._request_model(path, query, fields, body, key)
        stream, strip_usage, body = self._with_usage(request, path, body)
        model, named, body, candidates, chain = self._route_model(model, key, fields, body, ctype)
        if request and SESSION_HEADER not in fields:   # a prompt past the model's context window: a fallback, or 400
            model, body, candidates, chain, named = self._within_window(model, named, request, key, body, ctype,
                                                                        candidates, chain)
        routed = RoutedRequest(model, key.user, key.id, stream, path.decode("utf-8", "replace"), t0,
                               request if self.policy_body else None)
        if named is not None:
            routed.named = named
        routed.session_key = fields.get(AFFINITY_HEADER)
        return routed, key, body, strip_usage, candidates, completion_cap(request, path), chain, ctype

    def _request_model(self, path: bytes, query: bytes, fields: Dict[bytes, bytes], body: bytes,
                       key: Key) -> Tuple[Dict[str, Any], Optional[str], Optional[bytes]]:
        """The request's JSON object ({} for another body), the model it names (see _prepare) and
        the content type to send (None: JSON)."""
        request: Dict[str, Any] = {}
        model: Any = None
        ctype: Optional[bytes] = None   # JSON: the common case
        proxied = path in PROXIED_PATHS
        if proxied or body and _JSON_START.match(body):
            request, said_json = self._json_body(body, fields, proxied)
            if not said_json:   # a body that is not JSON, of a type that did not say it would be
                ctype = fields.get(b"content-type", b"")
            model = request.get("model")
            if model is not None and (not isinstance(model, str) or not model):
                raise HTTPError(400, "You must provide a model parameter", "missing_model", "model")
        else:
            ctype = fields.get(b"content-type", b"")
            if body and ctype[:19].lower() == b"multipart/form-data":
                span = form_model(body, ctype)
                if span is not None:
                    model = body[span[0]:span[1]].decode("utf-8", "replace").strip() or None
        if model is None:
            model = self._model_elsewhere(path, query, fields, key)
            if model is None and proxied:
                raise HTTPError(400, "You must provide a model parameter", "missing_model", "model")
        return request, model, ctype

    @staticmethod
    def _with_usage(request: Dict[str, Any], path: bytes, body: bytes) -> Tuple[bool, bool, bytes]:
        """Whether it streams, whether the stream's usage is ours to strip, and the body: a stream
        asks its engine for usage (include_usage), which the client gets only if it asked too."""
        options = request.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise HTTPError(400, f"Invalid type for 'stream_options': expected an object, but got "
                                 f"{_JSON_TYPES.get(type(options), 'a value')} instead.", "invalid_type", "stream_options")
        stream = request.get("stream") is True
        if not stream or path not in STREAMABLE_PATHS or isinstance(options, dict) \
                and options.get("include_usage") is True:
            return stream, False, body
        if options is None and "stream_options" not in request:
            start = body.index(b"{") + 1   # splice, so the rest stays byte for byte
            return stream, True, body[:start] + b'"stream_options":{"include_usage":true},' + body[start:]
        request["stream_options"] = dict(options or {}, include_usage=True)
        return stream, True, crdt.dumps(request)

    def _route_model(self, model: Optional[str], key: Key, fields: Dict[bytes, bytes], body: bytes,
                     ctype: Optional[bytes]) -> Tuple[str, Optional[str], bytes, List[Candidate], Sequence[str]]:
        """The model that is tried first, the public name the client used (None: that model), the
        body naming it, its candidates and the models to fall back to."""
        pin = fields.get(SESSION_HEADER)
        if pin is not None:   # an operator's request for one chosen session: no other is tried
            if not key.admin:
                raise HTTPError(403, "Sending a request to a chosen session (x-otela-session) needs an admin key",
                                "admin_required")
            named = None
            if model in self.aliases:   # the first of its models the session serves
                record = self.node.registry.get(pin.strip().decode("ascii", "replace")) or {}
                served = [m for m in self.aliases[model] if m in (record.get("models") or ())]
                if served:
                    named, model = model, served[0]
                    body = with_model(body, ctype, model)
            model = model or ANY_MODEL
            return model, named, body, self._pinned(pin, model, key), ()
        if model is None:
            return ANY_MODEL, None, body, self._any_candidates(key), ()
        if model in self.aliases or model in self.fallbacks:   # a public name, or one with fallbacks
            first, body, candidates, chain = self._first_served(model, key, body, ctype)
            return first, model, body, candidates, chain
        return model, None, body, self.candidates(model, key), ()

    @staticmethod
    def _json_body(body: bytes, fields: Dict[bytes, bytes], proxied: bool) -> Tuple[Dict[str, Any], bool]:
        """The JSON object of a body (and True), or ({}, False) for a body of another type that
        only looks like JSON. 400 when a body that must be JSON (a completion route's, or one
        whose type says so) is not an object."""
        def said_json() -> bool:
            media = fields.get(b"content-type", b"").partition(b";")[0].strip().lower()
            return proxied or not media or media == b"application/json" or media.endswith(b"+json")
        try:
            request = crdt.loads(body)
        except (ValueError, RecursionError):   # the stdlib's json recurses: 100,000 "[" overflow it
            if not said_json():
                return {}, False
            raise HTTPError(400, "The request body is not valid JSON", "invalid_json") from None
        if not isinstance(request, dict):
            if not said_json():
                return {}, False
            raise HTTPError(400, "The request body must be a JSON object", "invalid_json")
        return request, True

    def _model_elsewhere(self, path: bytes, query: bytes, fields: Dict[bytes, bytes], key: Key) -> Optional[str]:
        """The model of a request whose body names none: the x-otela-model header, the query's
        `model`, or a segment of the path naming a model (or alias) the key may use."""
        named = fields.get(MODEL_HEADER)
        if named is not None and named.strip():
            return named.strip().decode("utf-8", "replace")
        if query and b"model=" in query:
            named_in = query_params(query).get("model")
            if named_in:
                return named_in
        text = unquote(path.decode("utf-8", "replace")) + "/"
        for name in sorted(self._served_models(key) | set(self.aliases), key=len, reverse=True):
            if f"/{name}/" in text:
                return name
        return None

    def _any_candidates(self, key: Key) -> List[Candidate]:
        """The sessions serving any model the key may use: for a request that names none."""
        seen, found = set(), []
        for model in sorted(self._served_models(key)):
            try:
                candidates = self.candidates(model, key)
            except HTTPError:
                continue
            for candidate in candidates:
                if candidate.session not in seen:
                    seen.add(candidate.session)
                    found.append(candidate)
        if not found:
            raise HTTPError(404, "The request names no model (in its JSON, a form field 'model', an x-otela-model "
                                 "header, the query or the path), and no session serves a model this key may use",
                            "model_not_found", "model")
        return found

    def proxy(self, client: _Client, path: bytes, fields: Dict[bytes, bytes], body: bytes, t0: float,
              tag: bool = True, method: bytes = b"POST", query: bytes = b"") -> None:
        """A proxied request with its whole body: checked, routed and sent upstream from here;
        its answer comes back in the upstream connection's callbacks (see _Exchange). `tag`: its
        request id is still to be given (see _Client.tag; route's caller gave it already).

        On the common path, a kept-alive connection to the session the policy picked, the
        request goes out first and is booked after, while the engine works on it: its exchange,
        its request id, the policy's count. At 16 requests/s every step before that write is
        paid on a cold CPU, and none of these is needed to send it."""
        client.busy = True
        if tag:   # (its id goes upstream with it)
            client.tag(fields)
        try:
            routed, key, body, strip_usage, candidates, cap, chain, ctype = self._prepare(
                client, path, fields, body, t0, query)
            left = self.health.healthy(candidates)
            candidate = self.policy.pick(left, routed)
            if PRIORITY_HEADER in fields:   # (checked here too: a class the key may not ask for is refused)
                request_class(key, fields, routed.body)
            ticket = self.flow.admit(key, routed.model, body, cap, client) \
                if key.limited or self.flow.active else None   # (Limits: the last check)
        except HTTPError as exc:
            return self._refused(client, fields, body, exc,
                                 lambda: self.proxy(client, path, fields, body, t0, False, method, query))
        queue = self.queue
        if queue.on and (queue.count or queue.full(candidate, routed)) and not queue.overtakes(candidate, left, key):
            # saturated: it waits (FairQueue)
            return self._wait(client, path, fields, body, t0, method, query, routed, key, strip_usage, cap, chain,
                              ctype, left, ticket)
        self._send(client, path, fields, body, t0, method, query, routed, key, strip_usage, cap, chain, ctype, left,
                   candidate, ticket)

    def _send(self, client: _Client, path: bytes, fields: Dict[bytes, bytes], body: bytes, t0: float, method: bytes,
              query: bytes, routed: RoutedRequest, key: Key, strip_usage: bool, cap: Optional[int],
              chain: Sequence[str], ctype: Optional[bytes], left: List[Candidate], candidate: Candidate,
              ticket: Optional[Ticket] = None) -> _Exchange:
        """Send a routed request to the session the policy picked, and make its exchange."""
        if candidate.by_priority and all(c.by_priority for c in left):   # (the body goes to every attempt:
            # a `priority` an engine without priority scheduling refuses is sent only where all take it)
            queue = self.queue
            body = with_engine_priority(body, routed.body, queue.engine_priority(key, request_class(key, fields, routed.body)))
            queue.began(key.user)
            self.flow.note_inflight(key.user, 1)
            ranked = True
        else:
            ranked = False
        trace, parent, span, lines = trace_context(fields, client.request_id)
        target = path + b"?" + query if query else path
        if routed.named is not None and routed.named != routed.model and (query or path not in PROXIED_PATHS):
            target = with_model_target(target, routed.named, routed.model)   # (a model named there)
        up = self.pool.take_idle(candidate.addr, candidate.pin)
        if up is not None and self.pool.send_request(up, target, routed.stream, body, routed, method, lines,
                                                      ctype) is not None:
            up = None   # a pooled connection closed under us: a fresh one, no failure
        if routed.named is not routed.model and routed.named != routed.model and _HEADER_SAFE.fullmatch(routed.model):
            client.conn.extra += b"%s: %s\r\n" % (MODEL_HEADER, routed.model.encode())   # the model that answers
        opt_out = fields.get(NO_TRACK_HEADER)
        tracked = opt_out is None or opt_out.strip().lower() in (b"", b"0", b"false", b"no")
        ex = client.exchange = _Exchange(self, client, path, body, key, routed, strip_usage, tracked, t0)
        ex.left, ex.completion_cap, ex.method, ex.target, ex.ctype = left, cap, method, target, ctype
        ex.trace_id, ex.parent_span, ex.span_id, ex.lines = trace, parent, span, lines
        if SESSION_HEADER in fields:
            ex.pinned = True
        if chain:
            ex.chain = chain
        if ticket is not None:
            ex.ticket = ticket
        if ranked:
            ex.ranked = True
        if self.queue.counting:   # (FairQueue.overtakes: a tenant with few in flight goes at once)
            self.queue.holds(key)
            ex.slotted = True
        ex.begin(candidate)   # (the first attempt: next_attempt's checks hold)
        if up is None:
            ex.send(candidate, fresh=True)
        else:
            ex.sent_on(candidate, up)
        return ex

    # -- the fair queue (FairQueue): a request waits while the sessions for it are full ----------
    def _wait(self, client: _Client, path: bytes, fields: Dict[bytes, bytes], body: bytes, t0: float, method: bytes,
              query: bytes, routed: RoutedRequest, key: Key, strip_usage: bool, cap: Optional[int],
              chain: Sequence[str], ctype: Optional[bytes], left: List[Candidate], ticket: Optional[Ticket]) -> None:
        """Queue a proxied request (429 past the queue's bounds); dispatch_waiting sends it."""
        queue = self.queue
        try:
            refusal = queue.refusal(key, len(body))
            if refusal is not None:
                raise refusal
            rank = request_class(key, fields, routed.body)
        except HTTPError as exc:
            if ticket is not None:
                ClusterFlow.release(ticket, 0)
            client.error(exc)
            client.finish()
            return

        def send() -> Optional[bool]:
            """True: it went (or was answered); False: the session it picked is full, or guarded,
            and another of its model's is not; None: every session of its model is full."""
            healthy = self.health.healthy(left)
            try:
                candidate = self.policy.pick(healthy, routed)
            except HTTPError as exc:   # (a user's policy may refuse)
                queue.remove(entry)
                entry.unbook()
                client.waiting = None
                client.error(exc)
                client.finish()
                return True
            if queue.full(candidate, routed):
                return False if any(c is not candidate and not queue.full(c, routed) for c in healthy) else None
            if queue.guarding and queue.guarded(entry, candidate):
                queue.held_back = True
                return False
            memo = routed.memo
            prompt = memo.size * self.policy.tokens_per_byte if memo is not None else len(body) / 4
            now = time.monotonic()
            queue.went(entry, prompt, now)
            client.waiting = None
            booked, entry.ticket = entry.ticket, None   # (the exchange's now: released at its finish)
            ex = self._send(client, path, fields, body, t0, method, query, routed, key, strip_usage, cap, chain,
                            ctype, left, candidate, booked)
            ex.charged, ex.queued, ex.waited_ms = prompt, True, (now - entry.since) * 1000.0
            return True

        entry = Waiting(queue, send, key, rank, time.monotonic(), len(body), routed.model, client, ticket,
                        earlier_turns(routed.body)[0] > 0)
        queue.add(entry)
        client.waiting = entry   # (cancelled by connection_lost: out of the queue at once)
        self.dispatch_waiting()

    def dispatch_waiting(self) -> None:
        """Send waiting requests in fair order while their sessions take more (FairQueue); answer
        those that waited too long with 429. While any still waits, again in QUEUE_TICK_S."""
        queue = self.queue
        now = time.monotonic()
        for entry in queue.expired(now):
            entry.unbook()
            entry.client.waiting = None
            entry.client.error(HTTPError(
                429, f"The request waited {self.limits.queue_timeout_s:g} s for a free engine; try again later",
                "rate_limit_exceeded", headers=[(b"retry-after", str(QUEUE_RETRY_AFTER_S).encode())],
                etype="requests"))
            entry.client.finish()
        passed: set = set()
        skipped: set = set()     # its pick full, another session of its model not: the next may go
        skips: Dict[str, int] = {}
        queue.held_back = False
        while queue.count:
            entry = queue.order(now, passed, skipped)
            if entry is None:
                break
            went = entry.send()
            if went is None:
                passed.add(entry.model)   # its sessions are full: the next model's requests may go
            elif not went:
                skipped.add(entry)
                skips[entry.model] = n = skips.get(entry.model, 0) + 1
                if n >= QUEUE_LOOKAHEAD:
                    passed.add(entry.model)
        if queue.held_back:   # a flood's request held by the guard: those of the tenants it guards may go
            for entry in queue.unguarded(passed):
                entry.send()
        if queue.count and self._queue_tick is None and self._loop is not None:
            self._queue_tick = self._loop.call_later(QUEUE_TICK_S, self._tick_queue)

    def _first_byte_then_dispatch(self, candidate: Candidate, routed: RoutedRequest) -> None:
        self.policy.on_first_byte(candidate, routed)
        if self.queue.count:
            self.dispatch_waiting()

    def _tick_queue(self) -> None:
        self._queue_tick = None
        self.dispatch_waiting()

    def served(self, ex: _Exchange) -> None:
        """An exchange ended: its tokens are its tenant's service (the prompt's estimate charged
        as it left the queue corrected), and a waiting request may take its place."""
        queue = self.queue
        queue.charge(ex.key.user, (ex.prompt_tokens or 0) + ex.completion_tokens - ex.charged)
        if queue.count:
            self.dispatch_waiting()

    def _refused(self, client: _Client, fields: Dict[bytes, bytes], body: bytes, exc: HTTPError,
                 again: Callable[[], None]) -> None:
        """A proxied request refused before it was routed: a key not read here yet, or (with
        --adapter-on-demand) an adapter a base's session loads first, is waited for and `again`
        tries it once more; else the error is its answer."""
        if exc.code == "invalid_api_key" and self.await_key(client, again):
            return
        if exc.code == "model_not_found" and self.adapters.on_demand and self.adapters.load_then(
                client, fields, body, self.authenticate(fields), again):
            return
        client.error(exc)
        client.finish()

    # -- connections with no complete head yet; CORS ------------------------------------------
    def headed(self, client: _Client) -> None:
        """The client is no longer among the headless connections (its head came, or it went)."""
        client.headless = False
        del self.headless[client]
        held = self.headless_per.pop(client.address) - 1
        if held:
            self.headless_per[client.address] = held

    def _preflight(self, fields: Dict[bytes, bytes]) -> List[Tuple[bytes, bytes]]:
        """The answer to OPTIONS (the CORS lines themselves come from _Client.tag)."""
        asked = fields.get(b"access-control-request-headers", b"")
        return [(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers", asked or b"authorization, content-type, x-request-id"),
                (b"access-control-max-age", b"600")]

    # -- model aliases and fallbacks; pass-through of other engine routes ----------------------
    def fallback_chain(self, name: str) -> List[str]:
        """The models a request for `name` may be served by, in order: an alias's models (or the
        model itself), each followed by its fallbacks (--fallback), then the alias's own."""
        models: List[str] = []
        for model in [*self.aliases.get(name, [name]), *(self.fallbacks.get(name, ()) if name in self.aliases else ())]:
            for one in (model, *self.fallbacks.get(model, ())):
                if one not in models:
                    models.append(one)
        return models

    def _first_served(self, name: str, key: Key, body: bytes,
                      ctype: Optional[bytes]) -> Tuple[str, bytes, List[Candidate], List[str]]:
        """The first model of fallback_chain(name) with a session in rotation for this key (when
        every one's sessions sit out, the first with sessions), the body naming it (the engine
        knows only the models it serves), its candidates and the models left to fall back to.
        The first model's error when none serves."""
        error: Optional[HTTPError] = None
        models = self.fallback_chain(name)
        served: Optional[Tuple[int, List[Candidate]]] = None
        for at, model in enumerate(models):
            try:
                candidates = self.candidates(model, key)
            except HTTPError as exc:
                error = error or exc
                continue
            if served is None:
                served = (at, candidates)
            if not self.health.sick_until or any(not self.health.is_sick(c.session, time.monotonic())
                                                 for c in candidates):
                served = (at, candidates)
                break
        if served is None:
            assert error is not None
            if error.status == 404 and name in self.aliases:   # say the name the client used
                error = HTTPError(404, f"The model '{name}' does not exist or no session serves it",
                                  "model_not_found", "model")
            raise error
        at, candidates = served
        model = models[at]
        if model != name:
            body = with_model(body, ctype, model)
        return model, body, candidates, models[at + 1:]

    def _within_window(self, model: str, named: Optional[str], request: Dict[str, Any], key: Key, body: bytes,
                       ctype: Optional[bytes], candidates: List[Candidate], chain: Sequence[str]
                       ) -> Tuple[str, bytes, List[Candidate], Sequence[str], Optional[str]]:
        """The model (its body, candidates, fallbacks left and the name asked) whose context
        window the prompt may fit: this one, else the first of its fallbacks that does; 400
        context_length_exceeded when none. A model whose sessions do not say their window fits."""
        window = context_window(candidates)
        completion = asked_completion(request) if window is not None else 0
        if window is None or len(body) // 2 + completion <= window:   # (n bytes hold at most n/2 tokens)
            return model, body, candidates, chain, named
        prompt = prompt_tokens_at_least(request)
        if prompt + completion <= window:
            return model, body, candidates, chain, named
        chain = list(chain) or self.fallback_chain(model)[1:]
        for at, other in enumerate(chain):
            try:
                found = self.candidates(other, key)
            except HTTPError:
                continue
            if prompt + completion <= (context_window(found) or math.inf):
                self.metrics.fallbacks[(model, other)] += 1
                return other, with_model(body, ctype, other), found, chain[at + 1:], named or model
        raise too_long(window, prompt, completion)

    def _passes_through(self, path: bytes) -> bool:
        """Any request under /v1/ that is no route of ours goes to an engine like the completions
        (same auth, routing, retries and metering), whatever its method and body: /v1/responses,
        /v1/rerank, /v1/audio/..., GET /v1/files, whatever the engine serves; and the engine's
        own routes outside /v1/ that the site enables by name (--native-route: vLLM's /tokenize,
        SGLang's /generate). The three completion routes take POST alone (see route)."""
        if path.startswith(b"/v1/"):
            return not path.startswith(ADMIN_PREFIX) and path not in Views.ROUTES \
                and not path.startswith(MODEL_PREFIX) and path not in PROXIED_PATHS
        return path not in Views.ROUTES and (path in self.native_routes
                                          or any(path.startswith(p) for p in self.native_prefixes))

    def _admin(self, client: _Client, method: bytes, path: bytes, query: bytes, body: bytes) -> None:
        """An admin request (its key checked on the head, its body read whole); an HTTPError is
        its answer."""
        client.busy = True
        client.answer(200, crdt.dumps(self.admin.answer(method, path, query, body)))
        client.finish()


# =============================================================================================
# Dashboard: one page, no build step, refreshes itself
# =============================================================================================
DASHBOARD_HTML = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>otela</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;font-variant-numeric:tabular-nums}
th{background:#f0f0f0} .muted{color:#888} .SERVING{color:#17772a} .JOIN{color:#a66a00}
.DOWN{color:#b00020} .LEFT{color:#888} .suspected{background:#fff0f0} .sick{background:#fff8e0}
#counts span{margin-right:1.2em}
</style></head><body>
<h1>otela <span class="muted" id="self"></span></h1>
<p id="noauth" hidden style="background:#b00020;color:#fff;padding:.4em .8em">--no-auth is ON: this endpoint
accepts requests without a key</p>
<div id="counts"></div><div class="muted" id="status">loading&hellip;</div>
<h2>Sessions</h2>
<table><thead><tr><th>session</th><th>state</th><th>role</th><th>owner</th><th>models</th>
<th>site</th><th>hardware</th><th>labels</th><th>addr</th><th>health</th><th>cache hits</th><th>queue</th>
<th>est. TTFT</th></tr></thead><tbody id="sessions"></tbody></table>
<h2>Recent usage (last 5 minutes)</h2>
<table><thead><tr><th>model</th><th>requests</th><th>arrivals/s</th><th>input tokens (mean &plusmn; std)</th>
<th>output tokens (mean &plusmn; std)</th></tr></thead><tbody id="stats"></tbody></table>
<h2>Fair queue per tenant (requests waiting for a saturated engine)</h2>
<table><thead><tr><th>tenant</th><th>waiting</th><th>went out after waiting</th><th>mean wait</th>
<th>tokens served</th><th>throttled (429)</th><th>left while waiting</th></tr></thead><tbody id="queue"></tbody></table>
<h2>Usage per user and day</h2>
<p><input id="key" type="password" placeholder="admin key" size="40">
<button id="save">show</button> <span class="muted" id="usagemsg">an admin key shows totals per user, model and day</span></p>
<table><thead><tr><th>day</th><th>user</th><th>model</th><th>requests</th><th>errors</th><th>opted out</th>
<th>input tokens</th><th>output tokens</th></tr></thead><tbody id="usage"></tbody></table>
<script>
"use strict";
const STATES = {0: "JOIN", 1: "SERVING", 2: "DOWN", 3: "LEFT"};
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text === undefined || text === null ? "" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
}
function fill(id, rows) {
  const body = document.getElementById(id);
  body.replaceChildren(...rows);
}
function sessionsOf(view) {
  let s = view.sessions !== undefined ? view.sessions : (view.registry !== undefined ? view.registry : view);
  if (Array.isArray(s)) return s.map(r => [r.session || r.id || r.sid || "", r]);
  return Object.entries(s || {}).filter(([k, r]) => r && typeof r === "object" && "state" in r);
}
function fmt(x) { return typeof x === "number" ? (Math.round(x * 100) / 100).toString() : ""; }
async function refresh() {
  try {
    const view = await (await fetch("/v1/registry", {cache: "no-store"})).json();
    const ingress = view.ingress || {};
    const sick = new Set(ingress.sick || []);
    const suspectedList = Array.isArray(view.suspected) ? view.suspected : [];
    document.getElementById("self").textContent = ingress.session ? "ingress " + ingress.session.slice(0, 8) : "";
    document.getElementById("noauth").hidden = ingress.auth !== false;
    const counts = {};
    const rows = sessionsOf(view).map(([sid, r]) => {
      const state = typeof r.state === "number" ? (STATES[r.state] || r.state) : (r.state_name || r.state);
      const suspected = r.suspected === true || suspectedList.includes(sid);
      counts[state] = (counts[state] || 0) + 1;
      if (suspected) counts.suspected = (counts.suspected || 0) + 1;
      const tr = document.createElement("tr");
      if (suspected) tr.className = "suspected"; else if (sick.has(sid) || r.unrouted) tr.className = "sick";
      cell(tr, sid.slice(0, 12)); cell(tr, state, state); cell(tr, r.role); cell(tr, r.owner);
      cell(tr, (r.models || []).join(", "));
      cell(tr, (r.site || "") + (r.site_claimed ? " (claims " + r.site_claimed + ")" : ""));
      const hw = r.hardware || {};
      cell(tr, (hw.gpu ? `${hw.count || 1} x ${hw.gpu}${hw.memory_gb ? " (" + hw.memory_gb + " GB)" : ""}` : "") +
               (Array.isArray(hw.nodes) ? ` on ${hw.nodes.length} nodes (${hw.nodes.join(", ")}), tp ${hw.tp} x pp ${hw.pp}` : ""));
      cell(tr, Object.entries(r.labels || {}).map(([k, v]) => k + "=" + v).join(" "));
      cell(tr, r.addr);
      cell(tr, suspected ? "suspected" : (sick.has(sid) ? "sick (out of rotation)"
                                          : (r.unrouted ? "unrouted: " + r.unrouted : "ok")));
      const rt = (ingress.routing || {})[sid];
      cell(tr, rt && rt.prompt_tokens ? Math.round(100 * rt.cache_hit_rate) + " %" : "");
      cell(tr, rt ? rt.outstanding + " req, " + Math.round(rt.queued_prompt_tokens) + " tok" +
           (typeof r.load === "number" ? " (node: " + r.load + ")" : "") : "");
      cell(tr, rt ? Math.round(1000 * rt.ttft_estimate_seconds) + " ms" : "");
      return tr;
    });
    fill("sessions", rows);
    const c = document.getElementById("counts");
    c.replaceChildren(...Object.entries(counts).map(([k, v]) => {
      const s = document.createElement("span"); s.textContent = k + ": " + v; return s; }));
    const stats = await (await fetch("/v1/usage/stats", {cache: "no-store"})).json();
    fill("stats", Object.entries(stats.models || {}).map(([m, s]) => {
      const tr = document.createElement("tr");
      cell(tr, m); cell(tr, s.requests); cell(tr, fmt(s.arrival_rate));
      cell(tr, s.input_tokens ? fmt(s.input_tokens.mean) + " \\u00b1 " + fmt(s.input_tokens.std) : "unknown");
      cell(tr, fmt(s.output_tokens.mean) + " \\u00b1 " + fmt(s.output_tokens.std));
      return tr;
    }));
    const metrics = await (await fetch("/metrics", {cache: "no-store"})).text();
    const tenants = {};
    for (const line of metrics.split("\\n")) {
      const m = /^otela_queue_(\\w+)\\{tenant="((?:[^"\\\\]|\\\\.)*)"\\} (\\S+)$/.exec(line);
      if (m) (tenants[m[2]] = tenants[m[2]] || {})[m[1]] = Number(m[3]);
    }
    fill("queue", Object.entries(tenants).map(([t, q]) => {
      const tr = document.createElement("tr");
      cell(tr, t); cell(tr, q.waiting); cell(tr, q.wait_seconds_count);
      cell(tr, q.wait_seconds_count ? fmt(q.wait_seconds_sum / q.wait_seconds_count) + " s" : "");
      cell(tr, q.service_tokens_total); cell(tr, q.throttled_total); cell(tr, q.aborted_total);
      return tr;
    }));
    const key = localStorage.getItem("otela-admin-key");
    if (key) {
      const r = await fetch("/v1/usage", {cache: "no-store", headers: {Authorization: "Bearer " + key}});
      const u = await r.json();
      if (r.ok) {
        document.getElementById("usagemsg").textContent = "since " + u.since;
        fill("usage", u.data.map(d => {
          const tr = document.createElement("tr");
          for (const f of ["day", "user", "model", "requests", "errors", "opted_out", "prompt_tokens",
                           "completion_tokens"]) cell(tr, d[f]);
          return tr;
        }));
      } else {
        document.getElementById("usagemsg").textContent = (u.error && u.error.message) || ("HTTP " + r.status);
      }
    }
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("status").textContent = "refresh failed: " + e;
  }
}
document.getElementById("save").addEventListener("click", () => {
  localStorage.setItem("otela-admin-key", document.getElementById("key").value.trim());
  refresh();
});
refresh();
setInterval(refresh, 2000);
</script></body></html>
"""


# =============================================================================================
# CLI: serve, keys, limits, grant
# =============================================================================================
def _split_listen(listen: str) -> Tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


async def _serve(args: argparse.Namespace, policy: Any) -> int:
    limits = Limits.from_args(args)
    if args.no_queue:   # every request goes to an engine at once, as before the fair queue
        limits.queue_max = 0
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together (a certificate and its key)")
    # the ingress relays for members behind NATs unless told not to (--no-relay)
    config = otela_node.config_from_args(args, ingress_keys=ingress_secrets(args.ingress_key_file, args.key_file))
    site = config.labels.get(crdt.SITE_LABEL) or site_name_of(args.site)   # --site-name, else the site file's
    if site:
        config.labels[crdt.SITE_LABEL] = site
    node = otela_node.Node(config, role="ingress", models=[], hardware={}, labels={})
    host, port = _split_listen(config.listen)
    ingress = Ingress(node, db_path=args.db, policy=policy, no_auth=args.no_auth,
                      require_code_hash=args.require_code_hash, aliases=dict(args.alias),
                      fallbacks=dict(args.fallback), native_routes=[_native_route(r) for r in args.native_route],
                      otlp_endpoint=args.otlp_endpoint, adapter_on_demand=args.adapter_on_demand,
                      tls=public_tls(args.tls_cert, args.tls_key) if args.tls_cert else None,
                      cors_origins=args.cors_origin, limits=limits,
                      allow_ungranted=args.allow_ungranted, catalogue=site_catalogue(args.site),
                      usage_days=args.usage_days, usage_months=args.usage_months,
                      require_key_for_views=args.require_key_for_views)
    if not config.ingress_keys:
        print("otela-ingress: WARNING: without the ingress secret no grant can be checked: every session "
              "is routed on its own word (a compute job holding the cluster key can claim any model)",
              file=sys.stderr)
    elif args.allow_ungranted:
        print("otela-ingress: --allow-ungranted: sessions without a grant are routed too (the upgrade's "
              "middle step; drop it once every job has a grant)", file=sys.stderr)
    if ingress.require_code_hash:
        print(f"otela-ingress: routing only to sessions advertising code hash {ingress.require_code_hash}",
              file=sys.stderr)
    await node.start(serve_http=False)
    try:
        port = await ingress.start(host, port)
    except BaseException:
        await node.stop(leave=True)
        raise
    print(f"otela-ingress: serving the OpenAI API on {'https' if ingress.tls is not None else 'http'}://{host}:{port}/v1 "
          f"(session {node.session_id}, policy {args.policy}, ledger {args.db})", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"otela-ingress: stopping (up to {limits.drain_s:g} s for requests in flight)", file=sys.stderr)
    await ingress.stop(drain=limits.drain_s)
    await node.stop(leave=True)
    return 0


def read_site_file(path: str) -> Any:
    try:
        with open(path, "rb") as fh:
            return crdt.loads(fh.read())
    except OSError as exc:
        raise ValueError(f"--site {path}: {exc.strerror}") from None
    except ValueError:
        raise ValueError(f"--site {path}: not JSON") from None


def site_name_of(path: Optional[str]) -> Optional[str]:
    """A site file's name (the placer puts it in its jobs' grants), None where it has none.
    Raises ValueError naming the file and field."""
    doc = read_site_file(path) if path else None
    name = doc.get("name") if isinstance(doc, dict) else None
    if name is not None and not (isinstance(name, str) and crdt.SITE_NAME.match(name)):
        raise ValueError(f"--site {path}: name must be 1-64 characters of [0-9A-Za-z_.-]")
    return name


def site_catalogue(path: Optional[str]) -> List[str]:
    """The model and adapter names of a site file's catalogue (the rest is the placer's). Raises
    ValueError naming the file and field."""
    if not path:
        return []
    doc = read_site_file(path)
    entries = doc.get("catalogue", []) if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"--site {path}: catalogue must be a list")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ValueError(f"--site {path}: catalogue[{i}].name must be a model name")
        names.append(entry["name"])
    return names


def ingress_secrets(path: Optional[str], cluster_key_file: str) -> List[bytes]:
    """The ingress tier's secrets (crdt.Authority): --ingress-key-file, or ingress.key beside the
    cluster key. Without one, this ingress's keys and usage stay on it (not shared with other
    ingresses, and nothing any other member sends on that plane is taken). One that is also a
    secret of the cluster key (the same file, or a copy) is refused: every compute job holds
    that one, and it would make each of them an authority over keys and usage."""
    beside = os.path.join(os.path.dirname(os.path.abspath(cluster_key_file)), otela_node.KEY_FILES["ingress"])
    if not path and not os.path.exists(beside):
        print(f"otela-ingress: no ingress secret ({beside} or --ingress-key-file): API keys and usage stay on "
              "this ingress; `otela_node.py keygen --ingress-only --out DIR` makes one for every ingress host",
              file=sys.stderr)
        return []
    found = otela_node.load_secrets(path or beside, "ingress key")
    if cluster_key_file and set(found) & set(otela_node.load_secrets(cluster_key_file)):
        raise otela_node.ConfigError(f"the ingress key {path or beside} is the cluster key {cluster_key_file}, which "
                                     "every compute job holds: give --ingress-key-file keygen's ingress.key")
    return found


def _alias_arg(value: str) -> Tuple[str, List[str]]:
    name, eq, targets = value.partition("=")
    models = [t.strip() for t in targets.split(",") if t.strip()]
    if not eq or not name.strip() or not models:
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL[,MODEL...], got {value!r}")
    return name.strip(), models


def public_tls(cert: str, key: str) -> ssl.SSLContext:
    """The public listener's TLS context (--tls-cert, --tls-key): TLS 1.2 at least, the standard
    library's defaults otherwise (its ciphers, no compression, no renegotiation)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: {exc}") from None
    return context


def _native_route(value: str) -> str:
    route = value.strip()
    if not route.startswith("/") or route.startswith("/v1/") or not normal_path(route.encode()):
        raise SystemExit(f"otela-ingress: --native-route {value!r}: a path outside /v1/ in normal form, "
                         "such as /tokenize")
    return route


def _code_hash_arg(value: str) -> str:
    value = value.strip()
    if value != "self" and not re.fullmatch(r"[0-9a-f]{16}", value):
        raise argparse.ArgumentTypeError(f"expected 16 hex digits (as in /v1/registry) or 'self', got {value!r}")
    return value


# The variables of flags whose names or separators are not crdt.parse_settings' own (see main)
SETTING_NAMES = {**otela_node.SETTING_NAMES, "--alias": ("ALIASES", ";"), "--fallback": ("FALLBACKS", ";")}


def build_parser(overlay: bool = True) -> argparse.ArgumentParser:
    """The CLI; `overlay=False` leaves out serve's overlay flags (and the variables they read),
    which `keys` has no use for. Every flag also reads its OTELA_* variable (see main)."""
    parser = argparse.ArgumentParser(prog="otela_ingress.py",
                                     description="The otela ingress: one OpenAI-compatible endpoint "
                                                 "for every healthy engine in the overlay.")
    sub = parser.add_subparsers(dest="command", required=True)
    db_help = f"SQLite file with keys and the usage ledger (env OTELA_DB, default {DEFAULT_DB})"

    serve = sub.add_parser("serve", help="join the overlay and serve the OpenAI API on --listen",
                           description="Join the overlay (--key-file, --bootstrap, --gossip) and serve the "
                                       "OpenAI API, /v1/registry, /v1/usage, /metrics and /dashboard on "
                                       "--listen. Keys come from `keys create` in the same --db.")
    if overlay:
        otela_node.add_overlay_args(serve, gossip_default=otela_node.INGRESS_GOSSIP, listen_default=DEFAULT_LISTEN,
                                    listen_help="HOST:PORT of the OpenAI API, /v1/registry, /metrics "
                                                "and /dashboard (0.0.0.0:PORT for other hosts)")
        # an ingress wraps no engine and serves no tunnel port: those knobs are `start`'s
        otela_node.add_knob_args(serve, skip=("probe_interval",) + otela_node.ENGINE_KNOBS + otela_node.TUNNEL_KNOBS)
    serve.add_argument("--db", default=DEFAULT_DB, help=db_help)
    serve.add_argument("--ingress-key-file", default=None,
                       help="the ingress tier's secret (keygen's ingress.key; on ingress hosts only, never on "
                            "compute nodes): only it creates, changes or revokes API keys and writes usage "
                            "that other ingresses accept (env OTELA_INGRESS_KEY_FILE; default: ingress.key "
                            "beside --key-file, when there)")
    serve.add_argument("--usage-days", type=otela_node.number_arg(int, positive=True), metavar="N", default=crdt.USAGE_RETENTION_DAYS,
                       help="days of per-key usage counters the ingresses replicate (today's budget, "
                            "/v1/admin/usage's days; env OTELA_USAGE_DAYS; default "
                            f"{crdt.USAGE_RETENTION_DAYS}). Older days stay in --db")
    serve.add_argument("--usage-months", type=otela_node.number_arg(int, positive=True), metavar="N", default=crdt.USAGE_RETENTION_MONTHS,
                       help="months of per-key usage totals the ingresses replicate (this month's budget, "
                            f"a year of totals; env OTELA_USAGE_MONTHS; default {crdt.USAGE_RETENTION_MONTHS})")
    serve.add_argument("--policy", default="ttft",
                       help="routing policy: ttft (default: the lowest estimated time to first token, from "
                            "each engine's cached prefixes, queue and measured speed), least_loaded, "
                            "round_robin, random, hardware, or module:Class for your own (env OTELA_POLICY)")
    serve.add_argument("--require-code-hash", default=None, metavar="HASH|self",
                       type=_code_hash_arg,
                       help="route only to worker sessions advertising this code hash (the 16 hex digits "
                            "in /v1/registry's code_hash; 'self': what a worker started from this "
                            "ingress's own checkout advertises, the sha256 of its otela_node.py and "
                            "crdt.py). Protects against a node started by mistake from a modified or "
                            "outdated checkout: it gets no requests. Does NOT protect against a hostile "
                            "node: the hash is self-reported (anyone holding the cluster key can "
                            "advertise any hash; this is not attestation), and it covers neither the "
                            "engine, nor Python and its packages (env OTELA_REQUIRE_CODE_HASH; "
                            "default: route to any code)")
    serve.add_argument("--alias", action="append", default=[], metavar="NAME=MODEL[,MODEL...]",
                       type=_alias_arg,
                       help="a public model name for served ones, tried in order: the first that a "
                            "healthy session serves gets the request (its body then names that model). "
                            "Repeatable; env OTELA_ALIASES, aliases separated by ';' (default: none)")
    serve.add_argument("--fallback", action="append", default=[], metavar="MODEL=MODEL[,MODEL...]",
                       type=_alias_arg,
                       help="the models a model (or alias) falls back to, in order, when every attempt at it "
                            "fails before the first byte (5xx, no answer, no session): the answer and the "
                            "ledger name the model that answered. Repeatable; env OTELA_FALLBACKS, lists "
                            "separated by ';' (default: none)")
    serve.add_argument("--otlp-endpoint", default=None, metavar="URL",
                       help="send each request's spans (the ingress's, its route choice, the upstream's time "
                            "to first byte) to this OTLP/HTTP collector (JSON, POST URL/v1/traces), batched "
                            "from a thread; a collector down or slow drops spans, counted on /metrics, never "
                            "delays a request (env OTELA_OTLP_ENDPOINT; default: none)")
    serve.add_argument("--adapter-on-demand", action="store_true",
                       help="a request naming a LoRA adapter no session has loaded goes to a session of its "
                            "base, which is asked to load it first (its base and path known from a load passed "
                            "through an ingress or a record that had it); default: such a request is a 404")
    serve.add_argument("--tls-cert", default=None, metavar="FILE",
                       help="serve the API over TLS with this certificate chain (PEM; with --tls-key): the "
                            "same limits as plain HTTP, the handshake inside the head's deadline (env "
                            "OTELA_TLS_CERT; default: plain HTTP)")
    serve.add_argument("--tls-key", default=None, metavar="FILE",
                       help="the private key of --tls-cert (PEM; env OTELA_TLS_KEY)")
    serve.add_argument("--native-route", action="append", default=[], metavar="PATH",
                       help="an engine route outside /v1/ to relay like /v1/ (keys, routing, metering): "
                            "/tokenize, /detokenize (vLLM), /generate (SGLang); a path ending in '/' or '_' "
                            "relays every path under it. Repeatable; env OTELA_NATIVE_ROUTE, comma-separated "
                            "(default: none: only /v1/ is relayed)")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="let browser pages from ORIGIN (https://app.example.org, or * for any) call "
                            "the API: CORS headers on answers and OPTIONS preflights answered. "
                            "Repeatable; env OTELA_CORS_ORIGIN, comma-separated (default: none)")
    serve.add_argument("--no-auth", action="store_true",
                       help="accept requests without a key (local demos only; env OTELA_NO_AUTH: "
                            "1/true/yes/on or 0/false/no/off)")
    serve.add_argument("--require-key-for-views", action="store_true",
                       help="answer /v1/registry, /metrics, /dashboard and /v1/usage/stats only to a "
                            "valid key (Bearer, or the password of HTTP Basic: a browser asks for it on "
                            "/dashboard); by default they need none (env OTELA_REQUIRE_KEY_FOR_VIEWS: "
                            "1/true/yes/on or 0/false/no/off)")
    serve.add_argument("--site", default=None, metavar="FILE",
                       help="the site file the placer reads (otela_place.py --site): a request for a model "
                            "of its catalogue that nothing serves yet gets 503 'starting' with Retry-After "
                            "(not 404) and counts as demand in /v1/usage/stats; its name, where it has one, "
                            "is this ingress's site unless --site-name is given (env OTELA_SITE)")
    serve.add_argument("--allow-ungranted", action="store_true",
                       help="route to worker sessions without a grant too (env OTELA_ALLOW_UNGRANTED; default: "
                            "only sessions whose grant, from `grant` or the placer, names the model). For the "
                            "upgrade from a release without grants: see the README")
    serve.add_argument("--no-queue", action="store_true",
                       help="never hold requests at the ingress: each goes to an engine at once, however "
                            "saturated (env OTELA_NO_QUEUE; by default they wait in fair order, FairQueue)")
    serve.add_argument("--no-relay", action="store_true",
                       help="do not relay for members behind NATs (env OTELA_NO_RELAY; by default the "
                            "ingress relays their gossip and tunnel streams)")
    limits = serve.add_argument_group("limits", "the connection, size and time limits (the reason for each "
                                                "default is beside it at the top of otela_ingress.py)")
    for name, default in LIMITS.items():
        limits.add_argument("--" + name.lower().replace("_", "-"), type=otela_node.number_arg(type(default), positive=True), default=default,
                            metavar="N", help=f"{LIMIT_HELP[name]} (env OTELA_{name}; default {default})")

    keys = sub.add_parser("keys", help="create, list or revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("--user", required=True,
                        help="who the key belongs to (the ledger's user; env OTELA_USER)")
    create.add_argument("--allow", default=None,
                        help="comma-separated providers this key may use: label k=v, label value, "
                             "or owner user@host (default: any)")
    create.add_argument("--admin", action="store_true",
                        help="may read GET /v1/usage and use the admin API /v1/admin/ (default: no)")
    create.add_argument("--rate", type=float, default=0.0,
                        help="requests/s limit, for the whole cluster (default 0: none)")
    create.add_argument("--budget-day", type=int, default=0, metavar="TOKENS",
                        help="prompt + completion tokens a UTC day, for the whole cluster; past it "
                             "requests get 429 insufficient_quota (default 0: none)")
    create.add_argument("--budget-month", type=int, default=0, metavar="TOKENS",
                        help="the same per UTC calendar month (default 0: none)")
    create.add_argument("--expires", default=None, metavar="WHEN",
                        help="the key stops working then: a duration (30d, 12h, 90m) or a UTC date/time "
                             "(2027-01-31, 2027-01-31T12:00) (default: never)")
    for field, what in (("rpm", "requests"), ("tpm", "tokens (prompt + completion)")):
        create.add_argument("--" + field, type=int, default=0, metavar="N",
                            help=f"{what} per sliding minute, for the whole cluster; past it 429 "
                                 "rate_limit_exceeded (default 0: none)")
    create.add_argument("--concurrency", type=int, default=0, metavar="N",
                        help="requests in flight at once, for the whole cluster (default 0: none)")
    create.add_argument("--weight", type=float, default=1.0,
                        help="the key's share of the engines when requests wait at the ingress, against "
                             "a key of weight 1 (tokens served; default 1)")
    create.add_argument("--priority", default=None, choices=crdt.PRIORITY_CLASSES,
                        help=f"the class of the key's requests (default {crdt.DEFAULT_PRIORITY}); "
                             "a class waits only behind its own and higher ones")
    create.add_argument("--priorities", default=None, metavar="CLASSES",
                        help="comma-separated classes a request may ask for (X-Otela-Priority) besides "
                             "the key's own and lower ones (default: none)")
    create.add_argument("--sites", default=None, metavar="SITES",
                        help="comma-separated site names: the key's requests are served only by sessions "
                             "whose grant places them at one of these sites (data residency; default: any)")
    create.add_argument("--db", default=DEFAULT_DB, help=db_help)
    create.add_argument("--json", action="store_true", help="print {id, key, user} as JSON")
    lister = keys_sub.add_parser("list", help="list keys (never their secrets) and their use against "
                                              "budget, every ingress's use included")
    lister.add_argument("--db", default=DEFAULT_DB, help=db_help)
    lister.add_argument("--json", action="store_true", help="print JSON")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id (at every ingress within 2 s)")
    revoke.add_argument("key_id")
    revoke.add_argument("--db", default=DEFAULT_DB, help=db_help)

    limits = sub.add_parser("limits", help="set, list or clear the limits of a user (all its keys) or a model",
                            description="A user's limits count all of its keys' requests, a model's every "
                                        "key's requests to it, over the whole cluster. The ingress serving "
                                        "this --db publishes a change within a second.")
    limits_sub = limits.add_subparsers(dest="limits_command", required=True)
    for name, text in (("set", "set a user's or a model's limits"), ("clear", "remove them"),
                       ("list", "list the limits set through this --db")):
        one = limits_sub.add_parser(name, help=text)
        if name != "list":
            who = one.add_mutually_exclusive_group(required=True)
            who.add_argument("--user", default=None, help="a user, as its keys name it")
            who.add_argument("--model", default=None, help="a model, as requests name it")
        if name == "set":
            for field, what in (("rpm", "requests per sliding minute"), ("tpm", "tokens per sliding minute"),
                                ("concurrency", "requests in flight")):
                one.add_argument("--" + field, type=int, default=0, metavar="N", help=f"{what} (default 0: none)")
            one.add_argument("--sites", default=None, metavar="SITES",
                             help="a model's: comma-separated site names; its requests are served only by "
                                  "sessions whose grant places them at one of these sites (data residency; "
                                  "set replaces the model's limits and sites together)")
        one.add_argument("--db", default=DEFAULT_DB, help=db_help)
        if name == "list":
            one.add_argument("--json", action="store_true", help="print JSON")

    grant = sub.add_parser("grant", help="issue a compute job its grant (what it may serve), or revoke one",
                           description="On the login node (it needs the ingress secret): `grant --model M "
                                       "[--label k=v] [--until WHEN] [--job ID] --out FILE` writes the file a "
                                       "job passes to `otela_node.py start --grant-file` (mode 600: the job "
                                       "alone should read it). `grant revoke GRANT_ID` or `grant revoke --job "
                                       "ID` stops every ingress routing to it within a second.")
    grant.add_argument("action", nargs="?", choices=["revoke"], help="revoke a grant (default: issue one)")
    grant.add_argument("grant_id", nargs="?", help="the grant to revoke (its id, in the grant file and "
                                                   "/v1/registry)")
    grant.add_argument("--model", action="append", default=[],
                       help="a model (or adapter) name the job may serve; repeatable")
    grant.add_argument("--label", action="append", default=[], metavar="K=V",
                       help="a label key allowlists may match the job by; repeatable")
    grant.add_argument("--until", default="24h", metavar="WHEN",
                       help="when the grant ends: the job's end (a duration such as 12h, or a UTC date/time; "
                            "default 24h)")
    grant.add_argument("--job", default="", help="the Slurm job id (revoke: every grant of that job)")
    grant.add_argument("--out", default=None, help="write the grant file here, mode 600 (default: stdout)")
    grant.add_argument("--key-file", default=None,
                       help="the cluster key file: ingress.key beside it is the secret (env OTELA_KEY_FILE)")
    grant.add_argument("--ingress-key-file", default=None,
                       help="the ingress secret (env OTELA_INGRESS_KEY_FILE; default: beside --key-file)")
    grant.add_argument("--db", default=DEFAULT_DB, help=db_help + " (revoke)")
    return parser


def _keys_command(args: argparse.Namespace) -> int:
    spec = None
    if args.keys_command == "create":   # checked before the database is touched
        try:
            spec = key_spec(args.user, args.allow, args.rate, args.budget_day, args.budget_month, args.expires)
            limit_spec({f: getattr(args, f) for f in crdt.LIMIT_FIELDS})
            queueing = dict(queue_spec(args.weight, args.priority, args.priorities), **sites_spec(args.sites))
        except ValueError as exc:
            raise ValueError(f"--{str(exc).replace('_', '-')}") from None
    elif not os.path.exists(args.db):   # a typo must not become a new, empty database
        raise ValueError(f"--db {args.db}: no such database (check the path or OTELA_DB; "
                         "`keys create` makes one)")
    db = open_db(args.db)
    try:
        if spec is not None:
            _keys_create(args, db, *spec, **queueing)
        elif args.keys_command == "list":
            _keys_list(args, db)
        elif not revoke_key(db, args.key_id):
            print(f"otela-ingress: no active key with id {args.key_id!r}", file=sys.stderr)
            return 1
        else:
            print(f"revoked {args.key_id}", file=sys.stderr)
    finally:
        db.close()
    return 0


def _limits_command(args: argparse.Namespace) -> int:
    """`limits set|clear --user NAME|--model MODEL [--rpm N --tpm N --concurrency N]`, `limits list`."""
    limits, sites = dict.fromkeys(crdt.LIMIT_FIELDS, 0), {}
    if args.limits_command == "set":
        limits = limit_spec({f: getattr(args, f) for f in crdt.LIMIT_FIELDS})
        try:
            sites = sites_spec(args.sites) if args.sites is not None else {}
        except ValueError as exc:
            raise ValueError(f"--{exc}") from None
        if sites and args.user is not None:
            raise ValueError("--sites binds a model's requests (--model) or a key's (keys create --sites), not a user's")
        if not any(limits.values()) and not sites.get("sites"):
            raise ValueError("limits set: give --rpm, --tpm, --concurrency or (a model's) --sites "
                             "(`limits clear` removes them)")
    if args.limits_command != "list":
        kind, name = ("u", args.user) if args.user is not None else ("m", args.model)
        if not name.strip() or not name.isprintable() or len(name) > crdt.MAX_STRING:
            raise ValueError(f"--{crdt.LIMIT_SUBJECTS[kind]}: 1 to {crdt.MAX_STRING} printable characters")
    elif not os.path.exists(args.db):
        raise ValueError(f"--db {args.db}: no such database (check the path or OTELA_DB)")
    db = open_db(args.db)
    try:
        if args.limits_command != "list":
            store_limit(db, kind, name, limits, time.time(), sites)   # (a model's sites beside its limits)
            said = [f"{f} {v}" for f, v in limits.items() if v] + \
                [f"sites {','.join(sites['sites'])}" for _ in (1,) if sites.get("sites")]
            print(f"{crdt.LIMIT_SUBJECTS[kind]} {name}: " + (", ".join(said) or "no limits"), file=sys.stderr)
            return 0
        rows = [dict({crdt.LIMIT_SUBJECTS[kind]: name, "rpm": rpm, "tpm": tpm, "concurrency": concurrency},
                     **{f: v for f, v in crdt.loads(stored).items() if f == "sites" and v})
                for kind, name, rpm, tpm, concurrency, stored in db.execute(
                    "SELECT kind, name, rpm, tpm, concurrency, queue FROM limits WHERE kind != 'k' "   # (keys': keys list)
                    "ORDER BY kind DESC, name")
                if rpm or tpm or concurrency or crdt.loads(stored).get("sites")]
    finally:
        db.close()
    if args.json:
        print(crdt.dumps(rows).decode())
    for row in [] if args.json else rows:
        what = "user" if "user" in row else "model"
        print(f"{what:5} {row[what]:24} rpm={row['rpm'] or '-'} tpm={row['tpm'] or '-'} "
              f"concurrency={row['concurrency'] or '-'}" + (f" sites={','.join(row['sites'])}" if row.get("sites") else ""))
    return 0


def _keys_create(args: argparse.Namespace, db: sqlite3.Connection, user: str, allow: List[str], rate: float,
                 budget_day: int, budget_month: int, expires: Optional[float], **queueing: Any) -> None:
    limits = limit_spec({f: getattr(args, f) for f in crdt.LIMIT_FIELDS})
    token, digest, record = new_key(user, allow, args.admin, rate, budget_day, budget_month, expires)
    settings = key_settings(record["created"], limits, **queueing)
    db.execute("BEGIN")   # one transaction: the ingress reads the key and its settings together
    try:
        if crdt.has_settings(settings):
            store_limit(db, "k", digest, limits, record["created"], queueing)
        store_key_record(db, digest, record)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    if args.json:
        print(crdt.dumps(key_answer(token, record, settings)).decode())
        return
    print(token)
    print(f"key id {record['id']} for user {user}"
          f"{' (admin)' if args.admin else ''}; allow: {', '.join(allow) or 'any provider'}."
          " The key is shown only now.", file=sys.stderr)


def _keys_list(args: argparse.Namespace, db: sqlite3.Connection) -> None:
    rows = list_keys(db)
    now = time.time()
    day = crdt.time_day(now)
    slots = [crdt.loads(text) for (text,) in db.execute("SELECT record FROM usage_slots")]
    settings = load_key_settings(db)
    for r in rows:   # every ingress's use, as this --db last heard it
        digest = r.pop("hash")
        r["tokens_today"], r["tokens_this_month"] = crdt.usage_spent(slots, digest, day)
        r.update((f, settings.get(digest, {}).get(f, 0)) for f in crdt.LIMIT_FIELDS)
        r["sites"] = settings.get(digest, {}).get("sites", [])
    if args.json:
        print(crdt.dumps(rows).decode())
        return
    for r in rows:
        state = "revoked" if r["revoked"] else \
            "expired" if r["expires"] is not None and now >= r["expires"] else "active"
        today = f"{r['tokens_today']}/{r['budget_day'] or '-'}"
        month = f"{r['tokens_this_month']}/{r['budget_month'] or '-'}"
        expires = time.strftime('%Y-%m-%d %H:%M', time.gmtime(r['expires'])) \
            if r["expires"] is not None else "never"
        print(f"{r['id']}  {state:7}  {r['user']:16} admin={'yes' if r['admin'] else 'no':3} "
              f"rate={r['rate']:g} allow={','.join(r['allow']) or '*'}  "
              f"tokens today {today} month {month}  expires {expires}  "
              + "".join(f"{f}={r[f]} " for f in crdt.LIMIT_FIELDS if r[f])
              + (f"sites={','.join(r['sites'])} " if r["sites"] else "") +
              f"created {time.strftime('%Y-%m-%d %H:%M', time.gmtime(r['created']))}")


def _grant_revoke(args: argparse.Namespace, now: float) -> int:
    if bool(args.grant_id) == bool(args.job):
        raise ValueError("grant revoke: name a grant id or --job ID (one of them)")
    target = args.grant_id or "job-" + args.job
    crdt.revocation_entry(target)   # a bad id is refused before the database is touched
    if not os.path.exists(args.db):
        raise ValueError(f"--db {args.db}: no such database (the serving ingress's --db)")
    db = open_db(args.db)
    try:
        store_revocation(db, target, now)
    finally:
        db.close()
    print(f"revoked {target}: every ingress stops routing to it within a second", file=sys.stderr)
    return 0


def _grant_command(args: argparse.Namespace) -> int:
    now = time.time()
    if args.action == "revoke":
        return _grant_revoke(args, now)
    if not args.model:
        raise ValueError("grant: name at least one --model the job may serve")
    if not (args.key_file or args.ingress_key_file):
        raise ValueError("grant: needs the ingress secret: --ingress-key-file, or --key-file with ingress.key beside it")
    ring = ingress_secrets(args.ingress_key_file, args.key_file or "")
    if not ring:
        raise ValueError("grant: no ingress secret found: grants are signed by it (keygen --ingress-only)")
    labels = {}
    for item in args.label:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"grant: bad --label {item!r}: expected K=V")
        labels[key] = value
    until = parse_expiry(args.until, now)
    try:
        data = grant_file(crdt.Authority(ring), args.model, labels, args.job, until, now, args.key_file or "")
    except (crdt.RecordError, otela_node.ConfigError) as exc:
        raise ValueError(f"grant: {exc}") from None
    if args.out is None:
        sys.stdout.write(data.decode())
        return 0
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)   # an older file's mode too
        fh.write(data)
    print(f"grant {crdt.loads(data)['grant']['id']} for {', '.join(args.model)} until "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(until))} UTC -> {args.out}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:   # every flag also reads its OTELA_* variable: OTELA_ALIASES="fast=a,b;big=c", OTELA_NO_AUTH=0
        args = crdt.parse_settings(build_parser(overlay=argv[:1] == ["serve"]), argv, SETTING_NAMES, os.environ)
    except ValueError as exc:
        print(f"otela-ingress: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "keys":
            return _keys_command(args)
        if args.command == "grant":
            return _grant_command(args)
        if args.command == "limits":
            return _limits_command(args)
        policy = load_policy(args.policy)
        if args.no_auth:
            print("otela-ingress: WARNING: --no-auth is ON: anyone who reaches this port can use "
                  "every engine. For local demos only.", file=sys.stderr)
        otela_node.install_event_loop()
        return asyncio.run(_serve(args, policy))
    except (ValueError, sqlite3.Error, OSError) as exc:
        print(f"otela-ingress: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
