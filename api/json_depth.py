"""How deeply a JSON document nests, measured without parsing it.

Python's json parser, pydantic and pickle all recurse once per nesting level, so a body of 10,000 `[`
ends in a RecursionError deep inside one of them. This scan runs first, in C-speed byte operations: it
drops the strings (brackets inside them do not count), keeps only the brackets, then peels the
innermost `[]` and `{}` pairs off, one level per pass, for at most `limit` passes. Brackets left after
that nest deeper than `limit`. A body whose brackets stop pairing up is not JSON; the parser describes it.
Its cost grows with the body's size and its number of strings, which parsing costs anyway.
"""

from __future__ import annotations

import re

from twinkle.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # a Tinker forward_backward body nests 8 deep, Twinkle trajectories about as much

# Possessive quantifiers: no backtracking, so a long or unterminated string costs one linear pass.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper_than(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    # Fewer opening brackets than the limit cannot nest deeper than it: most bodies stop here.
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = (_STRING.sub(b"", body) if b'"' in body else body).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        # Marking the pairs first keeps this to one level per pass: "{[]}" loses "[]" now, "{}" next pass.
        peeled = brackets.replace(b"[]", b"\0").replace(b"{}", b"\0").replace(b"\0", b"")
        if len(peeled) == len(brackets):
            return False
        brackets = peeled
    return bool(brackets)


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    if nests_deeper_than(body, limit):
        raise InvalidRequest(f"The JSON body nests deeper than {limit} levels.",
                             hint="Flatten the nested lists and objects; no field of this API nests that deep.")
