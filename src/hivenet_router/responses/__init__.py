"""OpenAI's Responses API over the fleet's chat completions.

A Responses request is read and checked here (`request.py`), turned into a chat completions
request for the agent's engine (`translate.py`), and the chat answer turned back into a
Response, whole (`translate.py`) or as the Responses stream events (`events.py`). Stored
responses, for `previous_response_id` and the GET/DELETE routes, live in `store.py`.
Nothing here does I/O but the store; the router's handlers (`router/responses_api.py`)
run the request through the same stages as a chat request.
"""
