"""A model's tool calls read out of its output as it is written (tool_choice "auto" and
"required"; a named function's output is its arguments: pd_runtime/entrypoints/openai/completion_bodies.py).
The content before the first call streams as it comes, a call goes out once its name is read and its
arguments have begun, and its arguments as the model writes them. A finished output is read the same
way (pd_runtime/parsers/registry.py `read_calls`), so a streamed choice and a whole one have the
same content and the same calls.

The formats (the one a chat template teaches, or router.tool_call_parser; each one's reader
is named in pd_runtime/parsers/registry.py: CallReader, here, for FORMATS, the JSON ones):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated (Qwen2.5,
               Qwen3, Hermes); text before the first is content, text between them is dropped
  mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
  granite      <|tool_call|>[{"name": ..., "arguments": {...}}, ...] (Granite 3.x)
  llama3_json  the whole output: {"name": ..., "parameters": {...}}, several joined by ';'
               (after an optional <|python_tag|>, Llama 3.1-3.3's, or <|python_start|>, with
               the <|python_end|> Llama 4's template writes after it)
  required     the JSON array tool_choice "required" holds the output to
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}
               \n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (DeepSeek-V3, R1 and its distills; V3.1
               writes NAME<｜tool▁sep｜>{...} in each call)
  qwen3_coder  <tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>
               (Qwen3-Coder and the later Qwen models: pd_runtime/parsers/tool_calls_xml.py)
  pythonic     the whole output: [get_weather(city="Paris"), ...], Python literals for values
               (Llama 3.2 and 4 prompted for it, ToolACE: pd_runtime/parsers/tool_calls_pythonic.py)
  harmony      a message to=functions.NAME on gpt-oss's commentary channel, its body the
               arguments (pd_runtime/parsers/tool_calls_harmony.py)
Output that breaks its format before a call has begun is content after all (all of it, as
written); after one has, what follows the last whole call is dropped. Arguments are given as
the model wrote them: a call cut short (max_tokens) has them cut short too; a JSON string is
given decoded (some models write the arguments as one), once whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from pd_runtime.parsers import tool_calls_base
from pd_runtime.parsers.call_object import CallObject
from pd_runtime.parsers.text import partial_tag_len
from pd_runtime.parsers.tool_calls_base import FUNCTION_NAME, call_id
from pd_runtime.parsers.tool_calls_base import SPACE as _SPACE

_STRING_STOP = re.compile(r'["\\]')  # what inside a JSON string changes how it is read
_ARGS_TAG = "[ARGS]"  # Mistral's newer form: [TOOL_CALLS]name[ARGS]{...}
_NAME_START = re.compile(r"[A-Za-z0-9_]")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:-]*")


@dataclass(frozen=True)
class _Format:
    marker: Optional[str]  # what the calls begin with (None: they begin the output)
    opener: Optional[str] = None  # what each call begins with (hermes)
    between: str = _SPACE  # what may come between two calls (list and ';' forms)
    prefixes: tuple = ()  # what may come first (llama3_json), longest first


FORMATS = {"hermes": _Format("<tool_call>", opener="<tool_call>"),
           "mistral": _Format("[TOOL_CALLS]", between=_SPACE + "[,"),
           "granite": _Format("<|tool_call|>", between=_SPACE + "[,"),
           "llama3_json": _Format(None, between=_SPACE + ";", prefixes=(
               "<|python_start|><|python_end|>", "<|python_start|>", "<|python_tag|>")),
           "required": _Format(None, between=_SPACE + "[,"),
           "deepseek_v3": _Format("<｜tool▁calls▁begin｜>")}
_DS_CALL, _DS_SEP, _DS_END, _DS_CALLS_END = \
    "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
_DS_FENCE = "```json"


@dataclass
class _Call:
    id: str
    name: str
    obj: CallObject
    sent: int = 0  # characters of its arguments given out
    header_sent: bool = False


class CallReader:
    """A choice's calls under "auto" or "required", fed its output as it grows: the content to
    send now and the calls' deltas (OpenAI's streamed tool_calls: a call's id and name first,
    then its arguments in pieces)."""

    whole = tool_calls_base.whole
    _show = tool_calls_base.show

    def __init__(self, plan):
        self.fmt = FORMATS["required" if plan.mode == "required" else plan.parser]
        # A bare JSON object (llama3_json) is a call when it names a tool, not any answer in
        # JSON that has a "name" key.
        self.names = plan.names if self.fmt.marker is None and plan.mode == "auto" else ()
        self.short_ids = plan.short_ids
        self.parallel = plan.parallel
        self.shown = 0  # characters of the output sent as content
        self.visible = 0  # content may be sent up to here (unless it turns out plain)
        self.plain = False  # it holds no call: all of it is content
        self.pos: Optional[int] = None  # how far the calls are read (None: not begun)
        self.state = "gap"  # "gap" (before a call), "open" (after hermes' opener), "object"
        self.obj: Optional[CallObject] = None
        self.calls: list[_Call] = []
        self.settled = 0  # the calls before this one are sent whole
        self.over = False  # no more calls are read

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[dict]]:
        """The output so far -> (content to send now, tool_calls deltas to send now)."""
        if not self.plain and self.pos is None:
            self._begin(text)
        if not self.plain and self.pos is not None and not self.over:
            self._read(text)
        if finished and not self.calls:
            self.plain = True  # no call began: it was content after all
        if self.plain:
            return self._show(text, len(text)), []
        return self._show(text, self.visible), self._deltas(text, finished)

    # -- where the calls begin -----------------------------------------------------------------
    def _begin(self, text: str) -> None:
        fmt = self.fmt
        if fmt.marker is not None:
            at = text.find(fmt.marker, self.shown)
            if at < 0:  # content: all but what could be the marker's start
                self.visible = len(text) - partial_tag_len(text, fmt.marker)
                return
            self.visible = at
            self.pos = at if fmt.opener else at + len(fmt.marker)
            return
        body = text.lstrip()
        if fmt.prefixes:  # a call is the whole output: does it begin with one?
            if not body or any(len(body) < len(p) and p.startswith(body) for p in fmt.prefixes):
                return  # undecided yet
            prefix = next((p for p in fmt.prefixes if body.startswith(p)), "")
            if not (prefix or body.startswith("{")):
                self.plain = True
                return
            self.pos = len(text) - len(body) + len(prefix)
            return
        self.pos = 0

    # -- reading calls -------------------------------------------------------------------------
    def _read(self, text: str) -> None:
        fmt, i = self.fmt, self.pos
        while i < len(text) and not (self.over or self.plain):
            if self.state == "object":
                if self.obj.in_string and not self.obj.escape:  # to the string's next quote
                    stop = _STRING_STOP.search(text, i)
                    if stop is None:
                        i = len(text)
                        break
                    i = stop.start()
                if self.obj.push(text, i):
                    i += 1
                self._pushed()
                continue
            if self.state == "gap" and fmt is FORMATS["deepseek_v3"]:
                step = self._deepseek_gap(text, i)
                if step is None:
                    break
                i += step
                continue
            if self.state == "gap" and fmt is FORMATS["mistral"]:
                step = self._mistral_gap(text, i)
                if step is None:  # undecided until more is written
                    break
                if step:
                    i += step
                    continue
            if self.state == "gap" and fmt.opener is not None:
                at = text.find(fmt.opener, i)
                if at < 0:  # what is between calls is dropped
                    i = max(i, len(text) - partial_tag_len(text, fmt.opener))
                    break
                i, self.state = at + len(fmt.opener), "open"
                continue
            ch = text[i]
            if ch == "{":
                self.obj, self.state = CallObject(), "object"
            elif ch == "]" and self.state == "gap" and "[" in fmt.between:
                self.over = True
            elif ch not in (_SPACE if self.state == "open" else fmt.between):
                self._broken()
            i += 1
        self.pos = i

    def _deepseek_gap(self, text: str, i: int) -> Optional[int]:
        """DeepSeek's form before or between calls: how far to go (a call's head, up to its
        arguments, whose object is begun; what ends the call before; the end of all calls),
        None while undecided. Anything else breaks the format."""
        at = i
        while at < len(text) and text[at] in _SPACE + "`":  # the fence closing the last call
            at += 1
        rest = text[at:]
        if rest.startswith(_DS_END):
            return at + len(_DS_END) - i
        if rest.startswith(_DS_CALLS_END):
            self.over = True
            return at + len(_DS_CALLS_END) - i
        if rest.startswith(_DS_CALL):
            head = at + len(_DS_CALL)
            sep = text.find(_DS_SEP, head, head + 80)
            if sep < 0:
                return None if len(text) - head < 80 else self._broken_step()
            start = sep + len(_DS_SEP)
            if text[head:sep] == "function":  # V3 and R1: the name, then the fenced object
                line = text.find("\n", start, start + 80)
                if line < 0:
                    return None if len(text) - start < 80 else self._broken_step()
                name, start = text[start:line], line + 1
                while start < len(text) and text[start] in _SPACE:
                    start += 1
                if len(text) - start < len(_DS_FENCE) + 1:
                    return None
                if text.startswith(_DS_FENCE, start):
                    start += len(_DS_FENCE)
            else:  # V3.1: the name, then the object
                name = text[head:sep]
            if not FUNCTION_NAME.fullmatch(name):
                return self._broken_step()
            self.obj, self.state = CallObject(name), "object"
            while start < len(text) and text[start] in _SPACE:
                start += 1
            return start - i
        if not rest or any(tag.startswith(rest) for tag in (_DS_END, _DS_CALLS_END, _DS_CALL)):
            return None
        return self._broken_step()

    def _broken_step(self) -> None:
        self._broken()
        return None

    def _mistral_gap(self, text: str, i: int) -> Optional[int]:
        """Mistral's newer form between or before calls: `[TOOL_CALLS]` again (its length), or
        a call `name[ARGS]` (up to its arguments, whose object is begun); 0 for neither, None
        while what is written could still be either."""
        marker = self.fmt.marker
        if text.startswith(marker, i):
            return len(marker)
        rest = text[i:i + len(marker)]
        if marker.startswith(rest) and rest.startswith("["):
            return None
        if not _NAME_START.match(text, i):
            return 0
        at = text.find(_ARGS_TAG, i)
        if at < 0:  # the name so far, and maybe the tag's start
            name = _NAME_CHARS.match(text, i).end()
            tail = text[name:]
            return None if not tail or _ARGS_TAG.startswith(tail) else 0
        if not FUNCTION_NAME.fullmatch(text, i, at):
            return 0
        self.obj, self.state = CallObject(text[i:at]), "object"
        return at + len(_ARGS_TAG) - i

    def _pushed(self) -> None:
        obj = self.obj
        if obj.broken:
            self._broken()
            return
        begun = self.calls and self.calls[-1].obj is obj
        if not begun and obj.name is not None and (obj.args is not None or obj.done):
            if self.names and obj.name not in self.names:
                self._broken()
                return
            self.calls.append(_Call(call_id(self.short_ids), obj.name, obj))
        if obj.done:
            self.obj, self.state = None, "gap"
            if self.calls and not self.parallel:
                self.over = True

    def _broken(self) -> None:
        if self.calls:
            self.over = True  # what follows the last whole call is dropped
        else:
            self.plain = True

    # -- what goes out -------------------------------------------------------------------------
    def _deltas(self, text: str, finished: bool) -> list[dict]:
        out = []
        for index in range(self.settled, len(self.calls)):
            call = self.calls[index]
            if call.header_sent and call.obj.args_end is not None and \
                    call.sent >= call.obj.args_end - call.obj.args:
                if index == self.settled:  # all of it out: not looked at again
                    self.settled += 1
                continue  # nothing more of this one (a decoded string may be shorter: below)
            piece = self._arguments(call, text, finished)
            if call.header_sent:
                if piece:
                    out.append({"index": index, "function": {"arguments": piece}})
                continue
            call.header_sent = True
            out.append({"index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": piece}})
        return out

    def _arguments(self, call: _Call, text: str, finished: bool) -> str:
        """What of its arguments is new: written so far (an object or array), or once whole
        (a string, decoded; a bare value); "{}" for none; as written when cut short."""
        obj = call.obj
        if obj.args is None:
            if obj.done or finished:
                return "" if call.sent else _sent(call, "{}")
            return ""
        end = obj.args_end if obj.args_end is not None else self.pos
        if obj.args_kind in "{[":
            piece = text[obj.args + call.sent:end]
            call.sent += len(piece)
            return piece
        if obj.args_end is None and not finished or call.sent:
            return ""
        raw = text[obj.args:end]
        if raw == "null" and obj.args_end is not None:
            raw = "{}"  # none, as the model said
        elif obj.args_kind == '"' and obj.args_end is not None:
            try:
                raw = json.loads(raw)
            except ValueError:
                pass
        call.sent = obj.args_end - obj.args if obj.args_end is not None else len(raw)
        return raw


def _sent(call: _Call, text: str) -> str:
    call.sent = len(text)
    return text
