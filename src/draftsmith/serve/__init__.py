"""`draftsmith serve`: an OpenAI-compatible HTTP server over the engine (speculative with a
drafter).

fastapi and uvicorn are imported only by `serve.app`, so `draftsmith` imports without them.
"""
