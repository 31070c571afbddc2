"""Stage 2, rollout: Harbor trials of the policy in sandboxes.

`trials` runs one trial (with sandbox retries) and many at once; `step` is one rollout step (plan, run, score,
journal); `journal` keeps each finished trial as it finishes; `policy` connects an agent to the engine (the shell
agent directly, OpenAI-speaking harnesses through the token-exact session server in `sessions`); `record` is what
an agent reports of its trial; `harnesses` binds each harness to Harbor; `environments` says which sandbox
failures are retried; `tokens` keeps chats token-exact.
"""
