"""crdt.py: the otela registry (sessions, API keys, usage counters), a grow-only map merged
by lattice join.

Role: every member of the overlay holds one `GMap` from session id to session record. Members
exchange records (whole, as deltas, or after comparing digests) and `merge` them; whatever the
order, loss or duplication of those exchanges, replicas that have seen the same records hold the
same map. That is the whole consistency story of otela: no leader, no consensus, no clock sync.

Data flow: the owner of a session `put`s its own record (JOIN, then SERVING with a growing
`version` whenever models or labels change); any member may `put` DOWN or LEFT for another
session it has found dead (with `evicted_by`); records from peers arrive through `merge`;
`digest` and `diff` let two peers send each other only what differs; `compact` forgets sessions
that left long ago.

Rules of this file:
  1. No I/O, no clock, no randomness in merge: time comes in as an argument (`compact(now)`),
     so every test and every replica computes the same thing from the same inputs.
  2. A malformed record raises `RecordError` and leaves the map exactly as it was.

Three kinds of entry share the map, told apart by their id (a session id has no colon):
  session  "<32 hex>"          a member's session record (the lifecycle below);
  key      "key:<sha256 hex>"  an API key's record: who may use it for what (never its secret);
  usage    "use:<32 hex>"      one slot of a per-(key, day) or per-(key, month) G-Counter: the
                               requests and tokens one ingress session served for that key then;
  revocation "rev:<grant>"     a grant (or a Slurm job's grants) revoked;
  limit    "lim:<u|m>-<16 hex>"  a user's or a model's limits per minute and in flight (a
                               model's: and the sites its requests may be served at);
           "lim:k-<16 hex>"    a key's settings: its limits, its share and classes of the
                               fair queue and its sites (see "Limits and flows");
  flow     "flow:<session>"    what one ingress session admitted per limited subject in its last
                               minute (see "Limits and flows").
All are ordered the same way (state, then version, then encoding), so they travel with
the same rumours, digests and anti-entropy, and a replica that was away catches up on all. An id
of another "<kind>:<name>" shape is a kind a newer release knows and this one does not: it is
carried (validated only for its order and size, at most MAX_UNKNOWN of them), never rejected.

Planes and tiers. Sessions (and unknown kinds) are the routing plane: every member holds them.
Keys, usage slots, revocations, limits and flows are the ingress plane: only ingresses hold them,
and only a record signed with the ingress tier's secret (`Authority`, a secret that only ingress
hosts have, apart from the cluster key every Slurm job holds) is ever applied. The map keeps a digest per plane, so a worker
and an ingress compare only what both hold.

Settings. The one reader of every role's settings (flag, then OTELA_<NAME>, then default:
`parse_settings`, `env_value`) lives at the end of this file, because every role carries it;
it takes the environment as an argument, as merge takes time.

Liveness (heartbeats, suspicion) is deliberately NOT stored here: it changes every second and
would bloat the map; the failure detector in otela_node.py keeps it locally.
"""
from __future__ import annotations

import argparse
import calendar
import collections
import hashlib
import hmac
import json
import math
import re
import secrets
import time
from typing import Any, Callable, Container, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

# =============================================================================================
# The one JSON pair (orjson when importable; the stdlib otherwise). Used for wire messages.
# The canonical encoding below always uses the stdlib, so replicas with and without orjson
# break ties identically.
# =============================================================================================
try:  # optional accelerator
    import orjson as _orjson

    def dumps(obj: Any) -> bytes:
        return _orjson.dumps(obj)

    def loads(data: Union[bytes, str]) -> Any:
        return _orjson.loads(data)

except ImportError:  # pragma: no cover - exercised by the no-accelerator CI run
    _encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj).encode("utf-8")

    def loads(data: Union[bytes, str]) -> Any:
        return json.loads(data)


_canonical = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)


def _not_encodable(obj: Any) -> Any:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


try:   # the same C encoder _canonical builds, made once (every record of a join goes through it)
    _c_canonical = json.encoder.c_make_encoder(
        None, _not_encodable, json.encoder.encode_basestring, None, ":", ",", True, False, False)
except (AttributeError, TypeError):   # pragma: no cover - an interpreter without the C module
    _c_canonical = None


def encode(record: Dict[str, Any]) -> bytes:
    """Canonical encoding: sorted keys, no spaces, UTF-8. Equal records encode equally."""
    if _c_canonical is not None and type(record) is dict:
        return "".join(_c_canonical(record, 0)).encode("utf-8")
    return _canonical.encode(record).encode("utf-8")


# =============================================================================================
# Lifecycle
# =============================================================================================
JOIN, SERVING, DOWN, LEFT = 0, 1, 2, 3
STATE_NAMES = {JOIN: "JOIN", SERVING: "SERVING", DOWN: "DOWN", LEFT: "LEFT"}
STATES_BY_NAME = {name: state for state, name in STATE_NAMES.items()}

# The lifecycle as a table. States only ever go up (merge takes the higher one), so a session
# that went DOWN never serves again: a restarted engine joins as a new session.
#
#   state    written by      routable  meaning
LIFECYCLE = {
    JOIN:    ("owner", False, "node started, engine loading"),
    SERVING: ("owner", True, "engine ready; routable unless suspected"),
    DOWN:    ("anyone", False, "engine dead, failing or draining; may finish in-flight work"),
    LEFT:    ("anyone", False, "gone for good; kept for the retention time, then compacted"),
}
OWNER_ONLY = frozenset(s for s, (writer, _, _) in LIFECYCLE.items() if writer == "owner")
ROUTABLE = frozenset(s for s, (_, routable, _) in LIFECYCLE.items() if routable)

# =============================================================================================
# Limits and defaults (the reason beside each number)
# =============================================================================================
RETENTION_S = 900.0           # LEFT records are kept 15 minutes (a join answer carries the last
                              # 10 of them), then compacted: at 100 leaves a minute in a 1,000-node
                              # cluster that is 1,500 records, where a day of them was 62.8 MB
FORGET_S = 3600.0             # ... and a compacted session's id is remembered for an hour, so no
                              # stale copy brings it back; one that comes later (a partition longer
                              # than that) is a dead address, probed and evicted again in seconds
MAX_SESSIONS = 20_000         # session records a replica takes from others (live and LEFT): 4x the
                              # 5,000 members the overlay is measured at; past it (or past
MAX_SESSION_BYTES = 12 << 20  # this many bytes of them encoded, 20,000 of a real record's ~600),
                              # new ids are refused (counted) until compaction: a member flooding
                              # forged sessions costs each replica at most ~35 MB of memory
MAX_RECORD_BYTES = 2048       # a record must fit one UDP datagram with room for the envelope
MAX_STRING = 256              # model names and addresses; HF ids are well below this
MAX_LIST = 64                 # models per session; real engines serve a handful
MAX_LABELS = 32
SITE_LABEL = "site"           # a session's site (--site-name) is this label, not a field of its own: a
                              # previous release carries and shows labels, allowlists match them
                              # ("site=a"), and a grant's labels pin it (otela_ingress.Grants.site)
SITE_NAME = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")   # a site's name: typed by an operator, held by a URL or label
MAX_ADAPTERS = MAX_LIST       # LoRA adapters per session ({name: [base, path]}): each is a model too
BUCKETS = 256                 # digest buckets: 256 * ~20 bytes is still one datagram, and at
                              # 10,000 sessions one changed bucket holds ~40 records
MAX_FORGOTTEN = 100_000       # compacted ids remembered: ~10 MB at worst, years of churn at
                              # the seed paper's rate of sessions per day
MAX_UNKNOWN = 1024            # entries of kinds this release does not know: room for what a
                              # newer release adds, never a way to fill a replica's memory
_SESSION_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
_UNKNOWN_ID = re.compile(r"^[a-z]{1,16}:[0-9A-Za-z_.-]{1,128}$")
_ROLES = ("worker", "ingress", "relay")

# Entry kinds, by id prefix. A session id is [0-9A-Za-z_-], so the colon keeps kinds apart.
SESSION, KEY, USAGE, REVOCATION, UNKNOWN = "session", "key", "usage", "revocation", "unknown"
LIMIT, FLOW = "limit", "flow"
KEY_ENTRY = "key:"
USAGE_ENTRY = "use:"
REVOCATION_ENTRY = "rev:"
LIMIT_ENTRY = "lim:"
FLOW_ENTRY = "flow:"

# Planes: who holds an entry. Routing: every member (what routing needs: sessions, their reach
# and load). Ingress: ingresses only (keys, usage), and only as written by the ingress tier.
ROUTING, INGRESS = "routing", "ingress"
PLANES = (ROUTING, INGRESS)
PLANE_OF = {SESSION: ROUTING, UNKNOWN: ROUTING, KEY: INGRESS, USAGE: INGRESS, REVOCATION: INGRESS,
            LIMIT: INGRESS, FLOW: INGRESS}


class RecordError(ValueError):
    """A session record that is malformed or written by someone not allowed to write it."""


def new_session_id() -> str:
    """128 random bits: new at every start of a node, never reused."""
    return secrets.token_hex(16)


# =============================================================================================
# Validation
# =============================================================================================
def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_string(field: str, value: Any) -> None:
    if not isinstance(value, str):
        raise RecordError(f"{field} must be a string, got {type(value).__name__}")
    if len(value) > MAX_STRING:
        raise RecordError(f"{field} is longer than {MAX_STRING} characters")


def kind_of(entry_id: str) -> str:
    """SESSION, KEY, USAGE, REVOCATION, LIMIT, FLOW or UNKNOWN (another release's kind), from the entry id's prefix."""
    if entry_id.startswith(KEY_ENTRY):
        return KEY
    if entry_id.startswith(USAGE_ENTRY):
        return USAGE
    if entry_id.startswith(REVOCATION_ENTRY):
        return REVOCATION
    if entry_id.startswith(LIMIT_ENTRY):
        return LIMIT
    if entry_id.startswith(FLOW_ENTRY):
        return FLOW
    return UNKNOWN if ":" in entry_id else SESSION


def plane_of(entry_id: str) -> str:
    """ROUTING or INGRESS: which members hold this entry."""
    return PLANE_OF[kind_of(entry_id)]


def _check_object(where: str, record: Any) -> None:
    if not isinstance(record, dict):
        raise RecordError(f"{where}: record must be an object")


