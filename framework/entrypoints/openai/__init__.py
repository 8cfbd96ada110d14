"""OpenAI-compatible HTTP server (``kvforge serve``): see :mod:`.api_server`."""
