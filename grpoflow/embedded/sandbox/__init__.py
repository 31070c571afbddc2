"""The local sandbox: bubblewrap on this machine, plugged into Harbor as a custom environment (`local`), with its
host processes (`processes`) and per-trial root (`rootfs`)."""

LOCAL_SANDBOX_IMPORT_PATH = "grpoflow.embedded.sandbox.local:LocalSandbox"  # Harbor's `import_path` for it