def _check_fields(where: str, record: Dict[str, Any], required: Iterable[str],
                  allowed: Optional[Iterable[str]] = None) -> None:
    """Every `required` field present; with `allowed`, nothing else (a closed record)."""
    for field in required:
        if field not in record:
            raise RecordError(f"{where}: missing field {field!r}")
    unknown = sorted(set(record) - set(allowed)) if allowed is not None else ()
    if unknown:
        raise RecordError(f"{where}: unknown field {unknown[0]!r}")


def _check_count(where: str, field: str, value: Any) -> None:
    """Versions and counters: integers a JSON double holds exactly."""
    if type(value) is not int or not 0 <= value < 2**53:
        raise RecordError(f"{where}: {field} must be an integer in [0, 2^53)")


def _check_names(where: str, field: str, names: Any, entry: str, least: int = 0) -> None:
    """A list of `least` to MAX_LIST strings (models, a key's allowed models), each an `entry`."""
    if not isinstance(names, list) or not least <= len(names) <= MAX_LIST:
        most = f"at most {MAX_LIST}" if least == 0 else f"{least} to {MAX_LIST} names"
        raise RecordError(f"{where}: {field} must be a list of {most}")
    for name in names:
        if type(name) is not str or len(name) > MAX_STRING:   # the common case in one test
            _check_string(entry, name)


def _check_labels(where: str, labels: Any, prefix: str = "") -> None:
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
        raise RecordError(f"{where}: labels must be an object of at most {MAX_LABELS}")
    for key, value in labels.items():
        if type(key) is not str or type(value) is not str or len(key) > MAX_STRING or len(value) > MAX_STRING:
            _check_string(prefix + "label key", key)
            _check_string(prefix + "label value", value)


def validate(session_id: Any, record: Any) -> bytes:
    """Check one record; return its canonical encoding. Raises RecordError."""
    if isinstance(session_id, str) and ":" in session_id:
        return _VALIDATORS[kind_of(session_id)](session_id, record)
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise RecordError(f"bad session id {session_id!r}: 1-64 characters of [0-9A-Za-z_-]")
    where = f"session {session_id}"
    _check_object(where, record)
    _check_fields(where, record, ("owner", "state", "version", "started"))
    _check_string("owner", record["owner"])
    state = record["state"]
    if type(state) is not int or state not in STATE_NAMES:
        raise RecordError(f"{where}: unknown state {state!r}")
    _check_count(where, "version", record["version"])
    if not _is_number(record["started"]):
        raise RecordError(f"{where}: started must be a finite number")
    _check_session_fields(where, record)
    if state == LEFT and "left_at" not in record:
        raise RecordError(f"{where}: a LEFT record needs left_at")
    if state in OWNER_ONLY and "evicted_by" in record:
        raise RecordError(f"{where}: only the owner writes {STATE_NAMES[state]}; it cannot carry evicted_by")
    _check_seal(where, record)
    _check_evidence(where, record)
    _check_binding(where, record)
    return _encode_checked(where, record)


def _check_session_fields(where: str, record: Dict[str, Any]) -> None:
    """A session record's optional fields."""
    for field in ("addr", "gossip", "code_hash", "relay", "evicted_by"):
        if field in record:
            _check_string(field, record[field])
    if "role" in record and record["role"] not in _ROLES:
        raise RecordError(f"{where}: role must be one of {', '.join(_ROLES)}")
    _check_names(where, "models", record.get("models", []), "model name")
    _check_adapters(where, record)
    _check_labels(where, record.get("labels", {}))
    _check_hardware(where, record.get("hardware", {}))
    window = record.get("max_model_len", 1)
    if type(window) is not int or not 0 < window < 2**31:
        raise RecordError(f"{where}: max_model_len must be an integer in [1, 2^31)")
    for field in ("capacity", "left_at", "ends_at"):
        if field in record and not _is_number(record[field]):
            raise RecordError(f"{where}: {field} must be a finite number")


def _check_hardware(where: str, hardware: Any) -> None:
    """`hardware`: {gpu: str, count: number >= 0, memory_gb: number >= 0}, each optional."""
    if not isinstance(hardware, dict):
        raise RecordError(f"{where}: hardware must be an object")
    if "gpu" in hardware:
        _check_string("hardware.gpu", hardware["gpu"])
    for field in ("count", "memory_gb"):
        if field in hardware and (not _is_number(hardware[field]) or hardware[field] < 0):
            raise RecordError(f"{where}: hardware.{field} must be a number >= 0")


def _check_adapters(where: str, record: Dict[str, Any]) -> None:
    """`adapters`: {name: [base, path]} of at most MAX_ADAPTERS, strings of at most MAX_STRING."""
    adapters = record.get("adapters", {})
    if not isinstance(adapters, dict) or len(adapters) > MAX_ADAPTERS:
        raise RecordError(f"{where}: adapters must be an object of at most {MAX_ADAPTERS}")
    for name, value in adapters.items():
        _check_string("adapter name", name)
        if not isinstance(value, list) or len(value) != 2:
            raise RecordError(f"{where}: adapter {name[:64]!r} must be [base, path]")
        _check_string("adapter base", value[0])
        _check_string("adapter path", value[1])


# =============================================================================================
# The end of a session, bound to who wrote it (as far as a shared cluster key allows)
# =============================================================================================
# Every holder of the cluster key can write any record, so the map binds the two ways a session
# ends to their writers by what the record carries, not by who sent it:
#   - The owner's own DOWN or LEFT reveals a secret: the session's records carry "seal", a
#     hash of a secret only the owner process knows (seal_of); its DOWN or LEFT carries "unseal",
#     the secret. A replica holding a sealed record takes no record of that session with another
#     seal, and no DOWN or LEFT without evicted_by that does not unseal it (GMap refuses them, and
#     counts why): nobody else can end a live session as if its owner had.
#   - An eviction (evicted_by) carries the failure detector's "evidence": when the suspicion
#     began, the grace it was given, and the members that confirmed it (the evictor among them);
#     a LEFT comes no sooner than its grace after the suspicion began. Members share one key, so
#     evidence can be made up by a key holder; it stops evictions without any (a release before
#     this one's, a bug) and it tells the operator who evicted whom and on whose word. A live
#     member evicted anyway rejoins as a new session within a second.
#   - Beside the evidence, "vouch": {confirmer: voucher} for the confirmers whose vouchers reached
#     the evictor. A member that suspects a session from its own failed probe (not from a rumour),
#     or sees its address taken by its successor, makes a voucher: an HMAC under its own binding
#     key (the one its records are bound under, see "Records bound to their writers") of the
#     suspect, the suspected version and itself. Vouchers travel with the suspicion rumours
#     (otela_node.py, "vo"). Nobody can make another member's voucher, and an ingress can derive a
#     granted job's binding key and the ingress tier's, so it believes an eviction only on a voucher
#     that checks (Authority.vouched) at a version no older than the one it routes: evidence naming
#     members that never suspected the session does not take it out of routing there
#     (otela_ingress.py, EvictionDoubts). A job holding its own grant can still vouch in its own
#     name. A separate field, not a key of "evidence": a release before this one refuses evidence
#     with another key, and carries a field it does not know.
SEAL_BYTES = 16
MAX_CONFIRMERS = 8
VOUCHER_HEX = 32              # a voucher is 128 bits of HMAC-SHA256: no forger can check a guess
                              # offline, and 8 of them add ~560 bytes to an eviction's record
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def seal_of(secret: str) -> str:
    """The commitment a session's records carry for `secret` (32 hex digits)."""
    return hashlib.blake2b(bytes.fromhex(secret), digest_size=SEAL_BYTES).hexdigest()


def voucher(key: bytes, suspect: str, version: int, confirmer: str) -> str:
    """`confirmer`'s word, under its binding key, that its own probe of `suspect` (its record at
    `version`) failed."""
    data = b"otela-vouch\0" + suspect.encode() + b"\0" + str(version).encode() + b"\0" + confirmer.encode()
    return hmac.new(key, data, hashlib.sha256).hexdigest()[:VOUCHER_HEX]


def is_voucher(value: Any) -> bool:
    return isinstance(value, str) and bool(_HEX32.match(value))


def _check_seal(where: str, record: Dict[str, Any]) -> None:
    for field in ("seal", "unseal"):
        if field in record and not (isinstance(record[field], str) and _HEX32.match(record[field])):
            raise RecordError(f"{where}: {field} must be 32 hex digits")
    if "unseal" in record:
        if record["state"] < DOWN or "seal" not in record or seal_of(record["unseal"]) != record["seal"]:
            raise RecordError(f"{where}: unseal is the secret of the record's seal, "
                              "in its owner's DOWN or LEFT only")


def _check_evidence(where: str, record: Dict[str, Any]) -> None:
    evidence = record.get("evidence")
    if evidence is None:
        if "vouch" in record:
            raise RecordError(f"{where}: vouch comes with an eviction's evidence")
        return
    if "evicted_by" not in record or not isinstance(evidence, dict) \
            or set(evidence) != {"since", "grace", "by"}:
        raise RecordError(f"{where}: evidence is an eviction's since, grace and by")
    by = evidence["by"]
    if not _is_number(evidence["since"]) or not _is_number(evidence["grace"]) or evidence["grace"] < 0 \
            or not isinstance(by, list) or not 1 <= len(by) <= MAX_CONFIRMERS \
            or not all(isinstance(b, str) and _SESSION_ID.match(b) for b in by) or record["evicted_by"] not in by:
        raise RecordError(f"{where}: evidence: since and grace >= 0 numbers, by 1-"
                          f"{MAX_CONFIRMERS} session ids with the evictor")
    if record["state"] == LEFT and record["left_at"] < evidence["since"] + evidence["grace"]:
        raise RecordError(f"{where}: evicted before its grace was over")
    vouch = record.get("vouch", {})
    if not isinstance(vouch, dict) or len(vouch) > MAX_CONFIRMERS \
            or not all(c in by and is_voucher(m) for c, m in vouch.items()):
        raise RecordError(f"{where}: vouch maps confirmers in the evidence to {VOUCHER_HEX} hex digits each")


