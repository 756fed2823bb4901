"""Readers of a model's output text, fed it as it grows: tool calls (tool_calls.py for the JSON
forms, tool_calls_xml.py, tool_calls_pythonic.py, tool_calls_harmony.py, over tool_calls_base.py,
call_object.py and python_literals.py) and thinking split from the answer (reasoning.py for
<think> blocks, harmony.py for gpt-oss's channels), sharing text.py. registry.py names every
parser by the name config and chat templates give it and picks one for a request: the one entry
point the serving code uses. Pure string work: it may import nothing of pd_runtime outside
itself (docs/architecture.md, "Who may import what").
"""
