"""gpt-oss's tool calls (OpenAI's harmony format): a message addressed to a function,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS`,
which the `<|call|>` stop token ends. pd_runtime/router/harmony.py leaves such a message in the
content as written; this reader takes it out as a call (CallReader's interface,
pd_runtime/router/tool_calls.py): its name once the header is whole, its arguments as they are
written. A content that is not a call (the final channel's answer) is all content.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_runtime.router import harmony
from pd_runtime.router.tool_calls import CallReader, call_id


@dataclass
class _HarmonyCall:
    id: str
    name: str
    sent: int = 0  # characters of its arguments given out


class HarmonyCallReader:
    whole = CallReader.whole

    def __init__(self, plan):
        self.short_ids = plan.short_ids
        self.parallel = plan.parallel
        self.calls: list[_HarmonyCall] = []
        self.shown = 0  # characters of the content sent

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[dict]]:
        """The content so far -> (content to send now, tool_calls deltas to send now)."""
        messages = harmony.parse(text, finished)
        if messages is None:  # the answer: all content
            out = text[self.shown:]
            self.shown = len(text)
            return out, []
        deltas = []
        for index, message in enumerate(m for m in messages if m.function is not None):
            if index == len(self.calls):
                if index and not self.parallel:
                    break
                self.calls.append(_HarmonyCall(call_id(self.short_ids), message.function))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": message.function, "arguments": ""}})
            call = self.calls[index]
            if len(message.body) > call.sent:
                deltas.append({"index": index,
                               "function": {"arguments": message.body[call.sent:]}})
                call.sent = len(message.body)
        return "", _merged(deltas)


def _merged(deltas: list[dict]) -> list[dict]:
    """A new call's first arguments folded into its header delta (one delta per call)."""
    out: list[dict] = []
    for delta in deltas:
        if out and "id" not in delta and out[-1]["index"] == delta["index"]:
            out[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            out.append(delta)
    return out

