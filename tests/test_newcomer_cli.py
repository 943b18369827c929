"""What a newcomer meets on the command line and the admin API (issue 30): one clear line and a
non-zero exit for a missing h11, a typo'd bootstrap, a port in use, a --db that is not there;
"joined" only once a member answered; a ledger that recovers from a read-only database by
itself; one answer shape for a new key; values the registry would refuse refused up front;
and the views (/v1/registry, /metrics, /dashboard, /v1/usage/stats) behind a key on request."""
from __future__ import annotations

import base64
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from test_ingress_support import Client

import crdt
import otela_ingress
import otela_node

NODE = str(ROOT / "otela_node.py")
INGRESS = str(ROOT / "otela_ingress.py")
FAKE_ENGINE = ROOT / "tests" / "fake_engine.py"


def run(argv, timeout=30, env=None):
    env = dict(os.environ, **(env or {}))
    for name in ("OTELA_BOOTSTRAP", "OTELA_DB", "OTELA_KEY_FILE"):
        env.pop(name, None)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture
def key_file(tmp_path):
    return otela_node.keygen(str(tmp_path / "keys"))[0]


# -- a Python without h11 ------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["otela_node.py", "otela_ingress.py"])
def test_a_python_without_h11_gets_one_line_saying_how_to_get_it_and_exit_1(tmp_path, script):
    # as a bare system Python: importing h11 fails (sys.modules[name] = None makes it so)
    code = ("import runpy, sys; sys.modules['h11'] = None; sys.argv = [sys.argv[1], 'keygen', '--out', sys.argv[2]]; "
            "sys.path.insert(0, '.'); runpy.run_path(sys.argv[0], run_name='__main__')")
    done = run([sys.executable, "-c", code, script, str(tmp_path / "k")])
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith(f"{script}: ") and "h11" in lines[0] and "PYTHONPATH" in lines[0]
    assert ".venv/bin/python" in lines[0] and "pip install --user h11" in lines[0]
    assert not (tmp_path / "k").exists()


# -- bootstrap: a typo is an error; "joined" only once someone answered -----------------------------
@pytest.mark.parametrize("bad", ["foo", "login1", "login1:port", "a:1,foo"])
def test_an_unparseable_bootstrap_is_a_config_error(bad):
    with pytest.raises(otela_node.ConfigError, match="bad --bootstrap"):
        otela_node.check_bootstrap([bad])


def test_a_bootstrap_of_addresses_urls_or_an_existing_file_is_accepted(tmp_path):
    listing = tmp_path / "peers.txt"
    listing.write_text("10.0.0.1:7946\n")
    otela_node.check_bootstrap(["login1:7946,10.0.0.2:7946", "[::1]:7946", "https://x.example/peers",
                                str(listing)])


@pytest.mark.parametrize("argv", [
    [NODE, "start", "--process", "sleep 60"],
    [INGRESS, "serve", "--listen", "127.0.0.1:0", "--gossip", "127.0.0.1:0", "--db", "{tmp}/i.sqlite"],
])
def test_node_and_ingress_refuse_a_typo_in_bootstrap_with_one_line_and_exit_2(key_file, tmp_path, argv):
    done = run([sys.executable] + [a.format(tmp=tmp_path) for a in argv] +
               ["--key-file", key_file, "--bootstrap", "foo"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0
    assert "bad --bootstrap 'foo': expected HOST:PORT" in done.stderr


def test_a_node_says_joined_only_once_a_member_answered(key_file, tmp_path):
    from fake_engine import free_port_pair
    silent = f"127.0.0.1:{free_port_pair()}"   # nobody there, until the second node binds it
    engine = f"{sys.executable} {FAKE_ENGINE} --port {{port}}"
    env = dict(os.environ, OTELA_LOG_LEVEL="INFO", OTELA_JOIN_WARN_AFTER="0.5")
    env.pop("OTELA_BOOTSTRAP", None)

    def node(log, gossip, *bootstrap):
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, NODE, "start", "--key-file", key_file, "--gossip", gossip,
                                     "--listen", f"127.0.0.1:{free_port_pair()}", "--process", engine, *bootstrap],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def until(log, text):
        deadline = time.monotonic() + 20
        while text not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        return log.read_text()

    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    procs = [node(first_log, f"127.0.0.1:{free_port_pair()}", "--bootstrap", silent)]
    try:
        text = until(first_log, "has not answered")
        assert "joining through 1 bootstrap peers" in text and "has not answered" in text
        assert " joined" not in text
        procs.append(node(second_log, silent))   # the bootstrap comes up and answers
        assert "no bootstrap: the first member" in until(second_log, "first member")
        assert "joined the overlay (1 members besides it)" in until(first_log, "joined the overlay")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)


