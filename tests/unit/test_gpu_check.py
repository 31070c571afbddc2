"""bench/gpu_check.py without a GPU: the dry run goes through the real train path and prints the full report;
impossible arguments stop with one line and exit status 2."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_dry_run_trains_one_step_and_prints_the_report(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for part in ("DRY RUN on CPU", "tokens/s:", "MFU", "(6*N*T)", "of 989 TFLOP/s peak", "(finite)"):
        assert part in out, part
    result = json.loads(out.splitlines()[-1].removeprefix("RESULT "))
    assert result["dry_run"] and result["device"] == "cpu" and result["optimizer_steps"] == 1
    assert result["flops_tokens_fwd"] == 8 * 63 and result["flops_tokens_trained"] == 8 * (63 - 7)
    assert result["tokens_per_s"] > 0 and 0 < result["mfu_simple"] <= result["mfu_detailed"]


def test_peak_is_a_flag(capsys):
    assert gpu_check.main(["--dry-run", "--peak-tflops", "100"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("RESULT "))
    assert result["peak_tflops"] == 100
    assert result["mfu_simple"] == pytest.approx(result["tflops_simple"] / 100)


def test_full_size_flops_match_the_qwen2_0_5b_shape():
    # 494.0M parameters (tied); 32 x 2048 tokens -> 6 * N * T = 194.2 TFLOP per optimizer step.
    args = gpu_check.build_parser().parse_args([])
    samples = gpu_check.make_samples(args, 151936, 2048, 128, 32)
    flops = gpu_check.model_flops(gpu_check.FULL, True, 494_032_768, samples, kl=False)
    assert flops["tokens_fwd"] == 32 * 2047 and flops["tokens_trained"] == 32 * 1920
    assert flops["simple"] == pytest.approx(194.17e12, rel=1e-3)
    assert flops["simple"] < flops["detailed"] < 1.1 * flops["simple"]  # attention adds a few percent


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "5"], "--hidden 896 must split into --heads 5"),
        (["--kv-heads", "3"], "--heads 14 must be a multiple of --kv-heads 3"),
        (["--prompt-len", "2047"], "--prompt-len 2047 must be in 1..seq_len-2"),
        (["--batch", "12"], "--batch 12 must be a multiple of --group-size 8"),
        (["--micro-batch-tokens", "8"], "--micro-batch-tokens 8 must be at least 64"),
        (["--peak-tflops", "0"], "--peak-tflops and --time-budget-s must be positive"),
        (["--steps", "x"], "invalid int value: 'x'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([*argv, "--dry-run"])  # validated before the dry run shrinks anything
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the full check would run")
def test_without_a_gpu_the_full_check_refuses(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device here; --dry-run" in capsys.readouterr().err
