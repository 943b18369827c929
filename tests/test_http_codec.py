"""The one HTTP/1.1 codec (otela_node: parse_request, parse_response, BodyReader) against h11.

Differential, both directions: requests as a server reads them, responses as a client reads them,
generated well-formed and then mutated (a byte changed, dropped or doubled). The rules:
  - what the codec accepts, h11 accepts, with the same method, target, status, reason, fields,
    body bytes and end of message;
  - what the codec refuses, h11 refuses too, or it breaks one of the rules where the codec is
    stricter on purpose (framing a proxy must refuse, a bare CR or LF, a control byte, an HTTP
    version other than 1.0/1.1, an oversized chunk size, obs-fold);
  - a request the codec leaves to h11 (H11_JUDGES) is h11's: nothing to compare.
"""
from __future__ import annotations

import re

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import otela_node as on
from otela_node import CHUNKED, H11_JUDGES, LENGTH, NO_BODY, UNTIL_CLOSE, BodyReader, HTTPViolation

EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- generators: messages as a peer would send them, then bent ------------------------------------
NAMES = [b"Host", b"content-length", b"Content-Length", b"transfer-encoding", b"Transfer-Encoding",
         b"connection", b"content-type", b"authorization", b"expect", b"upgrade", b"x-a", b"set-cookie"]
BAD_NAMES = [b"bad name", b"x:y", b"", b"x\x00", b" lead", b"\xe9"]
VALUES = [b"x", b"12", b"0", b"5", b"chunked", b"CHUNKED", b"gzip, chunked", b"keep-alive", b"close",
          b"100-continue", b"Bearer k", b"a\tb", b"", b"-6", b"0x6", b"1,1", b" 5 ", b"\xe9t\xe9",
          b"9" * 40, b"x\x01y", b"x\x7fy"]
MUTATION_BYTES = b"\r\n\x00 :-0x;\t\x7f\xff9Aa,"
# Bodies without CR or LF: a bare one in a message is then framing (a line end), never data.
BODY = st.binary(max_size=16).map(lambda b: b.replace(b"\r", b"r").replace(b"\n", b"n"))


CLEAN_NAMES = [b"content-type", b"authorization", b"x-a", b"set-cookie", b"Accept", b"connection"]
CLEAN_VALUES = [b"x", b"12", b"keep-alive", b"Bearer k", b"a\tb", b"", b"\xe9t\xe9", b"text/event-stream"]


@st.composite
def fields(draw, clean):
    out = []
    for _ in range(draw(st.integers(0, 5))):
        if clean:
            name = draw(st.one_of(st.sampled_from(CLEAN_NAMES), st.from_regex(rb"\A[a-z][a-z0-9-]{0,8}\Z")))
            value = draw(st.sampled_from(CLEAN_VALUES))
            sep = draw(st.sampled_from([b": ", b":", b":\t", b":  "]))
        else:
            name = draw(st.one_of(st.sampled_from(NAMES), st.sampled_from(NAMES), st.sampled_from(BAD_NAMES),
                                  st.from_regex(rb"\A[a-z][a-z0-9-]{0,8}\Z")))
            value = draw(st.one_of(st.sampled_from(VALUES), st.binary(max_size=6)))
            sep = draw(st.sampled_from([b": ", b":", b":\t", b" : ", b":  "]))
        out.append(name + sep + value)
    return out


def either(clean, draw, good, odd):
    """A well-formed part for a clean message; now and then an odd one for the others."""
    return draw(st.sampled_from(good if clean else good + odd))


@st.composite
def chunked_body(draw, clean):
    out = b""
    for piece in draw(st.lists(BODY.filter(bool), max_size=4)):
        ext = either(clean, draw, [b"", b"", b";x=y", b" "], [b";\r", b" ;x"])
        size = either(clean, draw, [b"%x" % len(piece), b"%X" % len(piece), b"0%x" % len(piece)],
                      [b"%x" % (len(piece) + 1), b"-%x" % len(piece)])
        out += size + ext + b"\r\n" + piece + b"\r\n"
    trailer = either(clean, draw, [b"", b"", b"x-t: 1\r\n"], [b" fold\r\n", b"bad\r\n"])
    return out + b"0\r\n" + trailer + b"\r\n"


