"""Generated from protos/ by `python protos/generate.py`. Do not edit."""