def ending_refused(held: Optional[Dict[str, Any]], record: Dict[str, Any]) -> Optional[str]:
    """Why a (valid) session record must not replace `held` (None: it may)."""
    if record["state"] >= DOWN and "evicted_by" in record and "evidence" not in record:
        return "eviction_without_evidence"
    if held is None or "seal" not in held:
        return None
    if record.get("seal") != held["seal"]:
        return "seal"
    if record["state"] >= DOWN and "evicted_by" not in record and "unseal" not in record:
        return "seal"
    return None


# =============================================================================================
# Key records: an API key's rights, replicated; revocation wins every merge
# =============================================================================================
# A key's entry id is "key:" + sha256(token) in hex: the hash is all an ingress needs to check a
# bearer token, and the token itself is never in a record (the field set below is closed, so
# a record carrying anything else, a secret included, is refused). Any ingress may write a key
# record (it was created or revoked there); versions order edits, and the state orders first:
#
#   state    written by   accepted  meaning
KEY_ACTIVE, KEY_REVOKED = 0, 1
KEY_LIFECYCLE = {
    KEY_ACTIVE:  ("any ingress", True, "accepted at every ingress until it expires"),
    KEY_REVOKED: ("any ingress", False, "refused everywhere for good: wins every merge"),
}
KEY_STATE_NAMES = {KEY_ACTIVE: "active", KEY_REVOKED: "revoked"}
ACCEPTED_KEY_STATES = frozenset(s for s, (_, accepted, _) in KEY_LIFECYCLE.items() if accepted)
_KEY_ENTRY = re.compile(r"^key:[0-9a-f]{64}$")
_KEY_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
# field: (required, check); budgets are tokens (prompt + completion), 0 meaning no budget.
# The set is the one the release before this wrote, and it stays closed: an ingress of that
# release refuses a key record carrying anything else, and the whole batch it came in with. A
# key's settings that came later (its limits per minute and in flight, its weight and classes in
# the fair queue) live in an entry of their own, "lim:k-<subject>" (see "Limits and flows"),
# which that release carries as a kind it does not know.
_KEY_FIELDS = {
    "state": True, "version": True, "id": True, "user": True, "created": True,
    "allow": False, "admin": False, "rate": False, "budget_day": False, "budget_month": False,
    "expires": False, "revoked_at": False, "sig": False,
}
# A request's priority classes, highest first: a class waits in the ingress's queue only behind
# its own and higher ones (the names are the API: keys, X-Otela-Priority, /metrics)
PRIORITY_CLASSES = ("interactive", "standard", "batch")
DEFAULT_PRIORITY = "standard"
MAX_KEY_WEIGHT = 1e6   # a share a million times another's is already all of it


def key_entry(key_hash: str) -> str:
    """The map id of the key whose token hashes (sha256, hex) to `key_hash`."""
    return KEY_ENTRY + key_hash


def key_record(key_id: str, user: str, created: float, allow: Iterable[str] = (), admin: bool = False,
               rate: float = 0.0, budget_day: int = 0, budget_month: int = 0,
               expires: Optional[float] = None, version: int = 0) -> Dict[str, Any]:
    """A new active key's record (its defaults left out, to keep records small; its settings:
    key_settings_record)."""
    record: Dict[str, Any] = {"state": KEY_ACTIVE, "version": version, "id": key_id, "user": user,
                              "created": created}
    for field, value in (("allow", sorted(set(allow))), ("admin", bool(admin)), ("rate", rate),
                         ("budget_day", int(budget_day)), ("budget_month", int(budget_month))):
        if value:
            record[field] = value
    if expires is not None:
        record["expires"] = expires
    return record


def revoked(record: Dict[str, Any], now: float) -> Dict[str, Any]:
    """The record of the same key, revoked (idempotent: revoking twice changes nothing)."""
    if record["state"] == KEY_REVOKED:
        return dict(record)
    return dict(record, state=KEY_REVOKED, version=record["version"] + 1, revoked_at=now)


def validate_key(entry_id: str, record: Any) -> bytes:
    if not _KEY_ENTRY.match(entry_id):
        raise RecordError(f"bad key entry {entry_id!r}: 'key:' and 64 hex digits of sha256")
    _check_object(entry_id, record)
    # closed: nothing else (a secret, say) ever travels in a key record
    _check_fields(entry_id, record, [f for f, required in _KEY_FIELDS.items() if required], _KEY_FIELDS)
    if type(record["state"]) is not int or record["state"] not in KEY_LIFECYCLE:
        raise RecordError(f"{entry_id}: unknown key state {record['state']!r}")
    _check_count(entry_id, "version", record["version"])
    if not isinstance(record["id"], str) or not _KEY_ID.match(record["id"]):
        raise RecordError(f"{entry_id}: id must be 1-64 characters of [0-9A-Za-z_-]")
    _check_string("user", record["user"])
    _check_names(entry_id, "allow", record.get("allow", []), "allow entry")
    if type(record.get("admin", False)) is not bool:
        raise RecordError(f"{entry_id}: admin must be true or false")
    for field in ("rate", "created", "expires", "revoked_at"):
        if field in record and (not _is_number(record[field]) or record[field] < 0):
            raise RecordError(f"{entry_id}: {field} must be a finite number >= 0")
    for field in ("budget_day", "budget_month"):
        value = record.get(field, 0)
        if type(value) is not int or not 0 <= value < 2**53:
            raise RecordError(f"{entry_id}: {field} must be an integer >= 0 (tokens; 0: none)")
    _check_sig(entry_id, record)
    return _encode_checked(entry_id, record)


def _check_priorities(entry_id: str, record: Dict[str, Any]) -> None:
    """A key's fair-queue fields: its weight, its class and the classes it may ask for."""
    weight = record.get("weight", 1.0)
    if not _is_number(weight) or not 0 < weight <= MAX_KEY_WEIGHT:
        raise RecordError(f"{entry_id}: weight must be a number > 0 and <= {MAX_KEY_WEIGHT:g}")
    if record.get("priority", DEFAULT_PRIORITY) not in PRIORITY_CLASSES:
        raise RecordError(f"{entry_id}: priority must be one of {', '.join(PRIORITY_CLASSES)}")
    asked = record.get("priorities", [])
    if not isinstance(asked, list) or len(set(asked)) != len(asked) or \
            any(not isinstance(c, str) or c not in PRIORITY_CLASSES for c in asked):
        raise RecordError(f"{entry_id}: priorities must be a list of distinct classes of "
                          f"{', '.join(PRIORITY_CLASSES)}")


def key_accepts(record: Dict[str, Any], now: float) -> bool:
    """Whether a key's record lets its token in at `now` (active and not expired)."""
    return record["state"] in ACCEPTED_KEY_STATES and not (
        "expires" in record and now >= record["expires"])


# =============================================================================================
# Usage: per (key, period) G-Counters, one slot per ingress session
# =============================================================================================
# Each ingress session counts what it served in its own slot, which only it writes: the slot's
# counts only grow, and each write bumps its version, so "the higher version wins" is the
# G-Counter's slot-wise max. The counter's value is the sum over its slots (`usage_totals`).
# A restarted ingress is a new session with new slots; the old ones stay as they were.
#
# A counter's period ("day") is a UTC day (YYYY-MM-DD: the day budget, recent days' views) or a
# month (YYYY-MM: the month budget, a year of totals). Its "model" is "" (all models): the
# replicated counters hold what budgets and totals need, 1,000 keys x 3 ingresses x (8 days + 13
# months) = 63k slots however many models a key uses; the per-model rows stay in each ingress's
# SQLite (its `daily` table and ledger). Slots with a model name are a release before this one's
# (per model and day); they are still counted, in their day and its month.
_USAGE_ENTRY = re.compile(r"^use:[0-9a-f]{32}$")
_PERIOD = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")
USAGE_COUNTS = ("requests", "prompt_tokens", "completion_tokens")
USAGE_RETENTION_DAYS = 8      # day counters in the map (a day budget needs today; views a week);
USAGE_RETENTION_MONTHS = 13   # month counters: this month's budget, a year of totals. Both are
                              # the operator's (ingress --usage-days, --usage-months); older
                              # periods stay in each ingress's SQLite
ALL_MODELS = ""               # a counter's "model": every model of its key
MAX_REQUEST_TOKENS = 1 << 24  # prompt or completion tokens one request may add to a slot: above
                              # every model's context window (Llama 4 Scout's 10M is the longest),
                              # so no honest count reaches it; an ingress books no more (otela_ingress,
                              # "engine numbers"), and a slot claiming more per request is refused
KEY_RETENTION_S = 30 * 86400.0   # a revoked or expired key's record is compacted this long after it
                                 # stopped working; its id is remembered, so no copy comes back


def usage_entry(key_hash: str, model: str, day: str, slot: str) -> str:
    """The map id of one slot: derived from what it counts, so no two slots can claim it."""
    digest = hashlib.blake2b("\0".join((key_hash, model, day, slot)).encode(), digest_size=16)
    return USAGE_ENTRY + digest.hexdigest()


