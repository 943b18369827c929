"""One way to read a setting in every role file: its flag, else its OTELA_* variable, else its
default; a boolean variable is 1/true/yes/on or 0/false/no/off and anything else is a one-line
error and a non-zero exit, never a silent False."""
from __future__ import annotations

import argparse
import inspect
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import crdt  # noqa: E402
import otela_ingress  # noqa: E402
import otela_node  # noqa: E402
import otela_place  # noqa: E402
import otela_sim  # noqa: E402

ROLE_FILES = {"otela_node.py": otela_node, "otela_ingress.py": otela_ingress, "otela_place.py": otela_place,
              "otela_sim.py": otela_sim, "crdt.py": crdt}


def test_the_reader_is_one_and_lives_in_the_file_every_role_carries():
    # otela_sim.py (and the placer with it) runs where otela_node.py is not copied, so the reader
    # is in crdt.py, which every role carries; no role file holds a reader of its own
    for module in (otela_node, otela_ingress, otela_place, otela_sim):
        for name in ("env_value", "parse_settings"):
            assert not hasattr(module, name), (module.__name__, name)


def test_the_reader_reads_only_the_environment_it_is_given(monkeypatch):
    monkeypatch.setenv("OTELA_TP", "8")
    assert crdt.env_value("TP", int, {}) is None
    assert crdt.env_value("TP", int, {"OTELA_TP": "2"}) == 2


@pytest.mark.parametrize("path", sorted(ROLE_FILES))
def test_no_role_file_reads_an_otela_variable_but_through_the_reader(path):
    source = inspect.getsource(ROLE_FILES[path])
    direct = re.findall(r".*(?:environ\.get|getenv|environ\[)\(?\s*[\"']OTELA_.*", source)
    assert direct == [], direct
    readers = re.findall(r'.*\.get\("OTELA_" \+ name\)', source)
    assert len(readers) == (1 if ROLE_FILES[path] is crdt else 0), readers


# file -> how its command line is parsed (its own parser, names and reader, as its main does),
# the arguments every case starts from, and settings: (flag, variable, default, a value given
# as the variable, another given as the flag, what the parsed field is called)
TABLE = {
    "otela_node.py": (
        lambda argv, env: crdt.parse_settings(otela_node.build_parser(), argv, otela_node.SETTING_NAMES, env),
        ["start", "--process", "engine"],
        [("--log-level", "LOG_LEVEL", "INFO", "DEBUG", "WARNING", "log_level"),
         ("--drain-timeout", "DRAIN_TIMEOUT", None, "12", "3", "drain_timeout"),
         ("--restart", "RESTART", False, "yes", None, "restart"),
         ("--label", "LABEL", None, "gpu=a100,site=x", "rack=7", "label")]),
    "otela_ingress.py": (
        lambda argv, env: crdt.parse_settings(otela_ingress.build_parser(), argv, otela_ingress.SETTING_NAMES, env),
        ["serve"],
        [("--policy", "POLICY", "ttft", "random", "round_robin", "policy"),
         ("--max-connections", "MAX_CONNECTIONS", otela_ingress.MAX_CONNECTIONS, "100", "7", "max_connections"),
         ("--head-timeout-s", "HEAD_TIMEOUT_S", otela_ingress.HEAD_TIMEOUT_S, "2.5", "1", "head_timeout_s"),
         ("--usage-days", "USAGE_DAYS", crdt.USAGE_RETENTION_DAYS, "20", "9", "usage_days"),
         ("--no-auth", "NO_AUTH", False, "on", None, "no_auth"),
         ("--alias", "ALIASES", [], "fast=a,b;big=c", "small=d", "alias")]),
    "otela_place.py": (
        lambda argv, env: crdt.parse_settings(otela_place.build_parser(), argv, None, env),
        ["plan"],
        [("--capacity", "CAPACITY", "auto", "sim", "measured", "capacity"),
         ("--cooldown", "COOLDOWN", otela_place.RECLAIM_COOLDOWN_S, "60", "5", "cooldown"),
         ("--submit", "SUBMIT", False, "1", None, "submit")]),
    "otela_sim.py": (
        lambda argv, env: crdt.parse_settings(otela_sim.build_parser(), argv, None, env),
        ["estimate", "--model", "llama-2-7b", "--gpu", "H100"],
        [("--tp", "TP", 1, "2", "4", "tp"),
         ("--dtype", "DTYPE", None, "fp8", "bf16", "dtype"),
         ("--json", "JSON", False, "true", None, "json")]),
}
CASES = [(path, setting) for path, (_, _, settings) in TABLE.items() for setting in settings]


def typed(value, default):
    """What a variable's text is once read as the flag reads it."""
    if value is None or isinstance(default, (bool, str)) or default is None:
        return value
    return type(default)(value)


@pytest.mark.parametrize("path, setting", CASES, ids=[f"{p} {s[0]}" for p, s in CASES])
def test_a_setting_is_its_flag_else_its_variable_else_its_default(path, setting):
    parse, base, _ = TABLE[path]
    flag, name, default, from_env, from_flag, field = setting
    env = {"OTELA_" + name: from_env}
    switch = from_flag is None
    assert getattr(parse(base, {}), field) == default
    got = getattr(parse(base, env), field)
    if switch:
        assert got is True
        assert getattr(parse(base, {"OTELA_" + name: "off"}), field) is False
        assert getattr(parse(base + [flag], {"OTELA_" + name: "0"}), field) is True   # the flag wins
        return
    flag_args = [flag, from_flag]
    if flag == "--alias":   # a repeatable flag: its variable holds several, the flag given replaces them
        assert got == [("fast", ["a", "b"]), ("big", ["c"])]
        assert getattr(parse(base + flag_args, env), field) == [("small", ["d"])]
        return
    if flag == "--label":
        assert got == ["gpu=a100", "site=x"]
        assert getattr(parse(base + flag_args, env), field) == ["rack=7"]
        return
    assert got == (typed(from_env, default) if default is not None else
                   (float(from_env) if flag == "--drain-timeout" else from_env))
    assert getattr(parse(base + flag_args, env), field) == \
        (typed(from_flag, default) if default is not None else
         (float(from_flag) if flag == "--drain-timeout" else from_flag))


