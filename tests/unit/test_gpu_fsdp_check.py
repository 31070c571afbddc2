"""bench/gpu_fsdp_check.py without a GPU: `--cpu` runs the sharded update (FSDP over a group of one, gloo) and
the sync's gather through grpoflow's FSDP module, without grpoflow's other dependencies (the device machine has
only torch and transformers), and prints the report."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = """
import runpy, sys
sys.argv = ["gpu_fsdp_check.py", "--cpu"]
try:
    runpy.run_path("bench/gpu_fsdp_check.py", run_name="__main__")
except SystemExit as e:
    loaded = {m.split(".")[0] for m in sys.modules}
    print("FOREIGN " + " ".join(sorted(loaded & {"pydantic", "harbor", "prefect", "httpx", "ray"})))
    raise
"""


def test_cpu_run_trains_a_sharded_step_with_torch_and_transformers_alone():
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "FOREIGN "  # nothing but torch, transformers (and their own dependencies) was imported
    result = json.loads(next(x for x in lines if x.startswith("RESULT ")).removeprefix("RESULT "))
    assert result["device"] == "cpu" and result["precision"] == "bf16" and result["master_dtypes"] == ["torch.float32"]
    assert result["tokens_per_s"] > 0 and 0 < result["mfu_simple"] <= result["mfu_detailed"]
    assert result["grad_norm"] > 0 and result["sync_gather_gb"] > 0
    assert "fsdp-check: cpu" in proc.stdout and "sync gather:" in proc.stdout
