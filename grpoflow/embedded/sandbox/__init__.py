"""The local sandbox: bubblewrap on this machine, plugged into Harbor as a custom environment (`local`), with its
host processes (`processes`) and per-trial root (`rootfs`)."""