@pytest.mark.parametrize("path, setting", [c for c in CASES if c[1][4] is None], ids=lambda c: str(c))
def test_a_boolean_variable_that_is_not_one_is_refused_naming_it(path, setting):
    parse, base, _ = TABLE[path]
    name = setting[1]
    with pytest.raises(ValueError, match=f"OTELA_{name}='maybe' is not a boolean"):
        parse(base, {"OTELA_" + name: "maybe"})


@pytest.mark.parametrize("path, argv, name", [
    ("otela_node.py", ["start", "--process", "engine"], "RESTART"),
    ("otela_ingress.py", ["serve"], "NO_AUTH"),
    ("otela_ingress.py", ["serve"], "REQUIRE_KEY_FOR_VIEWS"),
    ("otela_place.py", ["plan"], "SUBMIT"),
    ("otela_sim.py", ["estimate", "--model", "llama-2-7b", "--gpu", "H100"], "JSON"),
])
def test_maybe_is_a_one_line_error_and_a_nonzero_exit_in_every_file(path, argv, name, monkeypatch, capsys):
    monkeypatch.setenv("OTELA_" + name, "maybe")
    try:
        code = ROLE_FILES[path].main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code not in (0, None)
    assert len(err.splitlines()) == 1 and f"OTELA_{name}='maybe' is not a boolean" in err


def test_a_value_the_flag_would_refuse_is_refused_as_a_variable_naming_it():
    parse, base, _ = TABLE["otela_ingress.py"]
    with pytest.raises(ValueError, match="OTELA_MAX_CONNECTIONS='-1'"):
        parse(base, {"OTELA_MAX_CONNECTIONS": "-1"})
    parse, base, _ = TABLE["otela_place.py"]
    with pytest.raises(ValueError, match="OTELA_CAPACITY='foo': expected one of auto, measured, sim"):
        parse(base, {"OTELA_CAPACITY": "foo"})
    with pytest.raises(otela_node.ConfigError, match="OTELA_PROBE_TIMEOUT='soon'"):
        otela_node.config_from_env(otela_node.Config(), {"OTELA_PROBE_TIMEOUT": "soon"})


def test_keygens_force_is_the_flag_only_a_variable_never_replaces_a_key(tmp_path):
    import subprocess
    out = str(tmp_path)
    run = [sys.executable, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", out]
    subprocess.run(run, check=True, capture_output=True)
    before = open(os.path.join(out, "cluster.key"), "rb").read()
    again = subprocess.run(run, capture_output=True, text=True, env=dict(os.environ, OTELA_FORCE="1"))
    assert again.returncode != 0 and "--force" in again.stderr
    assert open(os.path.join(out, "cluster.key"), "rb").read() == before


def test_the_ingress_limits_are_one_object_built_from_the_flags_and_no_module_constant_changes():
    args = crdt.parse_settings(otela_ingress.build_parser(), ["serve", "--max-connections", "7"],
                               otela_ingress.SETTING_NAMES, {"OTELA_HEAD_TIMEOUT_S": "2.5"})
    limits = otela_ingress.Limits.from_args(args)
    assert (limits.max_connections, limits.head_timeout_s) == (7, 2.5)
    assert limits.max_body_bytes == otela_ingress.MAX_BODY_BYTES   # the rest: their defaults
    assert (otela_ingress.MAX_CONNECTIONS, otela_ingress.HEAD_TIMEOUT_S) == (4096, 10.0)   # untouched
    assert limits.per_address() == 7   # the floor (64) above the cap: the cap
    with pytest.raises(TypeError, match="unknown limits: max_conections"):
        otela_ingress.Limits(max_conections=7)


UNITS = ("second", "byte", "token", "connection", "request", "share", "GPU", "day", "month", " h)",
         "iteration", "batch", "seed", "session", "failure", "GB/s", "instance", "fraction", "times",
         "ratio", "block", "coefficient", "stage", "capacity/demand")


def _flags(parser, path):
    for action in parser._actions:
        if isinstance(action.choices, dict):   # the subcommands
            for name, sub in action.choices.items():
                yield from _flags(sub, path + [name])
        elif action.option_strings and action.dest not in ("help", "version"):
            yield " ".join(path + [action.option_strings[-1]]), action


@pytest.mark.parametrize("module", [otela_node, otela_ingress, otela_place, otela_sim], ids=lambda m: m.__name__)
def test_every_flag_says_what_it_is_and_a_number_its_unit(module):
    """A user reads --help on a cluster with no other documentation: every flag has a help line,
    and one whose value is a number says in what (seconds, bytes, tokens, a share...)."""
    silent, unitless = [], []
    for flag, action in _flags(module.build_parser(), [module.__name__]):
        text = action.help or ""
        if not text.strip() or text == argparse.SUPPRESS:
            silent.append(flag)
        elif isinstance(action.default, (int, float)) and not isinstance(action.default, bool) \
                and not any(unit in text for unit in UNITS):
            unitless.append(f"{flag}: {text}")
    assert not silent and not unitless, (silent, unitless)
