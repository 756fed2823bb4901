"""gpt-oss's tool calls (OpenAI's harmony format): a message addressed to a function,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS`
(or with the recipient before the channel), which the `<|call|>` stop token ends. This reader
(CallReader's interface, pd_runtime/parsers/tool_calls.py) is fed the whole output, markers and
thinking included (pd_runtime/entrypoints/openai/completion_bodies.py), and reads it as
pd_runtime/parsers/harmony.py does: a call per such message, its name once the header is whole, its
arguments as they are written; the content is the final channel's, as harmony.split gives it. An
output not in the format is all content.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_runtime.parsers import harmony, tool_calls_base
from pd_runtime.parsers.tool_calls_base import call_id


@dataclass
class _HarmonyCall:
    id: str
    name: str
    sent: int = 0  # characters of its arguments given out


class HarmonyCallReader:
    whole = tool_calls_base.whole

    def __init__(self, plan):
        self.short_ids = plan.short_ids
        self.parallel = plan.parallel
        self.calls: list[_HarmonyCall] = []
        self.shown = 0  # characters of the content sent

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[dict]]:
        """The output so far -> (content to send now, tool_calls deltas to send now)."""
        messages = harmony.parse(text, finished)
        content = text if messages is None else \
            harmony.SEPARATOR.join(m.body for m in messages if harmony.is_answer(m))
        shown = content[self.shown:]
        self.shown = max(self.shown, len(content))
        deltas = []
        calls = [m for m in messages or () if m.function is not None]
        for index, message in enumerate(calls):
            if index == len(self.calls):
                if index and not self.parallel:
                    break
                self.calls.append(_HarmonyCall(call_id(self.short_ids), message.function))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": message.function, "arguments": ""}})
            call = self.calls[index]
            if len(message.body) > call.sent:
                arguments = message.body[call.sent:]
                call.sent = len(message.body)
                if deltas and deltas[-1]["index"] == index:  # one delta per call and feed
                    deltas[-1]["function"]["arguments"] += arguments
                else:
                    deltas.append({"index": index, "function": {"arguments": arguments}})
        return shown, deltas
