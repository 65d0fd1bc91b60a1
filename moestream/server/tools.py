"""Tool calls and reasoning in chat output: the checkpoint's format, the prompt, forced calls, and the parsers.

Owns the three tool-call formats checkpoints are trained on (Kimi K2/K3 section tokens, DeepSeek-V3 / V3.1 tokens,
Qwen3's `<tool_call>{json}</tool_call>`), chosen from the chat template's text; `chat_prompt_ids` (the prompt with
`tools`, as transformers' apply_chat_template passes them); the Lark grammar that forces a call for
`tool_choice` "required" or a named function; and `OutputParser`, which splits streamed text into
`reasoning_content` (`<think>...</think>`), `content` and complete tool calls, the same way streamed or not.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from moestream.server.errors import bad_request as _bad
from moestream.server.options import Extras
from moestream.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    section_open: str  # starts the tool-call part of the output
    section_close: str | None  # ends it (None: calls simply follow each other)
    call_open: str
    call_close: str
    markers: tuple[str, ...]  # every marker token, kept in the text even when it is a special token


KIMI = ToolFormat("kimi", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                  "<|tool_call_end|>", ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                        "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))
DEEPSEEK = ToolFormat("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                      "<｜tool▁call▁end｜>", ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                            "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"))
QWEN3 = ToolFormat("qwen3", "<tool_call>", None, "<tool_call>", "</tool_call>", ("<tool_call>", "</tool_call>"))
FORMATS = {f.name: f for f in (KIMI, DEEPSEEK, QWEN3)}


def detect_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template renders (its own markers), or None."""
    for fmt in (KIMI, DEEPSEEK, QWEN3):
        if template and fmt.call_open in template:
            return fmt
    return None


# ---- the prompt ---------------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], ex: Extras) -> list[int]:
    """The chat prompt's token ids, with `tools` passed to the template (unless tool_choice is "none"); fills in
    `ex`'s output settings (tool format, reasoning markers, kept special tokens, a forced-call grammar)."""
    template = tokenizer.chat_template or ""
    tools = ex.tools if ex.tool_choice not in (None, "none") else None
    fmt = detect_format(template) if tools else None
    if tools and (fmt is None or "tools" not in template):
        raise _bad("tools", "this checkpoint's chat template does not render tools in a tool-call format this "
                            "server parses (Kimi, DeepSeek-V3 or Qwen3)")
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
    ex.tool_format = fmt.name if fmt else None
    ex.reasoning = THINK_OPEN in template or THINK_CLOSE in template
    ex.reasoning_open = ex.reasoning and tokenizer.decode(ids[-8:]).rstrip().endswith(THINK_OPEN)
    markers = (fmt.markers if fmt else ()) + ((THINK_OPEN, THINK_CLOSE) if ex.reasoning else ())
    ex.keep_token_ids = tuple(i for i in (tokenizer.token_to_id(m) for m in markers) if i is not None)
    if ex.json_schema is not None and ex.reasoning_open:  # the answer, not the reasoning, follows the schema
        from moestream.server.structured import lark_grammar, lark_json

        close = _lark_literal(THINK_CLOSE, tokenizer)
        ex.grammar = lark_grammar(f'start: {close} "\\n\\n" {lark_json(ex.json_schema)}\n', "response_format")
    if fmt and ex.tool_choice not in ("auto", "none"):
        ex.grammar = forced_call_grammar(fmt, tools, ex.tool_choice, ex.parallel_tool_calls, tokenizer,
                                         close_think=ex.reasoning_open)
    return ids


# ---- forced calls ---------------------------------------------------------------------------------------------
def _lark_literal(text: str, tokenizer: Tokenizer) -> str:
    """A marker: the token itself when the vocabulary has it as one token (the form the model was trained on;
    llguidance treats every added token as special), else its text."""
    tid = tokenizer.token_to_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def forced_call_grammar(fmt: ToolFormat, tools: list[dict], choice: str, parallel: bool,
                        tokenizer: Tokenizer, close_think: bool = False) -> str:
    """A grammar whose every sentence is a well-formed call (or, with parallel calls, calls) in `fmt`, to one of
    the allowed functions, with arguments matching that function's parameter schema. When the prompt opened a
    <think> block, the sentence first closes it: a forced call leaves no room for reasoning."""
    from moestream.server.structured import lark_grammar, lark_json

    fns = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    lit = lambda s: _lark_literal(s, tokenizer)  # noqa: E731
    rules = []
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {"type": "object"}
        args, name = lark_json(params), fn["name"]
        if fmt is QWEN3:
            schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False}
            rules.append(f'call{i}: {lit(fmt.call_open)} "\\n" {lark_json(schema)} "\\n" {lit(fmt.call_close)}')
        elif fmt is KIMI:
            rules.append(f'call{i}: {lit(fmt.call_open)} "functions.{name}:" /[0-9]{{1,2}}/ '
                         f'{lit("<|tool_call_argument_begin|>")} {args} {lit(fmt.call_close)}')
        else:  # DeepSeek-V3's own layout: type, separator, name, then the arguments in a json code block
            rules.append(f'call{i}: {lit(fmt.call_open)} "function" {lit("<｜tool▁sep｜>")} "{name}\\n```json\\n" '
                         f'{args} "\\n```" {lit(fmt.call_close)}')
    call = "call: " + " | ".join(f"call{i}" for i in range(len(fns)))
    calls = "call+" if parallel and choice == "required" else "call"
    start = f"start: {calls}" if fmt.section_close is None else \
        f"start: {lit(fmt.section_open)} {calls} {lit(fmt.section_close)}"
    if close_think:
        start = start.replace("start: ", f'start: {lit(THINK_CLOSE)} "\\n\\n" ', 1)
    return lark_grammar("\n".join([start, call, *rules]) + "\n", "tools")