@st.composite
def mutated(draw, message, clean):
    data = bytearray(message)
    for _ in range(0 if clean else draw(st.sampled_from([0, 1, 1, 2, 3]))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["set", "drop", "double"]))
        if how == "set":
            data[at] = draw(st.sampled_from(MUTATION_BYTES))
        elif how == "drop":
            del data[at]
        else:
            data[at:at] = data[at:at + draw(st.integers(1, 4))]
    return bytes(data)


@st.composite
def requests(draw):
    clean = draw(st.booleans())
    method = either(clean, draw, [b"POST", b"GET", b"HEAD", b"PUT", b"post"], [b"GE T", b"G\xe9T"])
    target = either(clean, draw, [b"/v1/chat/completions", b"/x?y=1", b"/a%20b"], [b"*", b"http://h/x", b"/\xe9"])
    version = either(clean, draw, [b"HTTP/1.1"], [b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 "])
    lines = draw(fields(clean))
    if clean or draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), b"Host: x")
    kind = draw(st.sampled_from(["length", "chunked", "none"]))
    if kind == "length":
        body = draw(BODY)
        lines.append(b"Content-Length: %d" % len(body))
    elif kind == "chunked":
        body = draw(chunked_body(clean))
        lines.append(b"Transfer-Encoding: " + draw(st.sampled_from([b"chunked", b"Chunked", b"CHUNKED"])))
    else:
        body = b""
    eol = either(clean, draw, [b"\r\n"], [b"\r\n", b"\n"])
    head = method + b" " + target + b" " + version + eol + b"".join(line + eol for line in lines) + eol
    after = draw(st.sampled_from([b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]))
    return draw(mutated(head + body + after, clean))


