"""OpenAI's Responses API (`POST /v1/responses`): the request as a chat request (request.py,
input_items.py), its events (events.py), and stored responses (stored.py)."""