# ---- the output ---------------------------------------------------------------------------------------------
@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str

    def body(self, with_index: bool = False) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **out} if with_index else out


def _parse_call(fmt: ToolFormat, block: str, index: int) -> ToolCall | None:
    """One call's text (between its open and close markers) as a ToolCall, or None when it is malformed."""
    block = block.strip()
    if fmt is QWEN3:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        return ToolCall(index, "call_" + uuid.uuid4().hex[:24], obj["name"],
                        args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    if fmt is KIMI:
        head, sep, args = block.partition("<|tool_call_argument_begin|>")
        m = re.fullmatch(r"(?:functions\.)?([^:\s]+):(\d+)", head.strip())
        if not sep or not m:
            return None
        return ToolCall(index, head.strip(), m.group(1), args.strip())
    head, sep, rest = block.partition("<｜tool▁sep｜>")
    if not sep:
        return None
    if head.strip() == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
        m = re.fullmatch(r"([^\n]+)\n```(?:json)?\n(.*)\n```", rest.strip(), re.DOTALL)
        if not m:
            return None
        name, args = m.group(1).strip(), m.group(2)
    else:  # V3.1: NAME<sep>{...}
        name, args = head.strip(), rest
    return ToolCall(index, "call_" + uuid.uuid4().hex[:24], name, args.strip())


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (text that must be held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class OutputParser:
    """Splits one choice's text, fed piece by piece, into events: ("reasoning", text), ("content", text) and
    ("tool_call", ToolCall). Feeding everything at once gives the same result as streaming it."""

    def __init__(self, ex: Extras):
        self.fmt = FORMATS.get(ex.tool_format or "")
        self.buf = ""
        self.phase = "think?" if ex.reasoning else "content"
        if ex.reasoning_open:
            self.phase = "reasoning"
        self.calls = 0
        self.after_think = False  # newlines right after </think> separate it from the answer: not content

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            before = (self.phase, len(self.buf))
            getattr(self, "_" + self.phase.rstrip("?"))(out)
            if (self.phase, len(self.buf)) == before:
                return out

    def flush(self) -> list[tuple[str, Any]]:
        """The end of the output: held-back text goes out as it is (an unfinished call stays text)."""
        out = self.feed("")
        rest, self.buf = self.buf, ""
        if rest.strip() or (rest and self.phase != "calls"):
            out.append(("reasoning" if self.phase == "reasoning" else "content", rest))
        return out

    def _think(self, out: list) -> None:
        """Before any output: reasoning starts only if the text opens with <think>."""
        stripped = self.buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buf, self.phase = stripped[len(THINK_OPEN):], "reasoning"
        elif not THINK_OPEN.startswith(stripped):
            self.phase = "content"

    def _reasoning(self, out: list) -> None:
        end = self.buf.find(THINK_CLOSE)
        if end >= 0:
            if end:
                out.append(("reasoning", self.buf[:end]))
            self.buf, self.phase, self.after_think = self.buf[end + len(THINK_CLOSE):], "content", True
            return
        self._emit_upto(out, "reasoning", THINK_CLOSE)

    def _content(self, out: list) -> None:
        if self.after_think:
            self.buf = self.buf.lstrip("\n")
            self.after_think = not self.buf
        start = self.buf.find(self.fmt.section_open) if self.fmt else -1
        if start >= 0:
            if self.buf[:start].strip():
                out.append(("content", self.buf[:start]))
            self.buf, self.phase = self.buf[start:], "calls"
            if self.fmt.section_close is not None:
                self.buf = self.buf[len(self.fmt.section_open):]
            return
        self._emit_upto(out, "content", self.fmt.section_open if self.fmt else None)

    def _calls(self, out: list) -> None:
        fmt = self.fmt
        lead = self.buf.lstrip()
        if fmt.section_close is not None and lead.startswith(fmt.section_close):
            self.buf, self.phase = lead[len(fmt.section_close):], "content"
            return
        if not lead.startswith(fmt.call_open):
            if lead and not fmt.call_open.startswith(lead) and not (fmt.section_close or "\0").startswith(lead):
                self.phase = "content"  # something other than another call: back to plain text
                self.buf = lead
            return
        end = lead.find(fmt.call_close)
        if end < 0:
            return
        call = _parse_call(fmt, lead[len(fmt.call_open):end], self.calls)
        if call is None:
            out.append(("content", lead[:end + len(fmt.call_close)]))
        else:
            out.append(("tool_call", call))
            self.calls += 1
        self.buf = lead[end + len(fmt.call_close):]

    def _emit_upto(self, out: list, kind: str, marker: str | None) -> None:
        keep = _partial_suffix(self.buf, marker) if marker else 0
        if len(self.buf) > keep:
            out.append((kind, self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]


class KeepingTokenizer:
    """The tokenizer as a decoder sees it: special tokens dropped except `keep` (tool-call / reasoning markers)."""

    def __init__(self, tokenizer: Tokenizer, keep: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.drop = tokenizer.special_ids() - set(keep)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.drop])
