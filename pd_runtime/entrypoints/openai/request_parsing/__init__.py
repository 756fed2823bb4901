"""An OpenAI request body into an engine request: reading it off the event loop (intake.py,
parser_process.py), the strict schema and its conversion (schema.py, protocol.py), and the fields
that need more than a type check (chat prompt, tools, structured outputs, reasoning, text)."""
