"""Tool calls in the Hermes / Qwen format: the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after (or instead of) its text.

`parse_tool_calls` splits a whole completion; `ToolStream` does it on a stream of text deltas:
text before the first `<tool_call>` streams as content (a possible start of the tag is held
back), everything from the tag on is held and parsed when the request ends.
"""

from __future__ import annotations

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.S)


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content before the first tool call, tool calls) of a completion. When a block does not
    parse as a call, nothing is taken as a call and the whole text stays content (the model did
    not produce a well-formed call; the client sees what it wrote)."""
    at = text.find(START)
    if at < 0:
        return text, []
    calls = [_call(m.group(1)) for m in _BLOCK.finditer(text, at)]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:at].rstrip(), calls


class ToolStream:
    """Splits streamed text into content deltas and, at the end, tool calls."""

    def __init__(self):
        self._held = ""
        self._in_call = False
        self.content = ""

    def push(self, text: str) -> str:
        """Content that can be sent now."""
        if self._in_call:
            self._held += text
            return ""
        buf = self._held + text
        at = buf.find(START)
        if at >= 0:
            self._in_call, self._held = True, buf[at:]
            out = buf[:at]
        else:
            hold = next(
                (k for k in range(min(len(START) - 1, len(buf)), 0, -1) if buf.endswith(START[:k])),
                0,
            )
            out, self._held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.content += out
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(remaining content, tool calls) when the request ends."""
        held, self._held = self._held, ""
        if not self._in_call:
            self.content += held
            return held, []
        _, calls = parse_tool_calls(held)
        if not calls:  # malformed: what was held back is content after all
            self.content += held
            return held, []
        return "", calls
