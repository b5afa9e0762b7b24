"""A real local language model (Qwen2.5-Coder-1.5B-Instruct by default, or the 0.5B variant, on
llama.cpp's llama-server) for the harness; see harness.llm.server and harness.prepare."""
