"""The OpenAI API surface over HTTP: the FastAPI app (app.py) and its server (server.py;
replicas.py builds one of router.replicas), request bodies made engine requests (request_parsing/:
intake.py, in a child process for large ones: parser_process.py; protocol.py over schema.py,
chat_prompt.py, tools.py, reasoning_request.py, structured_fields.py, text_checks.py; and
beam_search.py here), generation
and its SSE streams (generation.py, streaming.py, chunk_events.py, the completion and chat bodies
in completion_bodies.py), the middleware and error handlers every request passes (middleware.py),
the Responses API (responses/: request.py with input_items.py, events.py, stored.py) and vLLM's
tokenizer endpoints (tokenize_api.py). It may import the router (the Backend contract and
PoolBackend), the parsers (through parsers/registry.py to pick one), the run records (gateway)
and the shared top-level modules (api, errors, config, tokenizer, chat_template, structured,
beam_search): no engine, model, worker or transfer module, no torch and no Ray
(docs/architecture.md, "Who may import what").
"""
