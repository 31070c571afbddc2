"""What production talks to: the SGLang HTTP API (`protocol`, `client`), the engine backends a run opens
(`backends`: a running server, a launched SGLang, or the embedded engine), and process launch (`launch`,
`sglang_launch`)."""