@st.composite
def responses(draw):
    clean = draw(st.booleans())
    version = either(clean, draw, [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"], [b"HTTP/2", b"HTTP/1.2"])
    status = either(clean, draw, [b"200", b"200", b"404", b"500", b"204", b"304"], [b"100", b"2000", b"2x0"])
    reason = either(clean, draw, [b" OK", b" OK", b"", b" ", b" Not\tFound", b" \xe9"], [b"\tOK", b" \x01"])
    lines = draw(fields(clean))
    kind = draw(st.sampled_from(["length", "chunked", "close"]))
    if kind == "length":
        body = draw(BODY)
        lines.append(b"content-length: %d" % len(body))
    elif kind == "chunked":
        body = draw(chunked_body(clean))
        lines.append(b"transfer-encoding: " + draw(st.sampled_from([b"chunked", b"chunkEd"])))
    else:
        body = draw(BODY)
    eol = either(clean, draw, [b"\r\n"], [b"\r\n", b"\n"])
    interim = draw(st.sampled_from([b"", b"", b"HTTP/1.1 100 Continue\r\n\r\n"]))
    head = interim + version + b" " + status + reason + eol + b"".join(line + eol for line in lines) + eol
    return draw(mutated(head + body, clean)), draw(st.sampled_from([b"GET", b"GET", b"HEAD"]))


# -- what h11 makes of them --------------------------------------------------------------------
def h11_reads(conn: h11.Connection, data: bytes, final_type, at_eof: bool):
    """(head event, body, trailing bytes) as h11 reads `data`; None when it refuses or wants more."""
    conn.receive_data(data)
    if at_eof:
        conn.receive_data(b"")
    try:
        event = conn.next_event()
        while type(event) is h11.InformationalResponse:
            event = conn.next_event()
        if type(event) is not final_type:
            return None
        body = b""
        while True:
            part = conn.next_event()
            if type(part) is h11.Data:
                body += bytes(part.data)
            elif type(part) is h11.EndOfMessage:
                return event, body, conn.trailing_data[0]
            else:
                return None
    except h11.ProtocolError:
        return None


_RAW_FRAMING = re.compile(rb"\n(content-length|transfer-encoding)[ \t]*:[ \t]*([^\r\n]*?)[ \t]*(?=\r?\n)", re.I)


def stricter_on_purpose(message: bytes) -> bool:
    """A rule where the codec refuses what h11 takes (module docstring)."""
    head_end = re.search(rb"\n\r?\n", message)
    head = message[:head_end.end()] if head_end else message
    framing = [(n.lower(), v) for n, v in _RAW_FRAMING.findall(head)]
    in_trailer = re.search(rb"\n0+\r?\n(?:[^\n]*\n)*?(?:content-length|transfer-encoding|host)[ \t]*:",
                           message[len(head):], re.I)
    return (on.framing_error(framing) is not None or in_trailer is not None                 # framing in a trailer
            or re.search(rb"\r(?!\n)|(?<!\r)\n", message) is not None                 # a bare CR or LF
            or re.search(rb"[\x00-\x08\x0b-\x1f\x7f]", head) is not None                 # a control byte
            or re.search(rb"\n[ \t]", head) is not None                                  # obs-fold
            or re.search(rb"(?:^|\n)[0-9A-Fa-f]{16,}", message[len(head):]) is not None  # a 16+ digit chunk size
            or re.match(rb"(?:HTTP/1\.1 1\d\d[^\n]*\n\r?\n)*HTTP/1\.[01] ", message) is None
            and message.startswith(b"HTTP/"))                                            # a version past 1.1


def codec_request(data: bytes):
    """(head, body, trailing bytes) as the codec reads a whole request; H11_JUDGES, None
    (incomplete) or "refused"."""
    try:
        head = on.parse_request(data)
    except HTTPViolation:
        return "refused"
    if head is None or head is H11_JUDGES:
        return head
    reader, pieces = BodyReader(head.framing, head.length), []
    used = reader.feed(data[head.size:], pieces)
    if reader.error is not None:
        return "refused"
    if not reader.done:
        return None
    return head, b"".join(pieces), data[head.size + used:]


def codec_response(data: bytes, head_request: bool):
    try:
        head = on.parse_response(data, head_request)
    except HTTPViolation:
        return "refused"
    if head is None:
        return None
    reader, pieces = BodyReader(head.framing, head.length), []
    used = reader.feed(data[head.size:], pieces)
    if reader.error is not None:
        return "refused"
    if head.framing is UNTIL_CLOSE:
        reader.end_of_stream()
    if not reader.done:
        return None
    return head, b"".join(pieces), data[head.size + used:]


# -- the differential properties ------------------------------------------------------------------
@EXAMPLES
@given(requests())
def test_a_request_the_codec_reads_is_read_the_same_by_h11_and_one_it_refuses_h11_refuses_or_must(data):
    ours = codec_request(data)
    if ours is H11_JUDGES:
        return
    theirs = h11_reads(h11.Connection(h11.SERVER), data, h11.Request, at_eof=False)
    if ours == "refused":
        assert theirs is None or stricter_on_purpose(data), data
        return
    if ours is None:   # incomplete for us: h11 is not done either
        assert theirs is None, data
        return
    assert theirs is not None, data
    head, body, rest = ours
    event, their_body, their_rest = theirs
    assert (head.method, head.target, head.version) == (event.method, event.target, event.http_version)
    assert head.headers == list(event.headers)
    assert (body, rest) == (their_body, their_rest)
    assert head.framing in (LENGTH, CHUNKED)


@EXAMPLES
@given(responses())
def test_a_response_the_codec_reads_is_read_the_same_by_h11_and_one_it_refuses_h11_refuses_or_must(case):
    data, method = case
    ours = codec_response(data, method == b"HEAD")
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    until_close = ours not in (None, "refused") and ours[0].framing is UNTIL_CLOSE
    theirs = h11_reads(client, data, h11.Response, at_eof=until_close)
    if ours == "refused":
        assert theirs is None or stricter_on_purpose(data), data
        return
    if ours is None:
        assert theirs is None, data
        return
    assert theirs is not None, data
    head, body, rest = ours
    event, their_body, their_rest = theirs
    assert (head.status, head.reason, head.version) == (event.status_code, event.reason, event.http_version)
    assert head.headers == list(event.headers)
    assert (body, rest) == (their_body, their_rest)


def _read_whole(data, method):
    """A response's head, its body bytes, and a BodyReader that read them in one piece (with
    its pieces and the bytes it used); None when the codec refuses the head or wants more."""
    try:
        head = on.parse_response(data, method == b"HEAD")
    except HTTPViolation:
        return None
    if head is None:
        return None
    body = data[head.size:]
    whole, whole_pieces = BodyReader(head.framing, head.length), []
    return head, body, whole, whole_pieces, whole.feed(body, whole_pieces)


@EXAMPLES
@given(data=responses(), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_a_body_read_in_any_pieces_ends_where_it_ends_read_whole(data, cuts):
    read = _read_whole(*data)
    if read is None:
        return
    head, body, whole, whole_pieces, whole_used = read
    split, split_pieces, used, start = BodyReader(head.framing, head.length), [], 0, 0
    for cut in sorted(set(cuts)) + [len(body)]:
        piece = body[start:max(start, cut)]
        start = max(start, cut)
        took = split.feed(piece, split_pieces)
        used += took
        if split.error is not None or split.done or took < len(piece):
            break
    assert (whole.error is None, whole.done) == (split.error is None, split.done)
    if whole.error is None:
        assert (used, b"".join(split_pieces)) == (whole_used, b"".join(whole_pieces))


@EXAMPLES
@given(data=responses(), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_a_body_taken_off_a_buffer_in_any_pieces_is_the_body_read_whole(data, cuts):
    """BodyReader.take (its fast loop over whole chunks, then feed for the rest) hands out the
    bytes feed finds reading the body whole, leaves what follows the body in the buffer, and
    raises where feed finds bad framing, after the good bytes before it."""
    read = _read_whole(*data)
    if read is None:
        return
    head, body, whole, whole_pieces, whole_used = read
    reader, buf, taken, fed, failed = BodyReader(head.framing, head.length), bytearray(), [], 0, False
    for cut in sorted(set(cuts)) + [len(body)] * 3:   # at the end: until it ends, fails or waits
        buf += body[fed:max(fed, cut)]
        fed = max(fed, cut)
        try:
            piece = reader.take(buf)
        except HTTPViolation:
            failed = True
            break
        if piece is None:
            break
        taken.append(piece)
    assert failed == (whole.error is not None)
    assert b"".join(taken) == b"".join(whole_pieces)
    if whole.done:
        assert reader.done and bytes(buf) + body[fed:] == body[whole_used:]


# -- the rules, one by one ------------------------------------------------------------------------
@pytest.mark.parametrize("fields, why", [
    (b"content-length: 5\r\ntransfer-encoding: chunked", "both Content-Length and Transfer-Encoding"),
    (b"content-length: 5\r\ncontent-length: 5", "more than one Content-Length"),
    (b"content-length: -6", "a Content-Length that is not a number of bytes"),
    (b"content-length: " + b"9" * 5000, "a Content-Length that is not a number of bytes"),
    (b"transfer-encoding: gzip, chunked", "a Transfer-Encoding other than chunked"),
    (b"host: y", "more than one Host"),
])
def test_a_request_with_two_readings_is_refused_whoever_would_read_it(fields, why):
    for version in (b"HTTP/1.1", b"HTTP/1.0"):   # 1.0 goes to h11: the framing is checked first
        if version == b"HTTP/1.0" and why == "more than one Host":
            continue   # h11 refuses it itself
        data = b"POST / " + version + b"\r\nhost: x\r\n" + fields + b"\r\n\r\n0\r\n\r\n"
        with pytest.raises(HTTPViolation, match=why):
            on.parse_request(data)


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.0\r\n\r\n", b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nx: a\r\n b\r\n\r\n", b"GET / HTTP/1.1\nhost: x\n\n", b"\r\nGET / HTTP/1.1\r\n",
    b"GET http://h/ HTTP/1.1\r\nhost: x\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01",
])
def test_a_request_the_codec_does_not_judge_goes_to_h11(data):
    assert on.parse_request(data) is H11_JUDGES


def test_a_request_head_is_framed_by_an_explicit_kind_never_a_sentinel_length():
    head = on.parse_request(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
    assert (head.framing, head.length, head.keep_alive) == (LENGTH, 0, True)
    head = on.parse_request(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\nConnection: close\r\n\r\n")
    assert (head.framing, head.length, head.keep_alive) == (CHUNKED, 0, False)
    head = on.parse_request(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
    assert (head.method, head.target, head.framing, head.size) == (b"GET", b"/x", LENGTH, 28)
    assert on.parse_request(b"GET /x HTTP/1.1\r\nHost: h\r\n") is None


def test_a_response_is_framed_by_status_method_and_fields():
    assert on.parse_response(b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n").framing is NO_BODY
    assert on.parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n", head_request=True).framing is NO_BODY
    head = on.parse_response(b"HTTP/1.0 200 OK\r\n\r\n")
    assert (head.framing, head.keep_alive, head.version) == (UNTIL_CLOSE, False, b"1.0")
    head = on.parse_response(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi")
    assert (head.status, head.framing, head.length, head.size) == (200, LENGTH, 2, 63)
    for bad in (b"HTTP/1.1 200 OK\r\ncontent-length: -6\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n"
                b"transfer-encoding: chunked\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: " + b"1" * 5000 + b"\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nx: a\rb\r\n\r\n", b"HTTP/1.1 200 OK\nx: a\n\n\r\n\r\n"):
        with pytest.raises(HTTPViolation):
            on.parse_response(bad)
    with pytest.raises(HTTPViolation, match="too large"):
        on.parse_response(b"HTTP/1.1 200 OK\r\nx: " + b"a" * on.MAX_HEAD)


@pytest.mark.parametrize("chunks", [b"-6\r\nabcdef\r\n", b"+6\r\nabcdef\r\n", b"0x6\r\nabcdef\r\n", b"6_0\r\n",
                                    b"zz\r\n", b"1" * 16 + b"\r\n", b"1000001\r\n", b"3\r\nabcd\r\n", b"3\nabc\r\n",
                                    b"0\r\nbad trailer\r\n\r\n", b"1" * 5000])
def test_broken_chunk_framing_is_an_error_after_the_good_chunks_before_it(chunks):
    reader = BodyReader(CHUNKED)
    buf = bytearray(b"2\r\nok\r\n" + chunks)
    good = reader.take(buf)   # "ok", and the data of a chunk found too long only at its end
    assert good in (b"ok", b"okabc")
    with pytest.raises(HTTPViolation):
        reader.take(buf)
    scan = BodyReader(CHUNKED)   # passing bytes through: the same end, as a count and `error`
    used = scan.feed(b"2\r\nok\r\n" + chunks)
    assert 7 <= used < 7 + len(chunks) and scan.error is not None and not scan.done


def test_a_chunked_body_passes_through_to_its_end_and_not_a_byte_further():
    body = b"5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\ntrailer: yes\r\n\r\n"
    reader, pieces = BodyReader(CHUNKED), []
    assert reader.feed(body + b"HTTP/1.1 200", pieces) == len(body)
    assert reader.done and b"".join(pieces) == b"hello!"
    length = BodyReader(LENGTH, 3)
    assert (length.feed(b"abcdef"), length.done) == (3, True)
    with pytest.raises(HTTPViolation, match="mid-body"):
        BodyReader(LENGTH, 3).end_of_stream()


def test_a_short_round_of_coverage_guided_fuzzing_finds_no_disagreement(tmp_path):
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris): "
                                          "tests/fuzz_http_codec.py fuzzes the codec with it")
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "request").write_bytes(b"\x00POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
    (corpus / "response").write_bytes(b"\x01HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
    done = subprocess.run([sys.executable, os.path.join(here, "fuzz_http_codec.py"), "-runs=2000", "-max_len=256",
                           "-seed=1", str(corpus)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_table_of_field_lines_seen_before_stays_bounded_under_lines_never_seen_twice():
    # a hostile client sending a new header line on every request costs a lookup, not memory;
    # a long line is split each time and never kept; what is read is the same either way
    on._FIELD_LINES.clear()
    long_value = b"c" * (on._FIELD_LINE_CACHED + 10)
    for i in range(on._FIELD_LINES_MAX * 3):
        head = on.parse_request(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-n-%d:  v%d \r\ncookie: %s\r\n\r\n"
                                % (i, i, long_value))
        assert head.fields[b"x-n-%d" % i] == b"v%d" % i and head.fields[b"cookie"] == long_value
        assert len(on._FIELD_LINES) <= on._FIELD_LINES_MAX + 2
    assert all(len(line) <= on._FIELD_LINE_CACHED for line in on._FIELD_LINES)
    again = on.parse_request(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-N-1:  v1 \r\n\r\n")
    assert again.headers == [(b"host", b"x"), (b"x-n-1", b"v1")]


# -- the writers: what the node writes, its own parsers (and h11) read back ---------------------
_names = st.sampled_from([b"x-a", b"accept", b"x-request-id", b"connection", b"x-otela-tunnel"])
_values = st.binary(min_size=0, max_size=20).map(lambda v: bytes(c for c in v if 0x21 <= c <= 0x7e))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_names, _values), max_size=5), st.binary(max_size=50))
def test_a_written_request_head_parses_back_with_its_body_and_without_the_dropped_fields(headers, body):
    drop = {b"connection", b"x-otela-tunnel"}
    data = b"".join(on.request_head(b"POST", b"/v1/x?q=1", b"127.0.0.1:9", len(body), headers, drop)) + body
    head = on.parse_request(bytearray(data))
    assert (head.method, head.target, head.framing, head.length) == (b"POST", b"/v1/x?q=1", LENGTH, len(body))
    assert head.headers == [(b"host", b"127.0.0.1:9"), (b"content-length", b"%d" % len(body))] + \
        [(n, v) for n, v in headers if n not in drop]
    assert data[head.size:] == body


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"x-a", b"Accept", b"x-request-id", b"Connection", b"x-otela-tunnel",
                                           b"x-otela-prefix", b"TE", b"traceparent"]), _values), max_size=6),
       st.binary(max_size=50))
def test_a_forwarded_request_keeps_its_lines_as_they_came_but_hop_by_hop_and_ours(headers, body):
    # the node's request to its engine: host and length its own, every other line verbatim, in order
    forwarded = dict.fromkeys(on.HOP_BY_HOP | {b"x-otela-tunnel", b"x-otela-prefix"}, False)
    lines = b"".join(b"%s:  %s \r\n" % (n, v) for n, v in headers)
    came = b"POST /v1/x?q=1 HTTP/1.1\r\nHost: node:1\r\n%scontent-length: %d\r\n\r\n%s" % (lines, len(body), body)
    head = on.parse_request(bytearray(came))
    data = on.forwarded_request_head(head, b"127.0.0.1:9", len(body), forwarded) + body
    kept = [b"%s:  %s " % (n, v) for n, v in headers if n.lower() not in forwarded]
    assert data == b"POST /v1/x?q=1 HTTP/1.1\r\nhost: 127.0.0.1:9\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(line + b"\r\n" for line in kept), body)
    again = on.parse_request(bytearray(data))   # and it reads back as the same fields, less the dropped
    assert again.headers[2:] == [(n.lower(), v) for n, v in headers if n.lower() not in forwarded]
    # a head h11 read (no lines of the codec's) is written from its fields, to the same effect
    fields = [(n.lower(), v) for n, v in [(b"host", b"node:1"), *headers]]
    read = on.MessageHead(fields, dict(fields), 0)
    read.method, read.target = b"POST", b"/v1/x?q=1"
    assert on.parse_request(bytearray(on.forwarded_request_head(read, b"127.0.0.1:9", len(body), forwarded)
                                      + body)).headers == again.headers


def test_fields_new_on_every_request_are_judged_but_never_remembered():
    # the ingress's trace context and request id differ on every request a node is sent: kept,
    # they would fill the table and empty it of the lines that come again every ~2,000 requests
    on._FIELD_LINES.clear()
    for i in range(50):
        head = on.parse_request(b"POST /v1/chat HTTP/1.1\r\nhost: n\r\ntraceparent: 00-%032x-%016x-01\r\n"
                                b"x-request-id: r%d\r\ncontent-length: 0\r\n\r\n" % (i, i, i))
        assert head.fields[b"x-request-id"] == b"r%d" % i and head.fields[b"traceparent"].endswith(b"-01")
    assert sorted(on._FIELD_LINES) == [b"content-length: 0", b"host: n"]
    with pytest.raises(HTTPViolation):   # judged all the same: a bad one is still refused
        on.parse_response(b"HTTP/1.1 200 OK\r\nx-request-id: a\x01b\r\ncontent-length: 0\r\n\r\n")


@pytest.mark.parametrize("framing", [NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE])
def test_a_written_response_head_says_its_framing_and_h11_reads_it(framing):
    data = b"".join(on.response_head(200, b"OK", [(b"x-a", b"1"), (b"keep-alive", b"5")], on.HOP_BY_HOP,
                                     framing, 7, close=True))
    head = on.parse_response(bytearray(data))
    assert head.status == 200 and (b"keep-alive", b"5") not in head.headers and not head.keep_alive
    assert head.framing == {NO_BODY: LENGTH, UNTIL_CLOSE: CHUNKED}.get(framing, framing)
    assert head.length == {NO_BODY: 0, LENGTH: 7}.get(framing, head.length)
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.receive_data(data)
    assert conn.next_event().status_code == 200


def test_a_whole_answer_is_one_piece_with_its_length_and_type():
    data = on.whole_response(503, b'{"e":1}', close=True)
    assert data.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and data.endswith(b'\r\n\r\n{"e":1}')
    head = on.parse_response(bytearray(data))
    assert head.fields[b"content-type"] == b"application/json" and head.length == 7 and not head.keep_alive