# -- bind before the engine ----------------------------------------------------------------------
def test_node_start_with_its_listen_port_in_use_fails_before_starting_the_engine(key_file, tmp_path):
    marker = tmp_path / "engine-started"
    engine = f"{sys.executable} -c \"open('{marker}', 'w'); import time; time.sleep(60)\" {{port}}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        from fake_engine import free_port_pair
        done = run([sys.executable, NODE, "start", "--key-file", key_file, "--gossip",
                    f"127.0.0.1:{free_port_pair()}", "--listen", f"127.0.0.1:{port}", "--process", engine,
                    "--engine-url", "http://127.0.0.1:1"])
    assert done.returncode == 1
    assert "address already in use" in done.stderr.lower()
    time.sleep(0.5)
    assert not marker.exists()


# -- --db ------------------------------------------------------------------------------------------
def test_a_ledger_in_a_missing_folder_names_the_db_path_not_its_lock_file(tmp_path):
    path = str(tmp_path / "nonexistent" / "x.sqlite")
    with pytest.raises(ValueError) as caught:
        otela_ingress.Ledger(path, lambda keys: None)
    assert str(caught.value).startswith(f"--db {path}: No such file or directory")
    assert ".lock" not in str(caught.value)


def test_serve_with_a_db_in_a_missing_folder_says_which_db_and_exits_2(key_file, tmp_path):
    path = str(tmp_path / "nonexistent" / "x.sqlite")
    done = run([sys.executable, INGRESS, "serve", "--key-file", key_file, "--listen", "127.0.0.1:0",
                "--gossip", "127.0.0.1:0", "--db", path])
    assert done.returncode == 2
    assert f"--db {path}" in done.stderr and ".lock" not in done.stderr


@pytest.mark.parametrize("argv", [["keys", "list"], ["keys", "list", "--json"], ["keys", "revoke", "abc"]])
def test_keys_commands_on_a_missing_db_are_an_error_and_create_nothing(tmp_path, argv):
    typo = tmp_path / "typo.sqlite"
    done = run([sys.executable, INGRESS] + argv + ["--db", str(typo)])
    assert done.returncode == 2
    assert done.stderr.strip() == (f"otela-ingress: --db {typo}: no such database (check the path or OTELA_DB; "
                                   "`keys create` makes one)")
    assert list(tmp_path.iterdir()) == []


def test_a_ledger_opened_read_only_recovers_by_itself_once_the_file_is_writable(tmp_path, monkeypatch):
    path = str(tmp_path / "ro.sqlite")
    otela_ingress.Ledger(path, lambda keys: None).close()   # the database exists
    writable = {"now": False}
    real_open = otela_ingress.open_db

    def open_db(p):   # what SQLite does with a file it may not write: a read-only connection
        if writable["now"]:
            return real_open(p)
        return sqlite3.connect(f"file:{p}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)

    monkeypatch.setattr(otela_ingress, "open_db", open_db)
    ledger = otela_ingress.Ledger(path, lambda keys: None)
    try:
        ledger.record((time.time(), "k", "user", "model", "s", "o", 200, 1, 2, 1.5, 0, 1, 1, "r1"))
        # and a key learned from another ingress, kept in SQLite by the same writer
        ledger.replicate(crdt.key_entry("ab" * 32), crdt.key_record("k1", "bob", time.time()))
        ledger.flush(2.0)
        time.sleep(0.6)   # a few more batches, each refused
        assert "readonly" in (ledger.error or "") and ledger.rows_written == 0 and ledger.failed_commits >= 2
        writable["now"] = True   # chmod u+w, a remount: nothing tells the ingress
        deadline = time.monotonic() + 5
        while ledger.rows_written == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ledger.error is None and ledger.rows_written == 1
        ledger.flush(2.0)
    finally:
        ledger.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*), sum(completion_tokens) FROM requests").fetchone() == (1, 2)
        assert conn.execute("SELECT id, user FROM keys").fetchall() == [("k1", "bob")]


# -- a new key: one shape, checked before it is handed out ----------------------------------------
KEY_FIELDS = {"object", "id", "key", "user", "created", "admin", "allow", "rate", "budget_day", "budget_month",
              "expires", "rpm", "tpm", "concurrency", "weight", "priority", "priorities", "sites"}


