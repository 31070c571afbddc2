"""Bad inputs: each case gets one clear error (one line, naming the file or field) before anything is written, or a
recorded per-trial exit status — never a crash mid-step, never a silent 0 reward.

Through `prepare_run` (dataset -> model -> prompts -> run dir), every failure below also leaves no run dir behind.

| input | what the system does |
|---|---|
| **task dirs** (`test_task_dirs.py`) | a broken task beside good ones is left out with the line below as its reason (gate.json, the CLI); alone (nothing left), the line is prepare's `DatasetError` |
| task.toml with a TOML syntax error | `DatasetError`: `<task>: task.toml is not valid TOML: ...` |
| task.toml with a wrong type (`verifier.timeout_sec = "soon"`) | `DatasetError` naming `verifier.timeout_sec` |
| task.toml `[metadata].category` not a string | `DatasetError` naming `[metadata].category` |
| task.toml with an unknown section | accepted, as Harbor's `TaskConfig` accepts it (forward compatible) |
| instruction.md missing / empty / not UTF-8 / over 64 KiB | `DatasetError` naming the task dir and instruction.md |
| tests/test.sh missing | `DatasetError`: `missing tests/test.sh (the verifier)` |
| solution/ missing | accepted (Harbor does not require one): the task is `unverified` in gate.json |
| environment/Dockerfile beyond `FROM`/`WORKDIR /app`/`COPY app/ /app/` with the local sandbox (`test_dataset_gate.py`) | refused: `<task>: environment/Dockerfile:<n>: <the instruction>: the local sandbox builds no image ...` |
| environment/ missing | `DatasetError`: `missing environment/ directory` |
| dataset dir with no task dirs (only hidden ones) | `DatasetError`: `holds no task directories` |
| two task dirs whose names collide case-folded | `DatasetError`: `duplicate task name ...` |
| dataset path that is a file | `DatasetError`: `does not exist or is not a directory` |
| a task file or dir (instruction.md, task.toml, tests/, solution/, environment/...) that is a symlink out of the task dir | `DatasetError`: `<rel> is a symlink to <target>, outside the task directory (not read)`; nothing of it read or written |
| a FIFO, socket or device in a task dir | `DatasetError`: `<rel> is a FIFO, not a regular file` (reading it would block) |
| a task dir that is a symlink out of the dataset dir | `DatasetError`: `outside the dataset directory` |
| task.toml time `inf`, `nan`, `1e300`, negative, or a time limit of 0 (agent, verifier, build, ...) | `DatasetError` naming the key: refused, not capped (a cap would change the task's contract silently) |
| **prompts jsonl** (`test_prompts_file.py`) | every error names `file:line` |
| a line that is not JSON / not an object / a JSON array | `DatasetError` `<file>:<n>: not valid JSON` / `must be a JSON object` |
| duplicate instance_id | `DatasetError` `<file>:3: duplicate instance_id `x` (first on line 1)` |
| no task_path / task_path not a string | `DatasetError` naming `task_path` |
| unknown field / metadata of the wrong type / split `test` | `DatasetError` naming the field |
| blank-only file / empty file | `DatasetError` `<file>: no prompt records` |
| non-UTF-8 file | `DatasetError` `<file>: not UTF-8 (...)` |
| file missing | `DatasetError` `<file>: prompts file not found` |
| task_path to a dir that is not a task | `DatasetError` naming that dir: `missing task.toml` (not the jsonl line) |
| **config, through the `grpoflow` CLI** (`test_config_cli.py`) | exit 2, one stderr line, output dir untouched |
| out of range: engine.embedded.threads, engine.launch.mem_fraction_static, rollout.sampling.top_p, rollout.episode.max_context_tokens, train.loss.eps_low, train.optimizer.learning_rate, prompts.max_prompts, seed | ``field `<dotted>` `` named |
| wrong type (max_turns=four, scale_by_std="maybe", engine.sglang.args a string, `train=5`) | field named |
| unknown section / unknown key (`trian.steps`, `rollout.temprature`), unknown harness or sandbox | field named |
| cross-field: sglang-launch without engine.sglang.python, sglang without url | field named |
| a credential in the config (`rollout.api_key`, `sandbox_kwargs.auth_token`) | refused, field named, value never echoed |
| local sandbox kwargs: `memory_mb` -5 / "lots" / true, `cpu_time_sec` 0, `max_output_bytes` 1.5, `process_scope` forever, an unknown key (`memroy_mb`) | ``field `rollout.sandbox.kwargs.<key>` `` named (an unknown key's value not echoed; the line lists what the sandbox takes), before anything is written |
| bad run_id (upper case, space, `../escape`, leading dash, 64 chars, underscore) | ``field `run_id` `` named, nothing created |
| `--config` not JSON / not an object / not UTF-8 / empty / missing / a directory / bad field | error names the file (and the field) |
| **model** (`test_model_dirs.py`) | `ModelError` naming the dir or file |
| HF dir without tokenizer / config.json / *.safetensors | `no tokenizer` / `no config.json` / `no *.safetensors weights` |
| tokenizer larger than the model's vocab_size | `tokenizer has N tokens but the model's vocab_size is 16` |
| config.json not JSON; tokenizer without a chat template | `cannot load config/tokenizer` / `no chat_template` |
| model.safetensors cut short / empty / garbled header / trailing bytes; an index naming a missing shard | `model.safetensors is truncated or corrupt (...)` / `names <shard>, which the dir lacks`, from the header alone, before config.json or run.json |
| corrupt GGUF; empty GGUF | `GGUF <file>: cannot read it (corrupt or unsupported)`; no cache entry left |
| a file that is not .gguf; an unknown built-in name | `a file must be a .gguf`; names the built-ins |
| **engine** (`test_engine_faults.py`, SGLang stand-in) | |
| malformed JSON / no finish_reason (client) | `EngineError`: `/generate: malformed response ...` |
| 5xx forever / dropped connection (client) | `EngineError`: `POST <url>/generate failed after 2 attempts: ...` |
| malformed `/model_info` | `EngineError` naming `/model_info` |
| each of those under the shell agent in a real trial | sample FAILED, exit AgentError, reason `EngineError: ...`, reward None, not retried, group dropped |
| **verifier** (`test_verifier_outputs.py`, oracle agent, local sandbox) | |
| reward.txt not a number / empty / `nan` / `inf` / two lines | FAILED, VerifierError (`VerifierOutputParseError` / `RewardFileEmptyError`), reward None |
| reward.json with two keys and no `reward` | FAILED, VerifierError: `reward.json has keys [...] but no `reward``, reward None |
| reward.json with a non-numeric reward / a JSON array | FAILED, VerifierError (`Non-numeric reward ...`), reward None |
| verifier exits 1 without writing a reward | FAILED, VerifierError (`RewardFileNotFoundError`), reward None, not retried |
| reward.json `{"reward": true}` | accepted as 1.0 (Harbor reads a bool as a number) |
| **a full disk** (`test_disk_full.py`, a small tmpfs, or a write that fails) | |
| the weights / the AdamW state do not fit in `save_checkpoint` | `CheckpointError`: `cannot write checkpoint <dir>: No space left on device (... KiB free ...)`; no `.step_N.tmp-<pid>/` left |
| the AdamW state of a full checkpoint does not fit (background completion) | `CheckpointError` from `flush()`; the step dir stays as published, no temp file, no metrics row |
| any other error while writing | raised as it is (not dressed as a disk error); the temp dir removed all the same |
| **run dir** (`test_run_dir.py`) | |
| run dir exists | `RunDirError`: `already exists`; its files byte-for-byte and mtime unchanged |
| bad dataset with an existing run dir | `DatasetError`; the run dir untouched |
| output_dir is a file, or below one | `RunDirError`: `output dir <dir>: <path> is a file, not a directory` (not "already exists") |
| output_dir on a read-only filesystem (a ro tmpfs; a 0555 dir as non-root) | preflight: `output dir <dir>: <path> is not writable` |
| through the CLI: run dir exists / output dir a file or below one | exit 2, one line, said before Prefect is imported |
| a bad dataset with a model that would be converted | the `DatasetError`: the dataset is validated before the model is looked at |
| **elsewhere** (they need a Prefect server of their own, or a killed run) | |
| an error inside a flow, through the real CLI with no server configured (`flows/test_command_server.py`) | the one-line error is the last line printed: the temporary server stops before it |
| `kill -9` of `grpoflow main` while preparing, in a rollout, in the update (`faults/test_kill_debris.py`) | 10 s later no process (Prefect's server, engine, sandboxes) and no sandbox dir is left |
| a HOME that does not exist (so no PREFECT_HOME), through the CLI (`flows/test_command_server.py`) | exit 2, one line naming PREFECT_HOME and the dir, before Prefect's server is started |
| a PREFECT_API_URL nothing answers | exit 2, one line naming the URL: start that server or unset it |
| SIGTERM of `grpoflow main` in a rollout (`faults/test_kill_debris.py`) | sandboxes and engine stopped; last line `run ID stopped by SIGTERM; grpoflow resume ID --output-dir D continues it`, which finishes it |
| SIGTERM of `grpoflow tasks --validate` with a sandbox running | no `grpoflow-gate-*` or sandbox dir left; last line `grpoflow: tasks stopped by SIGTERM` |
"""
