"""A real local language model (Qwen2.5-Coder-0.5B-Instruct on llama.cpp's llama-server) for the
harness; see harness.llm.server."""
