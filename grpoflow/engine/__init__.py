"""What production talks to: the SGLang HTTP API (`protocol`, `client`; vLLM's too, behind the same client), the
engine backends a run opens (`backends`: a running server, a launched SGLang or vLLM, or the embedded engine), and
process launch (`launch`, `sglang_launch`, `vllm_launch`; `vllm_worker` runs inside vLLM's workers)."""