def test_the_admin_api_and_keys_create_json_answer_the_same_fields(stack, tmp_path):
    admin = stack.key(admin=True)
    status, _, body = Client(stack.url, admin).request("POST", "/v1/admin/keys", {"user": "dave", "budget_month": 7})
    assert status == 200
    made = json.loads(body)
    assert set(made) == KEY_FIELDS
    assert (made["admin"], made["allow"], made["budget_month"], made["budget_day"]) == (False, [], 7, 0)
    done = run([sys.executable, INGRESS, "keys", "create", "--user", "dave", "--budget-month", "7", "--json",
                "--db", str(tmp_path / "cli.sqlite")])
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert set(printed) == KEY_FIELDS
    assert {k: printed[k] for k in KEY_FIELDS - {"id", "key", "created"}} == \
        {k: made[k] for k in KEY_FIELDS - {"id", "key", "created"}}


REFUSED = [
    ({"user": "u" * 257}, "user is longer than 256 characters"),
    ({"user": "x", "allow": [f"p{i}" for i in range(65)]}, "allow must be a list of at most 64"),
    ({"user": "x", "budget_day": 2**53}, "budget_day must be below 2^53"),
    ({"user": "x", "budget_month": 2**60}, "budget_month must be below 2^53"),
    ({"user": "x", "expires": 1e300}, "expires must be before the year 10000"),
    ({"user": "x", "expires": "9" * 400 + "d"}, "expires must be before the year 10000"),
]


@pytest.mark.parametrize("spec, reason", REFUSED)
def test_the_admin_api_refuses_what_the_registry_would_refuse_with_400_and_the_reason(stack, spec, reason):
    admin = stack.key(admin=True)
    client = Client(stack.url, admin)
    status, _, body = client.request("POST", "/v1/admin/keys", spec)
    assert status == 400
    error = json.loads(body)["error"]
    assert reason in error["message"] and error["code"] == "invalid_parameter"
    listed = json.loads(client.request("GET", "/v1/admin/keys")[2])["data"]
    assert [k["user"] for k in listed] == ["alice"]   # only the admin's own key: nothing was made


def test_an_expiry_of_400_digits_is_a_400(stack):
    client = Client(stack.url, stack.key(admin=True))
    # orjson refuses a number this long as JSON; the standard library's reader parses it and
    # key_spec refuses it: 400 either way, and no key
    status, _, body = client.request("POST", "/v1/admin/keys", {"user": "x", "expires": int("9" * 400)})
    assert status == 400 and json.loads(body)["error"]["code"] in ("invalid_json", "invalid_parameter")


def test_keys_create_refuses_a_budget_the_registry_would_refuse_with_one_line(tmp_path):
    db = tmp_path / "k.sqlite"
    done = run([sys.executable, INGRESS, "keys", "create", "--user", "x", "--budget-day", str(2**53),
                "--db", str(db)])
    assert done.returncode == 2
    assert done.stderr.strip() == "otela-ingress: --budget-day must be below 2^53 tokens (0: none)"
    assert not db.exists()


# -- the views behind a key ------------------------------------------------------------------------
VIEWS = ["/v1/registry", "/metrics", "/dashboard", "/v1/usage/stats"]


@pytest.mark.parametrize("path", VIEWS)
def test_the_views_need_no_key_by_default(stack, path):
    assert Client(stack.url).request("GET", path)[0] == 200


@pytest.mark.parametrize("path", VIEWS)
def test_require_key_for_views_answers_them_only_to_a_valid_key(stack, path):
    stack.call(setattr, stack.ingress.views, "require_key", True)
    key = stack.key()
    status, headers, body = Client(stack.url).request("GET", path)
    assert status == 401 and json.loads(body)["error"]["code"] == "missing_api_key"
    assert ("www-authenticate" in headers) == (path == "/dashboard")   # a browser then asks for it
    assert Client(stack.url, "sk-otela-wrong").request("GET", path)[0] == 401
    assert Client(stack.url, key).request("GET", path)[0] == 200
    basic = base64.b64encode(f"anyone:{key}".encode()).decode()
    assert Client(stack.url).request("GET", path, headers={"Authorization": f"Basic {basic}"})[0] == 200
    assert Client(stack.url).request("GET", "/healthz")[0] == 200   # load balancers still probe it


def test_require_key_for_views_reads_its_env_variable_and_refuses_a_non_boolean(key_file, tmp_path):
    done = run([sys.executable, INGRESS, "serve", "--key-file", key_file, "--listen", "127.0.0.1:0",
                "--gossip", "127.0.0.1:0", "--db", str(tmp_path / "v.sqlite")],
               env={"OTELA_REQUIRE_KEY_FOR_VIEWS": "maybe"})
    assert done.returncode == 2
    assert "OTELA_REQUIRE_KEY_FOR_VIEWS='maybe' is not a boolean" in done.stderr
