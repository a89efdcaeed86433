"""Checks on a parsed JSON body that the schema cannot express, run before pydantic sees it.

Python's `json` accepts things the engine cannot take: `"\\ud800"` parses to a string holding a
lone UTF-16 surrogate, which is not Unicode text (the tokenizer, written in Rust, raises a
TypeError on it, and so would any attempt to encode it as UTF-8 for a log or a response); and
it decodes nesting until the interpreter's recursion limit, past which parsing, validation or
a later `repr` raises RecursionError. Both must be a 400 that names where the problem is, so
the walk below is iterative (it cannot itself run out of stack) and reports a JSON path.
"""

from __future__ import annotations

import json
from typing import Any

from flowyard.server.errors import APIError

#: Deepest nesting of arrays/objects accepted. The deepest legitimate body (a chat message's
#: content parts inside `messages`) is 4 levels; tool schemas may nest further, so leave room.
MAX_JSON_DEPTH = 64


def parse_json(raw: bytes) -> Any:
    """Parse a request body: invalid JSON or UTF-8, and nesting beyond what the parser can
    recurse into, are 400s."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, f"request body nests arrays/objects too deeply (at most {MAX_JSON_DEPTH} levels)",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _surrogate(s: str) -> int | None:
    """Index of the first lone surrogate in s (None if s is valid Unicode text)."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def check_json(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 naming the JSON path of the first string (key or value) that is not valid
    Unicode, or of the first array/object nested deeper than `max_depth`."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, str):
            if (i := _surrogate(node)) is not None:
                raise APIError(400, f"{_path(where)}: string is not valid Unicode (lone surrogate "
                                    f"U+{ord(node[i]):04X} at character {i})", param=_path(where) if where else None,
                               code="invalid_unicode")
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= max_depth:
            raise APIError(400, f"{_path(where)}: nested more than {max_depth} levels deep",
                           param=_path(where) if where else None, code="invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                if (i := _surrogate(k)) is not None:
                    raise APIError(400, f"{_path(where)}: a key is not valid Unicode (lone surrogate at "
                                        f"character {i})", code="invalid_unicode")
                stack.append((v, where + (k,), depth + 1))
        else:
            stack.extend((v, where + (j,), depth + 1) for j, v in enumerate(node))
