"""Data-parallel GRPO updates (`cluster.train_ranks`): two gloo ranks on this machine take the single process's
step — the same weights within 1e-6 and the same metrics — and a rank that dies fails the step with its cause."""

import signal
import time

import pytest
import torch

from grpoflow.config import parse_run_config
from grpoflow.train.parallel import local_rows, split_rollouts
from grpoflow.train.ranks import RankError, run_update, trainer_ranks
from grpoflow.train.trainer import load_trainer
from tests.fakes.samples import agentic_samples


def _config(tiny_model_dir, ranks, **train):
    return parse_run_config(
        {
            "run_id": "dp",
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": "builtin-fixed"},
            # Adam turns rounding in a ~0 gradient into ~lr; replicated ranks (the sharded ones: test_train_fsdp.py)
            "train": {"learning_rate": 1e-5, "sharding": "replicate", **train},
            "cluster": {"train_ranks": ranks},
        }
    )


def test_rollouts_are_split_by_tokens_and_keep_their_segments_together():
    shares = split_rollouts({"a": 50, "b": 40, "c": 30, "d": 20, "e": 5}, world=2)
    assert shares == [["a", "d", "e"], ["b", "c"]]  # 75 and 70 tokens
    assert sorted(sum(shares, [])) == ["a", "b", "c", "d", "e"]

    class Rank:  # the fields local_rows reads
        def __init__(self, rank):
            self.rank, self.world = rank, 2

    rows = ["a", "b", "a", "c"]  # rollout a in two segments
    mine = [local_rows(rows, [10, 8, 10, 3], Rank(r)) for r in (0, 1)]
    assert mine == [[0, 2], [1, 3]]
    assert local_rows(rows, [10, 8, 10, 3], None) == [0, 1, 2, 3]


# token aggregation in one minibatch; sample aggregation over 3 minibatches with the old policy recomputed; one
# rollout per minibatch (rank 1 computes nothing, yet joins every collective); LoRA adapters with a KL term
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
CASES = [
    {"loss_aggregation": "token"},
    {"loss_aggregation": "sample", "global_batch_size": 4, "old_logprobs": "recompute", "micro_batch_tokens": 64},
    {"loss_aggregation": "sample", "global_batch_size": 1},
    {"lora": LORA, "kl_coef": 0.1},
]


@pytest.mark.parametrize("train", CASES, ids=["token", "sample-minibatches-recompute", "a-rank-idle", "lora-kl"])
def test_two_ranks_take_the_single_process_step(tiny_model_dir, train):
    cfg1, cfg2 = _config(tiny_model_dir, 1, **train), _config(tiny_model_dir, 2, **train)
    alone = load_trainer(tiny_model_dir, cfg1.train, seed=0)
    samples = agentic_samples(alone.model)
    expected = run_update(alone, samples, cfg1, step=0).computed
    ranked = load_trainer(tiny_model_dir, cfg2.train, seed=0)
    with trainer_ranks(ranked, tiny_model_dir, cfg2):
        got = run_update(ranked, samples, cfg2, step=0).computed
        got_again = run_update(ranked, samples, cfg2, step=1).computed  # the workers take a second job
    assert ranked.dp is None  # rank 0 trains alone again after the block
    assert expected["optimizer_steps"] >= 1 and got["optimizer_steps"] == expected["optimizer_steps"]
    for key in ("n_samples", "n_tokens", "n_forward_tokens", "skipped_zero_advantage"):
        assert got[key] == expected[key], key
    # each rank ran part of the micro-batches, all of them together
    assert got["n_micro_batches"] >= expected["n_micro_batches"]
    for key in ("loss", "grad_norm", "clip_frac_high", "logprob_gap_mean", "entropy", "logprob_gap_max"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    before = {n: p.detach().clone() for n, p in alone.model.named_parameters()}
    second = run_update(alone, samples, cfg1, step=1).computed
    assert got_again["optimizer_steps"] == second["optimizer_steps"]
    assert any(not torch.equal(p, before[n]) for n, p in alone.model.named_parameters())  # step 1 moved them
    theirs = dict(alone.model.named_parameters())
    for name, p in ranked.model.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-6)


def test_a_rank_that_dies_fails_the_step_with_its_cause(tiny_model_dir):
    cfg = _config(tiny_model_dir, 2)
    state = load_trainer(tiny_model_dir, cfg.train, seed=0)
    samples = agentic_samples(state.model)
    with pytest.raises(RankError, match="trainer rank 1 was killed by SIGKILL"):
        with trainer_ranks(state, tiny_model_dir, cfg):
            [worker] = state.dp.workers.procs
            worker.kill()
            worker.wait()
            run_update(state, samples, cfg, step=0)
    assert state.dp is None


# SIGSTOP: the rank neither answers nor exits, and its heartbeat stops with it. Whichever bound is shorter ends the
# wait: the heartbeat's allowance (the rank is killed, which breaks the collective), or the collective's own (as for
# a rank whose heartbeat goes on while its work hangs). Either well before the other's 60 s / 600 s default.
STOPPED = {
    "failure_timeout_s": r"rank 1 sent no heartbeat for cluster.failure_timeout_s=3 s \(stopped.*: killed",
    "collective_timeout_s": r"no answer within cluster.collective_timeout_s=3 s, every rank still running",
}


@pytest.mark.parametrize("bound", sorted(STOPPED))
def test_a_stopped_rank_fails_the_step_within_the_shorter_bound(bound, tiny_model_dir):
    cfg = _config(tiny_model_dir, 2)
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={bound: 3.0})})
    state = load_trainer(tiny_model_dir, cfg.train, seed=0)
    samples = agentic_samples(state.model)
    with pytest.raises(RankError, match=STOPPED[bound]):
        with trainer_ranks(state, tiny_model_dir, cfg):
            [worker] = state.dp.workers.procs
            worker.send_signal(signal.SIGSTOP)  # the rank's group: the rank, not only its lifeline
            started = time.monotonic()
            run_update(state, samples, cfg, step=0)
    assert time.monotonic() - started < 30  # the bound, a poll and the 5 s grace for a traceback
    assert worker.poll() is not None  # killed with the block, stopped or not
    assert state.dp is None


def _fail_on_load():
    raise RuntimeError("this job cannot be read on a worker rank")


class _Unreadable:
    """Pickles fine; unpickling it (on the worker) raises."""

    def __reduce__(self):
        return (_fail_on_load, ())


def test_a_rank_that_fails_reports_its_traceback(tiny_model_dir):
    cfg = _config(tiny_model_dir, 2)
    state = load_trainer(tiny_model_dir, cfg.train, seed=0)
    with pytest.raises(RankError, match="(?s)trainer rank 1 failed:.*this job cannot be read on a worker rank"):
        with trainer_ranks(state, tiny_model_dir, cfg):
            workers = state.dp.workers
            workers.wait(workers.send("update", _Unreadable()))
    assert state.dp is None
