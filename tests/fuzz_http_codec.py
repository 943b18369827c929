"""Coverage-guided fuzzing of the HTTP/1.1 codec against h11 (atheris), with the differential rules
of tests/test_http_codec.py: what the codec accepts h11 reads the same; what it refuses h11 refuses
or it breaks a rule where the codec is stricter on purpose; no input raises anything else.

The first input byte picks the direction (request, response to GET, response to HEAD); the rest is
the message. atheris is not a dependency (`pip install atheris`, Python 3.11 wheels exist):
    python tests/fuzz_http_codec.py -runs=200000 [-max_len=512] [corpus dir]
tests/test_http_codec.py runs a short round of it when atheris is importable.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import atheris  # noqa: E402

with atheris.instrument_imports():
    import h11  # noqa: E402
    import test_http_codec as rules  # noqa: E402

    import otela_node  # noqa: E402


def check(data: bytes) -> None:
    if not data:
        return
    direction, message = data[0] % 3, data[1:]
    if direction == 0:
        ours = rules.codec_request(message)
        if ours is otela_node.H11_JUDGES:
            return
        theirs = rules.h11_reads(h11.Connection(h11.SERVER), message, h11.Request, at_eof=False)
    else:
        ours = rules.codec_response(message, direction == 2)
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method=b"HEAD" if direction == 2 else b"GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        until_close = ours not in (None, "refused") and ours[0].framing is otela_node.UNTIL_CLOSE
        theirs = rules.h11_reads(client, message, h11.Response, at_eof=until_close)
    if ours == "refused":
        assert theirs is None or rules.stricter_on_purpose(message), message
    elif ours is None:
        assert theirs is None, message
    else:
        assert theirs is not None, message
        head, body, rest = ours
        event, their_body, their_rest = theirs
        assert head.headers == list(event.headers), message
        assert (body, rest) == (their_body, their_rest), message
        if direction == 0:
            assert (head.method, head.target) == (event.method, event.target), message
        else:
            assert (head.status, head.reason) == (event.status_code, event.reason), message


if __name__ == "__main__":
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
