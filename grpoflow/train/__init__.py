"""Stage 4, train: the GRPO loss (`grpo`), the policy's per-token logprobs (`logprobs`), the trainer's model and
optimizer (`trainer`) and one update on a step's samples (`step`)."""