def usage_record(key_hash: str, model: str, day: str, slot: str, version: int, requests: int,
                 prompt_tokens: int, completion_tokens: int) -> Dict[str, Any]:
    return {"state": 0, "version": version, "key": key_hash, "model": model, "day": day, "slot": slot,
            "requests": requests, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def validate_usage(entry_id: str, record: Any) -> bytes:
    if not _USAGE_ENTRY.match(entry_id):
        raise RecordError(f"bad usage entry {entry_id!r}: 'use:' and 32 hex digits")
    _check_object(entry_id, record)
    fields = ("state", "version", "key", "model", "day", "slot") + USAGE_COUNTS
    _check_fields(entry_id, record, fields, fields + ("sig",))
    _check_sig(entry_id, record)
    if record["state"] != 0 or type(record["state"]) is not int:
        raise RecordError(f"{entry_id}: a usage slot's state is 0")
    for field in ("version",) + USAGE_COUNTS:
        _check_count(entry_id, field, record[field])
    for field in USAGE_COUNTS[1:]:
        if record[field] > record["requests"] * MAX_REQUEST_TOKENS:
            raise RecordError(f"{entry_id}: {field} over {MAX_REQUEST_TOKENS} a request")
    for field in ("key", "model", "day", "slot"):
        _check_string(field, record[field])
    if not re.match(r"^[0-9a-f]{64}$", record["key"]) or not _PERIOD.match(record["day"]) \
            or not _SESSION_ID.match(record["slot"]):
        raise RecordError(f"{entry_id}: key must be 64 hex digits, day YYYY-MM-DD or YYYY-MM, "
                          "slot a session id")
    if entry_id != usage_entry(record["key"], record["model"], record["day"], record["slot"]):
        raise RecordError(f"{entry_id}: the id does not match the slot's key, model, day and slot")
    return _encode_checked(entry_id, record)


def day_start(day: str) -> float:
    """Unix time of 00:00 UTC on `day` (YYYY-MM-DD)."""
    return float(calendar.timegm(time.strptime(day, "%Y-%m-%d")))


def budget_periods(record: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """The day and the month whose budgets a usage slot counts in (None: neither): a day counter
    its day, a month counter its month, a release before's per-model day slot both."""
    period = record["day"]
    if len(period) == 7:
        return None, period
    return period, (period[:7] if record["model"] != ALL_MODELS else None)


def usage_spent(records: Iterable[Dict[str, Any]], key_hash: str, day: str) -> Tuple[int, int]:
    """Tokens `key_hash` used on `day` and in its month, over every slot (budget_periods)."""
    today = month = 0
    for record in records:
        if record["key"] == key_hash:
            tokens = record["prompt_tokens"] + record["completion_tokens"]
            in_day, in_month = budget_periods(record)
            today += tokens if in_day == day else 0
            month += tokens if in_month == day[:7] else 0
    return today, month


def usage_kept(period: str, day_horizon: str, month_horizon: str) -> bool:
    """Whether a counter of `period` is inside the retention (horizons: the oldest kept)."""
    return period >= (month_horizon if len(period) == 7 else day_horizon)


def usage_horizons(now: float, days: int, months: int) -> Tuple[str, str]:
    """The oldest day and month kept: `days` days back (today is day 1), `months` months back
    (a century at most: beyond it, all is kept)."""
    days, months = min(days, 36525), min(months, 1200)
    year, month = time.gmtime(now)[:2]
    back = year * 12 + month - 1 - (months - 1)
    return time_day(now - (days - 1) * 86400.0), f"{back // 12:04d}-{back % 12 + 1:02d}"


def usage_totals(records: Iterable[Dict[str, Any]], key_hash: Optional[str] = None,
                 days: Optional[Iterable[str]] = None) -> Dict[Tuple[str, str, str], Dict[str, int]]:
    """The G-Counters' values: (key, model, day) -> summed counts over their slots, optionally
    for one key and some days."""
    wanted = set(days) if days is not None else None
    totals: Dict[Tuple[str, str, str], Dict[str, int]] = {}
    for record in records:
        if (key_hash is not None and record["key"] != key_hash) or \
                (wanted is not None and record["day"] not in wanted):
            continue
        sums = totals.setdefault((record["key"], record["model"], record["day"]),
                                 dict.fromkeys(USAGE_COUNTS, 0))
        for field in USAGE_COUNTS:
            sums[field] += record[field]
    return totals


# =============================================================================================
# Limits and flows: per-minute windows that the ingresses share
# =============================================================================================
# A limit caps a subject's requests and tokens per sliding minute and its requests in flight
# (LIMIT_FIELDS, 0 meaning none). A user's (all of its keys together), a model's (every key's
# requests to it) and a key's are entries of their own, "lim:<u|m|k>-<subject>", set by an admin
# at any ingress and signed by the ingress tier like keys. A key's entry ("k", the subject of its
# token's sha256) also carries its place in the fair queue (KEY_QUEUE_FIELDS: weight, priority,
# priorities): all that this release added to a key lives there, so its key record stays the one
# the release before reads, and a key with settings replicates to an ingress of that release as
# any other (which admits it as that release would, without the settings it does not know). The
# two entries travel apart: a key's entry may arrive before its key, or after it, or change alone.
# Each ingress session publishes what it admitted per limited subject in its last minute, one
# entry "flow:<session id>" of at most MAX_FLOW_SUBJECTS subjects; every ingress adds the others'
# to its own window (otela_ingress.py, "Limits").
#
# A subject is a keyed hash of what it names ("u", a user; "m", a model; "k", a key's sha256;
# "t", a tenant of the fair queue), under a key only ingresses derive (Authority.subject_key): an
# ingress of the release before these kinds takes "lim:" and "flow:" for kinds it does not know,
# holds them on its routing plane and hands them to workers (MAX_UNKNOWN of them at most), so they
# say nothing a compute job may not read: no user name, no key, only counts, limits, a key's weight
# and classes and a model's name (which the workers serving it know). This release holds them on
# the ingress plane.
LIMIT_FIELDS = ("rpm", "tpm", "concurrency")   # requests and tokens a minute, requests in flight
KEY_QUEUE_FIELDS = ("weight", "priority", "priorities")   # a key's share and classes (FairQueue)
# Data residency: the sites a key's requests (its "lim:k-" entry) or a model's requests (its
# "lim:m-" entry) may be served at, by the site its grant's label gives a session (absent: any).
# An ingress of the release before refuses an entry with a field it does not know, and with it
# the key's or model's other settings: ingresses are upgraded before any is given sites (README).
RESIDENCY_FIELDS = ("sites",)
MAX_SITES = 16                # sites one key or model may be bound to: 16 names of 64 characters
                              # keep the entry under MAX_RECORD_BYTES with its other settings
KEY_SETTINGS = LIMIT_FIELDS + KEY_QUEUE_FIELDS + RESIDENCY_FIELDS   # what a key's "lim:k-" entry may carry
LIMIT_SUBJECTS = {"u": "user", "m": "model", "k": "key"}   # who an entry of its own limits
MAX_LIMITS = 4096             # user and model limits held: a site's users and models, many times
                              # over; ~150 bytes each, 0.6 MB at most
MAX_KEY_SETTINGS = 65536      # keys' settings held (counted apart from the above): a key may have
                              # its own, and a site hands out keys per person, course and pipeline,
                              # so 16x the 4,096 users above with settings on every key; ~200 bytes
                              # each, 13 MB at most. Keys themselves are not capped (the tier signs
                              # both), so this bounds a runaway script, not an attacker; a settings
                              # entry past it is refused (counted), its key admitted without them.
                              # (An ingress of the release before holds them among MAX_UNKNOWN.)
MAX_FLOWS = 256               # flow entries held (one per ingress session seen within
FLOW_RETENTION_S = 600.0      # ... this long: an ingress restarted every 3 s for 10 minutes)
MAX_FLOW_SUBJECTS = 32        # subjects one flow entry carries: 40-80 bytes each, as many as
                              # MAX_RECORD_BYTES holds (the publisher keeps the busiest that fit)
SUBJECT_HEX = 16              # 64 bits: no two of a site's subjects collide
_LIMIT_ENTRY = re.compile(r"^lim:[umk]-[0-9a-f]{16}$")
KEY_SETTINGS_ENTRY = LIMIT_ENTRY + "k-"
_FLOW_ENTRY = re.compile(r"^flow:[0-9A-Za-z_-]{1,64}$")
_SUBJECT = re.compile(r"^[kumt]-[0-9a-f]{16}$")


def subject_of(key: bytes, kind: str, name: str) -> str:
    """The subject naming `name` of `kind` (k, u, m, t) under the ingresses' subject key."""
    mac = hmac.new(key, b"otela-subject\0" + kind.encode() + b"\0" + name.encode("utf-8", "surrogateescape"),
                   hashlib.sha256)
    return kind + "-" + mac.hexdigest()[:SUBJECT_HEX]


def limit_entry(subject: str) -> str:
    """The map id of a user's, a model's or a key's limits (a key's: its settings)."""
    entry_id = LIMIT_ENTRY + subject
    if not _LIMIT_ENTRY.match(entry_id):
        raise RecordError(f"bad limit subject {subject!r}: u-, m- or k- and {SUBJECT_HEX} hex digits")
    return entry_id


def limit_record(version: int, limits: Mapping[str, int], model: Optional[str] = None,
                 sites: Iterable[str] = ()) -> Dict[str, Any]:
    """A subject's limits (zeros left out: a record with none is a limit cleared), and the sites
    its requests may be served at (none: anywhere)."""
    record: Dict[str, Any] = {"state": 0, "version": version}
    record.update((f, int(limits[f])) for f in LIMIT_FIELDS if limits.get(f))
    if model is not None:
        record["model"] = model
    sites = sorted(set(sites))
    if sites:
        record["sites"] = sites
    return record


def key_settings_record(version: int, limits: Optional[Mapping[str, int]] = None, weight: float = 1.0,
                        priority: str = DEFAULT_PRIORITY, priorities: Iterable[str] = (),
                        sites: Iterable[str] = ()) -> Dict[str, Any]:
    """A key's settings entry: its limits (LIMIT_FIELDS), its fair-queue fields and its sites,
    each left out at its default (a record with none is the settings cleared)."""
    record = limit_record(version, limits or {}, sites=sites)
    if weight != 1:
        record["weight"] = weight
    if priority != DEFAULT_PRIORITY:
        record["priority"] = priority
    priorities = [c for c in PRIORITY_CLASSES if c in set(priorities) and c != priority]
    if priorities:   # (in class order, its own class left out: it may always ask for that)
        record["priorities"] = priorities
    return record


def has_settings(record: Optional[Mapping[str, Any]]) -> bool:
    """Whether a key's settings entry sets anything (none: the key's defaults)."""
    return record is not None and any(record.get(f) for f in KEY_SETTINGS)


def _check_limits(where: str, record: Dict[str, Any]) -> None:
    for field in LIMIT_FIELDS:
        value = record.get(field, 0)
        if type(value) is not int or not 0 <= value < 2**53:
            raise RecordError(f"{where}: {field} must be an integer >= 0 (0: none)")


def _check_sites(where: str, record: Dict[str, Any]) -> None:
    """A key's or a model's sites (RESIDENCY_FIELDS): 1 to MAX_SITES distinct names, sorted."""
    if "sites" not in record:
        return
    if where[len(LIMIT_ENTRY)] == "u":
        raise RecordError(f"{where}: only a key's or a model's settings name sites")
    sites = record["sites"]
    if not isinstance(sites, list) or not 0 < len(sites) <= MAX_SITES \
            or any(not isinstance(site, str) or not SITE_NAME.match(site) for site in sites) \
            or sites != sorted(set(sites)):
        raise RecordError(f"{where}: sites must be 1 to {MAX_SITES} distinct site names, sorted")


def validate_limit(entry_id: str, record: Any) -> bytes:
    if not _LIMIT_ENTRY.match(entry_id):
        raise RecordError(f"bad limit entry {entry_id!r}: 'lim:', u-, m- or k- and {SUBJECT_HEX} hex digits")
    _check_object(entry_id, record)
    key = entry_id.startswith(KEY_SETTINGS_ENTRY)   # a key's: its fair-queue fields too, no others'
    _check_fields(entry_id, record, ("state", "version"), ("state", "version", "model", "sig") + LIMIT_FIELDS
                  + RESIDENCY_FIELDS + (KEY_QUEUE_FIELDS if key else ()))
    if record["state"] != 0 or type(record["state"]) is not int:
        raise RecordError(f"{entry_id}: a limit's state is 0")
    _check_count(entry_id, "version", record["version"])
    _check_limits(entry_id, record)
    _check_sites(entry_id, record)
    if key:
        _check_priorities(entry_id, record)
    if entry_id[len(LIMIT_ENTRY)] == "m":
        if "model" not in record:
            raise RecordError(f"{entry_id}: a model's limit names its model")
        _check_string("model", record["model"])
    elif "model" in record:
        raise RecordError(f"{entry_id}: only a model's limit names a model")
    _check_sig(entry_id, record)
    return _encode_checked(entry_id, record)


def flow_entry(session_id: str) -> str:
    """The map id of what one ingress session admitted in its last minute."""
    return FLOW_ENTRY + session_id


def flow_record(version: int, at: float, subjects: Mapping[str, List[int]]) -> Dict[str, Any]:
    """{subject: [requests, tokens in the last minute, in flight, tokens served in all]} at `at`."""
    return {"state": 0, "version": version, "at": at, "n": {s: list(v) for s, v in subjects.items()}}


def validate_flow(entry_id: str, record: Any) -> bytes:
    if not _FLOW_ENTRY.match(entry_id):
        raise RecordError(f"bad flow entry {entry_id!r}: 'flow:' and a session id")
    _check_object(entry_id, record)
    _check_fields(entry_id, record, ("state", "version", "at", "n"), ("state", "version", "at", "n", "sig"))
    if record["state"] != 0 or type(record["state"]) is not int:
        raise RecordError(f"{entry_id}: a flow's state is 0")
    _check_count(entry_id, "version", record["version"])
    if not _is_number(record["at"]) or record["at"] < 0:
        raise RecordError(f"{entry_id}: at must be a unix time")
    subjects = record["n"]
    if not isinstance(subjects, dict) or len(subjects) > MAX_FLOW_SUBJECTS:
        raise RecordError(f"{entry_id}: n must be an object of at most {MAX_FLOW_SUBJECTS} subjects")
    for subject, counts in subjects.items():
        if not isinstance(subject, str) or not _SUBJECT.match(subject):
            raise RecordError(f"{entry_id}: a subject is k, u, m or t, '-' and {SUBJECT_HEX} hex digits")
        if not isinstance(counts, list) or len(counts) != 4:
            raise RecordError(f"{entry_id}: a subject's counts are [requests, tokens, in flight, served]")
        for count in counts:
            _check_count(entry_id, "a count", count)
    _check_sig(entry_id, record)
    return _encode_checked(entry_id, record)


def validate_unknown(entry_id: str, record: Any) -> bytes:
    """An entry of a kind this release does not know: checked only for what the map needs to
    order and bound it (rule 2 still holds: anything else raises RecordError)."""
    if not _UNKNOWN_ID.match(entry_id):
        raise RecordError(f"bad entry id {entry_id!r}: a session id, or '<kind>:<name>'")
    _check_object(entry_id, record)
    _check_count(entry_id, "state", record.get("state"))
    _check_count(entry_id, "version", record.get("version"))
    return _encode_checked(entry_id, record)


# =============================================================================================
# The ingress tier: who may write keys and usage
# =============================================================================================
# Two secrets, two tiers. The cluster key (every Slurm job and pod has it) admits a member: it
# may serve, gossip and relay. The ingress secret (only on the hosts that run ingresses) is the
# authority over keys and usage: a key record or usage slot carries "sig", an HMAC of its id and
# canonical encoding under that secret, and a replica that holds the ingress plane applies,
# stores and forwards nothing else of that plane. An ingress's own session record carries
# "tier", an HMAC of its session id and gossip address, so that ingresses send the ingress plane
# only to each other (a worker claiming role "ingress" gets nothing of it).
# Rotation: the secret file holds one secret per line; the first signs, every one verifies.
SIG_LEN = 64                  # hex digits of HMAC-SHA256
_SIG = re.compile(r"^[0-9a-f]{64}$")


def _check_sig(entry_id: str, record: Dict[str, Any]) -> None:
    if "sig" in record and (not isinstance(record["sig"], str) or not _SIG.match(record["sig"])):
        raise RecordError(f"{entry_id}: sig must be {SIG_LEN} hex digits")


def unsigned(record: Dict[str, Any]) -> Dict[str, Any]:
    """The record without its signature (what the signature covers, and what the ingress stores)."""
    if "sig" not in record:
        return record
    return {k: v for k, v in record.items() if k != "sig"}


class Authority:
    """The ingress tier's secrets: `sign` with the first, `verify` with any (rotation). Pure: an
    HMAC is a computation, not I/O."""

    def __init__(self, secrets_: Iterable[bytes]):
        self.secrets = [bytes(s) for s in secrets_]
        if not self.secrets or any(len(s) < 16 for s in self.secrets):
            raise ValueError("the ingress tier needs at least one secret of 16 bytes or more")
        self._granted: Dict[bytes, bytes] = {}   # a verified grant's encoding -> its key

    def _tag(self, secret: bytes, entry_id: str, record: Dict[str, Any]) -> str:
        data = b"otela-entry\0" + entry_id.encode() + b"\0" + encode(unsigned(record))
        return hmac.new(secret, data, hashlib.sha256).hexdigest()

    def sign(self, entry_id: str, record: Dict[str, Any]) -> Dict[str, Any]:
        """The record with its signature by the current secret."""
        signed = dict(unsigned(record))
        signed["sig"] = self._tag(self.secrets[0], entry_id, signed)
        return signed

    def verify(self, entry_id: str, record: Dict[str, Any]) -> bool:
        sig = record.get("sig")
        if not isinstance(sig, str):
            return False
        return any(hmac.compare_digest(self._tag(s, entry_id, record), sig) for s in self.secrets)

    def subject_key(self) -> bytes:
        """The key of limit and flow subjects (subject_of): every ingress derives the same one, a
        compute job none (the first secret's: a rotation renames every subject, and the limits
        of users and models are set again)."""
        return hmac.new(self.secrets[0], b"otela-subject-key", hashlib.sha256).digest()

    # -- grants and record bindings (see "Records bound to their writers") --------------------
    def _grant_mac(self, secret: bytes, grant: Dict[str, Any]) -> str:
        body = {k: v for k, v in grant.items() if k != "mac"}
        return hmac.new(secret, b"otela-grant\0" + encode(body), hashlib.sha256).hexdigest()

    @staticmethod
    def _grant_secret(secret: bytes, grant_id: str) -> bytes:
        return hmac.new(secret, b"otela-grant-key\0" + grant_id.encode(), hashlib.sha256).digest()

    def issue(self, models: Iterable[str], labels: Mapping[str, str], job: str, until: float,
              now: float, tls: Optional[str] = None) -> Tuple[Dict[str, Any], bytes]:
        """A new grant and its key (the key goes to the job alone); `tls`: the fingerprint of the
        job's own tunnel certificate, which ingresses then pin. Raises RecordError."""
        grant: Dict[str, Any] = {"id": secrets.token_hex(GRANT_ID_HEX // 2), "models": sorted(set(models)),
                                 "labels": dict(labels), "job": str(job), "issued": now, "until": until}
        if tls is not None:
            grant["tls"] = tls
        check_grant(grant)
        grant["mac"] = self._grant_mac(self.secrets[0], grant)
        if len(encode(grant)) > MAX_RECORD_BYTES // 2:
            raise RecordError(f"grant is {len(encode(grant))} bytes: at most {MAX_RECORD_BYTES // 2} "
                              "(half a record), fewer models or labels")
        return grant, self._grant_secret(self.secrets[0], grant["id"])

    def grant_key(self, grant: Dict[str, Any]) -> Optional[bytes]:
        """The key of a grant this tier issued (under any of its secrets), or None. Grants that
        verified are remembered by their whole encoding (a session's records carry the same grant
        at every write): one lookup instead of two HMACs."""
        mac = grant.get("mac")
        if not isinstance(mac, str):
            return None
        encoded = encode(grant)
        key = self._granted.get(encoded)
        if key is not None:
            return key
        for secret in self.secrets:
            if hmac.compare_digest(self._grant_mac(secret, grant), mac):
                if len(self._granted) >= MAX_SESSIONS:   # bounded: a grant per live session
                    self._granted.clear()
                key = self._granted[encoded] = self._grant_secret(secret, grant["id"])
                return key
        return None

    def binding_keys(self, session_id: str, record: Dict[str, Any]) -> Optional[List[bytes]]:
        """The keys `record` may be bound under: its grant's, or the ingresses'; [] when nothing
        here can check it (no grant, not a binding ingress); None for a grant not ours."""
        grant = record.get("grant")
        if grant is not None:
            key = self.grant_key(grant)
            return None if key is None else [key]
        if record.get("role") == "ingress" and "bind" in record:
            return [self.ingress_binding(s) for s in self.secrets]
        return []

    def vouched(self, session_id: str, record: Dict[str, Any],
                confirmer: Callable[[str], Optional[Dict[str, Any]]], revoked: Container[str] = ()) -> Optional[bool]:
        """Whether an eviction is vouched for (see "The end of a session"): True when a confirmer's
        voucher checks under its binding key (`confirmer`: its record here, or None); False when
        some confirmer can be checked here and none vouched (a grant not ours, or revoked, counts as
        checked, and failed); None when no confirmer can be checked (ungranted, or unknown here)."""
        vouch = record.get("vouch") or {}
        checkable = False
        for by in (record.get("evidence") or {}).get("by", ()):
            held = confirmer(by)
            if held is None:
                continue
            keys = self.binding_keys(by, held)
            grant = held.get("grant")
            if keys is None or (keys and isinstance(grant, dict) and
                                (grant["id"] in revoked or "job-" + grant.get("job", "") in revoked)):
                checkable = True
                continue
            if not keys:
                continue
            checkable = True
            mac = vouch.get(by)
            if isinstance(mac, str) and any(hmac.compare_digest(voucher(k, session_id, record["version"], by), mac)
                                            for k in keys):
                return True
        return False if checkable else None

    @staticmethod
    def ingress_binding(secret: bytes) -> bytes:
        return hmac.new(secret, b"otela-ingress-bind", hashlib.sha256).digest()

    def _proof(self, secret: bytes, session_id: str, gossip: str) -> str:
        data = b"otela-tier\0" + session_id.encode() + b"\0" + gossip.encode()
        return hmac.new(secret, data, hashlib.sha256).hexdigest()

    def proof(self, session_id: str, gossip: str) -> str:
        """An ingress session's "tier" field: proof to other ingresses that it holds the secret."""
        return self._proof(self.secrets[0], session_id, gossip)

    def proven(self, session_id: str, record: Dict[str, Any]) -> bool:
        """Whether a session record is an ingress's, as proven by its "tier" field."""
        tier = record.get("tier")
        if record.get("role") != "ingress" or not isinstance(tier, str):
            return False
        gossip = str(record.get("gossip", ""))
        return any(hmac.compare_digest(self._proof(s, session_id, gossip), tier) for s in self.secrets)


# =============================================================================================
# Records bound to their writers, and grants
# =============================================================================================
# The cluster key admits a member; it must not let one member speak for another. Every record a
# session writes itself (JOIN, SERVING, its own DOWN or LEFT) carries "bind", an HMAC of its
# session id and the rest of the record, under a key its writer holds and a compute job cannot
# derive from the cluster key:
#   - a worker started with a grant: the grant's key. The login node, which holds the ingress
#     secret, issues each job a grant (a statement of the models and labels it may serve, its
#     Slurm job id and its end, signed by that secret: "mac") and gives the job alone the grant's
#     key, HMAC(ingress secret, grant id). Every ingress derives the key from the grant in the
#     record; no other job can, and no job can widen its grant (the mac covers it).
#   - an ingress: a key every ingress derives from the ingress secret (and nobody else can).
#   - a worker without a grant: a random key of its own process, which only it can check; an
#     ingress routes nothing to such a session (otela_ingress.py, "grants").
# Who checks (`Binder`, handed to the map): the owner (a record of its own session that it did not
# write is refused, "forged_own": an owner never adopts a field it did not write), and every
# ingress (a record whose grant or binding fails, or that drops the binding its session's record
# had: "grant", "bind", "unbound"). A worker holds no secret to check with and carries what it
# gets: workers act on records only for gossip, and the map that routes, an ingress's, holds only
# records that verified. An eviction (evicted_by) is another member's write and carries its
# evidence instead (see "The end of a session").
GRANT_ID_HEX = 32
MAX_JOB_ID = 64
_GRANT_ID = re.compile(r"^[0-9a-f]{32}$")
_REVOCATION = re.compile(r"^rev:([0-9a-f]{32}|job-[0-9A-Za-z_.-]{1,64})$")
MAX_REVOCATIONS = 20_000      # revoked grants and jobs held at once: years of a site's revocations
                              # at a few a day, ~3 MB at worst


def _check_binding(where: str, record: Dict[str, Any]) -> None:
    if "bind" in record and not (isinstance(record["bind"], str) and _SIG.match(record["bind"])):
        raise RecordError(f"{where}: bind must be {SIG_LEN} hex digits")
    if "grant" in record:
        check_grant(record["grant"], f"{where}: grant")


def check_grant(grant: Any, where: str = "grant") -> None:
    """The shape of a grant (its mac is checked by `Authority.grant_key`). Raises RecordError."""
    if not isinstance(grant, dict):
        raise RecordError(f"{where} must be an object")
    if not isinstance(grant.get("id"), str) or not _GRANT_ID.match(grant["id"]):
        raise RecordError(f"{where}: id must be {GRANT_ID_HEX} hex digits")
    _check_names(where, "models", grant.get("models"), f"{where}: model name", least=1)
    _check_labels(where, grant.get("labels", {}), f"{where}: ")
    job = grant.get("job", "")
    if not isinstance(job, str) or len(job) > MAX_JOB_ID:
        raise RecordError(f"{where}: job must be a string of at most {MAX_JOB_ID} characters")
    for field in ("issued", "until"):
        if not _is_number(grant.get(field)):
            raise RecordError(f"{where}: {field} must be a finite number (unix time)")
    for field in ("mac", "tls"):   # tls: the sha256 of the job's own tunnel certificate
        if field in grant and not (isinstance(grant[field], str) and _SIG.match(grant[field])):
            raise RecordError(f"{where}: {field} must be {SIG_LEN} hex digits")


def _bind_tag(key: bytes, session_id: str, record: Dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "bind"}
    return hmac.new(key, b"otela-bind\0" + session_id.encode() + b"\0" + encode(body),
                    hashlib.sha256).hexdigest()


def bound(key: bytes, session_id: str, record: Dict[str, Any]) -> Dict[str, Any]:
    """The record with its binding under `key` (the owner's write)."""
    out = {k: v for k, v in record.items() if k != "bind"}
    out["bind"] = _bind_tag(key, session_id, out)
    return out


def is_bound(key: bytes, session_id: str, record: Dict[str, Any]) -> bool:
    bind = record.get("bind")
    return isinstance(bind, str) and hmac.compare_digest(_bind_tag(key, session_id, record), bind)


class Binder:
    """Checks session records against their writers as they arrive (GMap.binder). `own`: the
    binding key of each session this process owns; `authority`: the ingress tier's secrets, on
    an ingress (None on a worker, which checks only its own session)."""

    def __init__(self, authority: Optional[Authority] = None):
        self.authority = authority
        self.own: Dict[str, bytes] = {}

    def refusal(self, session_id: str, record: Dict[str, Any], held: Optional[Dict[str, Any]]) -> Optional[str]:
        """Why `record` must not replace `held` here, or None."""
        if record["state"] not in OWNER_ONLY and "unseal" not in record:
            return None                             # an eviction: its evidence speaks for it
        key = self.own.get(session_id)
        if key is not None:
            return None if is_bound(key, session_id, record) else "forged_own"
        if self.authority is None:
            return None
        keys = self.authority.binding_keys(session_id, record)
        if keys is None:
            return "grant"
        if keys:
            return None if any(is_bound(k, session_id, record) for k in keys) else "bind"
        if held is not None and self.authority.binding_keys(session_id, held):
            return "unbound"                        # a bound session stays bound
        return None                                 # ungranted (or a release before bindings)


def revocation_entry(target: str) -> str:
    """The map id revoking a grant (its id) or every grant of a Slurm job ("job-<id>")."""
    entry_id = REVOCATION_ENTRY + target
    if not _REVOCATION.match(entry_id):
        raise RecordError(f"cannot revoke {target!r}: a grant id ({GRANT_ID_HEX} hex digits) "
                          "or job-<Slurm job id>")
    return entry_id


def validate_revocation(entry_id: str, record: Any) -> bytes:
    if not _REVOCATION.match(entry_id):
        raise RecordError(f"bad revocation {entry_id!r}: 'rev:' and a grant id or job-<id>")
    _check_object(entry_id, record)
    _check_fields(entry_id, record, (), ("state", "version", "at", "sig"))
    _check_count(entry_id, "state", record.get("state"))
    _check_count(entry_id, "version", record.get("version"))
    if not _is_number(record.get("at")):
        raise RecordError(f"{entry_id}: at must be a finite number (unix time)")
    _check_sig(entry_id, record)
    return _encode_checked(entry_id, record)


def grant_refusal(grant: Any, revoked_ids: Container[str], now: float) -> Optional[str]:
    """Why a verified grant serves nothing now ("expired", "revoked"), or None."""
    if now >= grant["until"]:
        return "expired"
    if grant["id"] in revoked_ids or ("job-" + grant.get("job", "")) in revoked_ids:
        return "revoked"
    return None


def _encode_checked(entry_id: str, record: Dict[str, Any]) -> bytes:
    try:
        encoded = encode(record)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"{entry_id}: not encodable: {exc}") from None
    if len(encoded) > MAX_RECORD_BYTES:
        raise RecordError(f"{entry_id}: record is {len(encoded)} bytes, over {MAX_RECORD_BYTES}")
    return encoded


# The validator of each kind of entry but sessions (validate's own)
_VALIDATORS = {KEY: validate_key, USAGE: validate_usage, REVOCATION: validate_revocation, UNKNOWN: validate_unknown,
               LIMIT: validate_limit, FLOW: validate_flow}


# =============================================================================================
# The map
# =============================================================================================
def time_day(ts: float) -> str:
    """The UTC day (YYYY-MM-DD) of a unix time: the G-Counters' day."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))   # pure: a conversion, not a clock read


def _entry_hash(session_id: str, encoded: bytes) -> int:
    digest = hashlib.blake2b(session_id.encode() + b"\0" + encoded, digest_size=16).digest()
    return int.from_bytes(digest, "big")


def _bucket(session_id: str) -> int:
    return hashlib.blake2b(session_id.encode(), digest_size=1).digest()[0]


class _Entry:
    __slots__ = ("record", "state", "version", "hash", "bucket", "plane", "size")

    def __init__(self, record: Dict[str, Any], encoded: bytes, session_id: str, bucket: int, plane: str):
        self.record = record
        self.size = len(encoded)
        self.state = record["state"]
        self.version = record["version"]
        self.hash = _entry_hash(session_id, encoded)
        self.bucket = bucket
        self.plane = plane


class _Hashes:
    """The XOR of entry hashes, per bucket and in all: a plane's (or the map's) digest, kept
    up to date in O(1) per change."""
    __slots__ = ("root", "buckets")

    def __init__(self):
        self.root = 0
        self.buckets = [0] * BUCKETS

    def flip(self, entry: _Entry) -> None:
        self.buckets[entry.bucket] ^= entry.hash
        self.root ^= entry.hash


def _key_ended(record: Dict[str, Any]) -> float:
    """When a key stopped working for good (revoked, or expired), or +inf while it works."""
    if record["state"] == KEY_REVOKED:
        return record.get("revoked_at", 0.0)
    return record.get("expires", math.inf)


def _wins(new: Dict[str, Any], new_encoded: bytes, old: _Entry) -> bool:
    """The lattice order: state, then the owner's version, then the canonical encoding."""
    if new["state"] != old.state:
        return new["state"] > old.state
    if new["version"] != old.version:
        return new["version"] > old.version
    return new_encoded > encode(old.record)   # rare: two members evicting the same session


def _same(session_id: str, encoded: bytes, old: _Entry) -> bool:
    return old.hash == _entry_hash(session_id, encoded)


# The kinds held only up to a count (new ids past it refused, counted under that name)
_FULL = {UNKNOWN: (MAX_UNKNOWN, "unknown_full"), REVOCATION: (MAX_REVOCATIONS, "revocations_full"),
         LIMIT: (MAX_LIMITS, "limits_full"), FLOW: (MAX_FLOWS, "flows_full")}

Entries = Union[Dict[str, Dict[str, Any]], Iterable[Tuple[str, Dict[str, Any]]]]


class GMap:
    """Grow-only map id -> record (sessions, keys, usage slots); merge is commutative,
    associative, idempotent."""

    def __init__(self, retention: float = RETENTION_S, usage_days: int = USAGE_RETENTION_DAYS,
                 planes: Iterable[str] = PLANES, usage_months: int = USAGE_RETENTION_MONTHS):
        self.retention = float(retention)
        self.usage_days = int(usage_days)
        self.usage_months = int(usage_months)
        self.planes = frozenset(planes)          # what this replica holds (workers: ROUTING)
        self._entries: Dict[str, _Entry] = {}
        self._by_kind: Dict[str, Dict[str, _Entry]] = {kind: {} for kind in PLANE_OF}
        self._usage_by_day: Dict[str, set] = {}  # period -> its usage entry ids: retention pops them
        self._session_bytes = 0                  # encoded bytes of the session records held
        self._all = _Hashes()
        self._hashes = {plane: _Hashes() for plane in PLANES}
        self._forgotten: Dict[str, float] = {}   # compacted id -> when (a session's compaction,
                                                 # a key's end): refused while remembered
        self._horizon = -math.inf                # LEFT records older than this are refused
        self._usage_horizon = ("", "")           # usage slots of periods before these (oldest day
                                                 # and month kept) are refused
        self._key_horizon = -math.inf            # keys revoked or expired before this are refused
        self._flow_horizon = -math.inf           # flows published before this are refused
        self.refused: collections.Counter = collections.Counter()   # entries not applied, by why
        self.binder: Optional[Binder] = None     # checks session records against their writers
        self.key_subject: Optional[Callable[[str], str]] = None   # a key's hash -> the subject of
                                                 # its settings (an ingress's: compacted with it)
        self._key_settings = 0                   # "lim:k-" entries held (MAX_KEY_SETTINGS)

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def get(self, session_id: str) -> Optional[Dict[str, Any]]:
        entry = self._entries.get(session_id)
        return dict(entry.record) if entry else None

    def items(self) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """Every session record, read-only: callers must not mutate them."""
        return ((sid, entry.record) for sid, entry in self._by_kind[SESSION].items())

    def all_items(self) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """Every entry of every kind (what a joining replica is sent), read-only."""
        return ((eid, entry.record) for eid, entry in self._entries.items())

    def key_records(self) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """(sha256 of the token, record) for every key, revoked ones included; read-only."""
        return ((eid[len(KEY_ENTRY):], e.record) for eid, e in self._by_kind[KEY].items())

    def usage_records(self) -> Iterator[Dict[str, Any]]:
        """Every usage slot's record, read-only."""
        return (e.record for e in self._by_kind[USAGE].values())

    def plane_items(self, plane: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """Every entry of one plane, read-only."""
        return ((eid, e.record) for eid, e in self._entries.items() if e.plane == plane)

    def size_of(self, entry_id: str) -> int:
        """Bytes of an entry's canonical encoding (kept from its validation: no encoding again)."""
        return self._entries[entry_id].size

    def plane_size(self, plane: str) -> int:
        if plane == ROUTING:
            return len(self._by_kind[SESSION]) + len(self._by_kind[UNKNOWN])
        return len(self._by_kind[KEY]) + len(self._by_kind[USAGE]) + len(self._by_kind[REVOCATION])

    def live(self) -> Dict[str, Dict[str, Any]]:
        """Sessions in JOIN or SERVING."""
        return {sid: e.record for sid, e in self._by_kind[SESSION].items() if e.state <= SERVING}

    # -- writing ---------------------------------------------------------------------------
    def put(self, session_id: str, record: Dict[str, Any], writer: Optional[str] = None) -> bool:
        """Write one record as `writer` (default: the session's owner). True if it changed."""
        encoded = validate(session_id, record)
        kind = kind_of(session_id)
        if kind == USAGE and writer is not None and writer != record["slot"]:
            raise RecordError(f"{session_id}: only session {record['slot']} writes its usage slot")
        if kind == SESSION and writer is not None and writer != session_id:
            if record["state"] in OWNER_ONLY:
                raise RecordError(f"session {session_id}: only its owner writes "
                                  f"{STATE_NAMES[record['state']]}, not {writer}")
            if record.get("evicted_by") != writer:
                raise RecordError(f"session {session_id}: an eviction by {writer} must set "
                                  f"evicted_by={writer!r}")
        return self._apply(session_id, dict(record), encoded)

    def merge(self, entries: Entries, joining: Iterable[str] = ()) -> List[str]:
        """Lattice join with records from a peer. Returns the session ids that changed.
        Validates everything first: one bad record rejects the whole batch untouched.
        `joining`: sessions that asked to join here themselves; past the cap they still get in, up
        to twice it (a flood of forged sessions gossiped in must not lock real joiners out)."""
        pairs = list(entries.items()) if isinstance(entries, dict) else list(entries)
        checked = []
        room = MAX_SESSIONS - len(self._by_kind[SESSION])
        room_bytes = MAX_SESSION_BYTES - self._session_bytes
        joining = set(joining)
        extra = (MAX_SESSIONS, MAX_SESSION_BYTES)   # a joiner's own record: room up to twice the caps
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise RecordError("merge takes {session_id: record} or (session_id, record) pairs")
            session_id, record = pair
            known = self._entries.get(session_id) if isinstance(session_id, str) else None
            if known is not None and record == known.record:
                continue        # a duplicate (most of gossip): valid and changes nothing
            encoded = validate(session_id, record)
            if known is None and ":" not in session_id:   # a session (validated above)
                more, more_bytes = extra if session_id in joining else (0, 0)
                if room + more <= 0 or room_bytes + more_bytes < len(encoded):
                    self.refused["sessions_full"] += 1
                    continue
                room -= 1
                room_bytes -= len(encoded)
            checked.append((session_id, record, encoded))
        return [sid for sid, record, encoded in checked
                if self._apply(sid, dict(record), encoded)]

    def _apply(self, session_id: str, record: Dict[str, Any], encoded: bytes) -> bool:
        kind = kind_of(session_id)
        old = self._entries.get(session_id)
        why = self._refusal(session_id, kind, record, encoded, old)
        if why is not None:
            if why:
                self.refused[why] += 1
            return False
        plane = PLANE_OF[kind]
        new = _Entry(record, encoded, session_id, old.bucket if old is not None else _bucket(session_id), plane)
        if old is not None:
            self._unhash(old)
        elif kind == USAGE:
            self._usage_by_day.setdefault(record["day"], set()).add(session_id)
        self._entries[session_id] = new
        self._by_kind[kind][session_id] = new
        if old is None and kind == LIMIT and session_id.startswith(KEY_SETTINGS_ENTRY):
            self._key_settings += 1
        if kind == SESSION:
            self._session_bytes += new.size - (old.size if old is not None else 0)
        self._all.flip(new)
        self._hashes[plane].flip(new)
        return True

    def _refusal(self, session_id: str, kind: str, record: Dict[str, Any], encoded: bytes,
                 old: Optional[_Entry]) -> Optional[str]:
        """Why `record` is not applied: a `refused` count's name, "" where nothing is counted
        (forgotten, past a horizon, not newer than what is held), None when it is applied."""
        if session_id in self._forgotten:
            return ""
        if PLANE_OF[kind] not in self.planes:
            return "plane"                       # not ours to hold (a worker: keys and usage)
        if self._past_horizon(kind, record):
            return ""
        if old is not None and (_same(session_id, encoded, old) or not _wins(record, encoded, old)):
            return ""      # the common gossip case, a duplicate, costs one hash
        if kind == SESSION:
            held = old.record if old is not None else None
            why = ending_refused(held, record) if record["state"] >= DOWN or old is not None else None
            if why is None and self.binder is not None:
                why = self.binder.refusal(session_id, record, held)
            return why
        if old is not None:
            return None
        cap, why = _FULL.get(kind, (math.inf, None))
        held = len(self._by_kind[kind])
        if kind == LIMIT:   # keys' settings and users' and models' limits, each under its own cap
            if session_id.startswith(KEY_SETTINGS_ENTRY):
                cap, why, held = MAX_KEY_SETTINGS, "key_settings_full", self._key_settings
            else:
                held -= self._key_settings
        return why if held >= cap else None

    def _past_horizon(self, kind: str, record: Dict[str, Any]) -> bool:
        """A LEFT session, usage period or ended key that compaction has already dropped."""
        if kind == SESSION:
            return record["state"] == LEFT and record["left_at"] < self._horizon
        if kind == USAGE:
            return not usage_kept(record["day"], *self._usage_horizon)
        if kind == FLOW:
            return record["at"] < self._flow_horizon
        return kind == KEY and _key_ended(record) < self._key_horizon

    def _unhash(self, entry: _Entry) -> None:
        self._all.flip(entry)
        self._hashes[entry.plane].flip(entry)

    def _drop(self, entry_id: str, kind: str) -> _Entry:
        entry = self._entries.pop(entry_id)
        del self._by_kind[kind][entry_id]
        if kind == LIMIT and entry_id.startswith(KEY_SETTINGS_ENTRY):
            self._key_settings -= 1
        if kind == SESSION:
            self._session_bytes -= entry.size
        self._unhash(entry)
        return entry

    def compact(self, now: float) -> int:
        """Drop LEFT records older than the retention; refuse them if they come back."""
        self._horizon = now - self.retention
        old = [sid for sid, e in self._by_kind[SESSION].items()
               if e.state == LEFT and e.record["left_at"] < self._horizon]
        for sid in old:
            self._drop(sid, SESSION)
            self._forgotten[sid] = now              # remembered FORGET_S from now
        # Usage slots of periods past the map's usage retention: no budget counts them any more
        # (a period at a time: the sweep never scans the slots that stay).
        self._usage_horizon = usage_horizons(now, self.usage_days, self.usage_months)
        stale = []
        for day in [d for d in self._usage_by_day if not usage_kept(d, *self._usage_horizon)]:
            for eid in self._usage_by_day.pop(day):
                if eid in self._entries:
                    self._drop(eid, USAGE)
                    stale.append(eid)
        # Keys revoked or expired longer than KEY_RETENTION_S ago: compacted, their ids remembered
        # so that an older active copy held by a replica that was away cannot bring them back.
        # Their settings go with them, and are remembered alike (where this replica can name
        # their subject: an ingress, `key_subject`).
        self._key_horizon = now - KEY_RETENTION_S
        ended = [eid for eid, e in self._by_kind[KEY].items() if _key_ended(e.record) < self._key_horizon]
        for eid in list(ended):
            self._forgotten[eid] = when = _key_ended(self._drop(eid, KEY).record)
            settings = LIMIT_ENTRY + self.key_subject(eid[len(KEY_ENTRY):]) \
                if self.key_subject is not None else None
            if settings is not None:
                self._forgotten[settings] = when
                if settings in self._by_kind[LIMIT]:
                    self._drop(settings, LIMIT)
                    ended.append(settings)
        # Flows not renewed for FLOW_RETENTION_S: their ingress session is gone (a live one's is
        # renewed while it admits anything); an older copy is refused by its time alone.
        self._flow_horizon = now - FLOW_RETENTION_S
        quiet = [eid for eid, e in self._by_kind[FLOW].items() if e.record["at"] < self._flow_horizon]
        for eid in quiet:
            self._drop(eid, FLOW)
        old += stale + ended + quiet
        # Forgotten ids are remembered (about 100 bytes each) so that a stale JOIN or SERVING
        # copy from a long partition cannot resurrect them: sessions' for FORGET_S, keys' for as
        # long as the cap allows; past the cap the oldest go first.
        for sid in [sid for sid, t in self._forgotten.items() if t < now - FORGET_S and ":" not in sid]:
            del self._forgotten[sid]
        if len(self._forgotten) > MAX_FORGOTTEN:
            for sid in sorted(self._forgotten, key=self._forgotten.get)[:-MAX_FORGOTTEN]:
                del self._forgotten[sid]
        return len(old)

    # -- anti-entropy ----------------------------------------------------------------------
    # Every call below takes a plane: None for the whole map, ROUTING or INGRESS for the entries
    # of that plane only (what a worker and an ingress, or two ingresses, have in common).
    def _plane_hashes(self, plane: Optional[str]) -> _Hashes:
        return self._all if plane is None else self._hashes[plane]

    def _plane_entries(self, plane: Optional[str]) -> Iterator[Tuple[str, _Entry]]:
        if plane is None:
            return iter(self._entries.items())
        return ((eid, e) for eid, e in self._entries.items() if e.plane == plane)

    def digest(self, buckets: bool = False, plane: Optional[str] = None) -> Dict[str, Any]:
        """A small summary. Equal roots mean equal maps (up to a 128-bit hash collision)."""
        hashes = self._plane_hashes(plane)
        n = len(self._entries) if plane is None else self.plane_size(plane)
        summary: Dict[str, Any] = {"n": n, "root": f"{hashes.root:032x}"}
        if buckets:
            # 32 bits a bucket keeps this near 3 KB; a bucket collision is caught by the root
            summary["b"] = {str(i): f"{h & 0xFFFFFFFF:08x}" for i, h in enumerate(hashes.buckets) if h}
        return summary

    def summary(self, bucket_ids: Iterable[Union[int, str]], plane: Optional[str] = None) -> Dict[str, Any]:
        """Per-entry (state, version, hash) for the given buckets: the precise round of diff."""
        wanted = {int(b) for b in bucket_ids}
        return {"bk": sorted(wanted),
                "s": {sid: [e.state, e.version, f"{e.hash:032x}"[:16]]
                      for sid, e in self._plane_entries(plane) if e.bucket in wanted}}

    def differing_buckets(self, remote_digest: Dict[str, Any], plane: Optional[str] = None) -> List[int]:
        """Bucket ids where a remote bucket digest differs from ours (either side non-empty)."""
        theirs = remote_digest.get("b", {})
        ours = self.digest(buckets=True, plane=plane)["b"]
        differing = sorted(int(b) for b in set(ours) | set(theirs) if ours.get(b) != theirs.get(b))
        if not differing and remote_digest.get("root") != f"{self._plane_hashes(plane).root:032x}":
            return list(range(BUCKETS))      # roots differ but buckets collide: compare all
        return differing

    def diff(self, remote_digest: Dict[str, Any], plane: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        """The records the remote lacks or holds older, judged from what its digest tells."""
        if remote_digest.get("root") == f"{self._plane_hashes(plane).root:032x}" and "s" not in remote_digest:
            return {}
        if "s" in remote_digest:
            theirs = remote_digest["s"]
            covered = {int(b) for b in remote_digest.get("bk", range(BUCKETS))}
            out = {}
            for sid, e in self._plane_entries(plane):
                if e.bucket not in covered:
                    continue
                remote = theirs.get(sid)
                if (remote is None or (remote[0], remote[1]) < (e.state, e.version)
                        or ((remote[0], remote[1]) == (e.state, e.version)
                            and remote[2] != f"{e.hash:032x}"[:16])):
                    out[sid] = e.record
            return out
        if "b" in remote_digest:
            differing = set(self.differing_buckets(remote_digest, plane))
            return {sid: e.record for sid, e in self._plane_entries(plane) if e.bucket in differing}
        return {sid: e.record for sid, e in self._plane_entries(plane)}


# =============================================================================================
# Settings: one way every otela file reads them
# =============================================================================================
# A setting is its flag, else its OTELA_<NAME> variable, else the default. The reader lives here
# because this is the one file every role carries (the node and the ingress with otela_node.py,
# the simulator and the placer without it), and it is pure like the rest of this file: the
# environment comes in as an argument (`env`, os.environ at the call sites), so a test hands it
# a dict and nothing reads the process's variables behind its back.
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off", "")


def env_value(name: str, kind: Any, env: Mapping[str, str]) -> Any:
    """OTELA_<NAME> read as `kind` (a type or an argparse type function), or None when it is not
    set. A boolean is 1/true/yes/on or 0/false/no/off (any case; empty is false): anything else,
    like a value `kind` refuses, is a ValueError that names the variable, on one line. A setting
    that might mean the opposite is never guessed. `env`: the variables (os.environ)."""
    raw = env.get("OTELA_" + name)
    if raw is None:
        return None
    if kind is bool:
        if raw.strip().lower() not in _TRUE_WORDS + _FALSE_WORDS:
            raise ValueError(f"OTELA_{name}={raw!r} is not a boolean: use 1/true/yes/on or 0/false/no/off")
        return raw.strip().lower() in _TRUE_WORDS
    try:
        return kind(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"OTELA_{name}={raw!r}: {exc or 'not a valid value'}") from None


def parse_settings(parser: argparse.ArgumentParser, argv: Optional[List[str]], names: Optional[Dict[str, Any]],
                   env: Mapping[str, str]) -> argparse.Namespace:
    """parser.parse_args(argv), every flag (of every subcommand) defaulting to its variable:
    --from-ingress reads OTELA_FROM_INGRESS, as the flag reads its value (type and choices); a
    switch's variable is a boolean (env_value), and a repeatable flag's holds its values separated
    by "," (a flag given replaces them). `names` maps a flag to (variable name, separator) where
    they differ (separator None: one value), or to None: no variable (a destructive one-shot
    switch such as keygen's --force). ValueError for a variable the flag would refuse."""
    names, repeated = names or {}, []
    for action in _options(parser):
        flag = action.option_strings[-1]
        if flag in names and names[flag] is None:
            continue
        name, sep = names.get(flag, (flag.lstrip("-").replace("-", "_").upper(), ","))
        value = _variable(action, name, sep, env)
        if value is None:
            continue
        action.required = False
        if action.nargs == 0:   # a switch: true is as if it were given
            action.default = action.const if value else not action.const
        elif isinstance(action, argparse._AppendAction):
            repeated.append((action, value))
        else:
            action.default = value
    args = parser.parse_args(argv)
    for action, values in repeated:
        if getattr(args, action.dest, None) is action.default:   # the flag was not given
            setattr(args, action.dest, values)
    return args


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every option of `parser` and of its subcommands, but --help and --version."""
    for action in parser._actions:
        if isinstance(action.choices, dict):   # the subcommands
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings and action.dest not in ("help", "version"):
            yield action


def _variable(action: argparse.Action, name: str, sep: Optional[str], env: Mapping[str, str]) -> Any:
    """OTELA_<name> read as `action` reads its flag's value (None: not set)."""
    convert = action.type or str
    if action.nargs == 0:
        return env_value(name, bool, env)
    if isinstance(action, argparse._AppendAction):
        def items(raw):
            return [convert(item.strip()) for item in ([raw] if sep is None else raw.split(sep)) if item.strip()]
        return env_value(name, items, env)
    value = env_value(name, convert, env)
    if value is not None and action.choices is not None and value not in action.choices:
        raise ValueError(f"OTELA_{name}={value!r}: expected one of {', '.join(map(str, action.choices))}")
    return value
