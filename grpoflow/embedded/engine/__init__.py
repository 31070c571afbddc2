"""The embedded engine: a batched CPU scheduler (`scheduler`) behind an HTTP server with SGLang's API (`server`).

Importing this package does not import torch; `scheduler`, `server` and `weights` do.
"""
