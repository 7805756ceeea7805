"""``mode=serve``: an OpenAI-compatible HTTP server whose concurrent requests share each pass over the streamed
weights (continuous batching over a left-padded KV cache planned per request)."""
