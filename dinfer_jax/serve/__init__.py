"""`dinfer-jax serve`: an OpenAI-compatible HTTP server with dynamic batching (needs the `serve` extra:
fastapi, uvicorn). Light to import: FastAPI is only imported when a server is built."""
