"""The run's GPU plan is a function of the config and the machine's GPU count: the trainer and a launched engine
each get GPUs of their own, or the run is refused with one line before anything starts."""

import pytest

from grpoflow.config import parse_run_config
from grpoflow.engine import vllm_launch
from grpoflow.engine.sglang_launch import launch_settings
from grpoflow.errors import ConfigError
from grpoflow.placement import plan_gpus, visible_devices
from grpoflow.preflight import gpu_problems


def _cfg(ranks=1, tp=1, backend="sglang-launch", device="cuda", ray=""):
    engine = {"backend": backend, "tp_size": tp, "launch": {"device": device}}
    if backend == "sglang-launch":
        engine["sglang"] = {"python": "/opt/sglang/bin/python"}
    return parse_run_config({"run_id": "p", "engine": engine, "cluster": {"train_ranks": ranks, "ray_address": ray}})


def test_eight_gpus_split_between_four_trainer_ranks_and_a_tp4_engine():
    plan = plan_gpus(_cfg(ranks=4, tp=4), 8)
    assert plan.trainer == (0, 1, 2, 3) and plan.engine == (4, 5, 6, 7)
    assert plan.engine_base_gpu == 4
    assert plan.describe() == "trainer ranks on GPUs 0-3, engine on GPUs 4-7 (of 8)"
    assert plan.to_json() == {"gpus": 8, "trainer": [0, 1, 2, 3], "engine": [4, 5, 6, 7]}


def test_a_launched_engine_is_told_to_start_after_the_trainer_s_gpus(monkeypatch):
    cfg = _cfg(ranks=2, tp=2)
    args, _ = launch_settings(cfg.engine, seed=0, base_gpu_id=plan_gpus(cfg, 4).engine_base_gpu)
    assert args[args.index("--base-gpu-id") + 1] == "2"
    cpu = _cfg(device="cpu").engine
    assert "--base-gpu-id" not in launch_settings(cpu, seed=0, base_gpu_id=None)[0]
    # vLLM has no such flag: it sees only the plan's GPUs
    vllm = parse_run_config(
        {
            "run_id": "p",
            "engine": {"backend": "vllm-launch", "vllm": {"python": "/opt/vllm/bin/python"}, "tp_size": 4},
            "cluster": {"train_ranks": 4},
        }
    )
    plan = plan_gpus(vllm, 8)
    _, env = vllm_launch.launch_settings(vllm.engine, seed=0, base_gpu_id=plan.engine_base_gpu)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    # under a mask of the parent's own, the plan's GPU i is the mask's i-th: never a GPU outside the mask
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    _, env = vllm_launch.launch_settings(vllm.engine, seed=0, base_gpu_id=plan.engine_base_gpu)
    assert env["CUDA_VISIBLE_DEVICES"] == "12,13,14,15"
    assert visible_devices([1], {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == "GPU-b"
    assert visible_devices([0, 1], {}) == "0,1"


@pytest.mark.parametrize(
    ("ranks", "tp", "gpus", "message"),
    [
        (4, 8, 8, "engine.tp_size=8 beside cluster.train_ranks=4 needs 12 GPUs, this machine has 8"),
        (1, 8, 8, "engine.tp_size=8 beside cluster.train_ranks=1 needs 9 GPUs, this machine has 8"),
        (9, 1, 8, "cluster.train_ranks=9: one GPU per rank, this machine has 8"),
        (1, 1, 0, "engine.backend=sglang-launch with engine.launch.device=cuda: this machine has no GPU"),
    ],
)
def test_plans_that_put_two_parts_on_one_gpu_are_refused_with_one_line(ranks, tp, gpus, message):
    with pytest.raises(ConfigError, match=message) as err:
        plan_gpus(_cfg(ranks=ranks, tp=tp), gpus)
    assert "\n" not in str(err.value)
    assert gpu_problems(_cfg(ranks=ranks, tp=tp), gpus) == [str(err.value)]


def test_parts_that_take_none_of_this_machine_s_gpus_leave_them_to_the_trainer():
    # an attached engine has GPUs of its own; the embedded engine runs on the CPU
    assert plan_gpus(_cfg(ranks=8, backend="embedded"), 8).engine == ()
    attached = parse_run_config({"run_id": "p", "engine": {"backend": "sglang", "url": "http://h:30000"}})
    assert plan_gpus(attached, 1).trainer == (0,) and gpu_problems(attached, 1) == []
    # with Ray, only rank 0 trains here: the engine may take the rest
    plan = plan_gpus(_cfg(ranks=8, tp=7, ray="ray://head:10001"), 8)
    assert plan.trainer == (0,) and plan.engine == tuple(range(1, 8))
    # no GPU at all: everything on the CPU
    cpu = plan_gpus(_cfg(ranks=2, device="cpu"), 0)
    assert (cpu.trainer, cpu.engine) == ((), ()) and "no GPU" in cpu.describe()


def test_the_run_s_servers_listen_on_loopback_unless_other_nodes_need_them():
    from grpoflow.cluster import serve_host
    from grpoflow.config import ClusterConfig

    assert serve_host(ClusterConfig()) == "127.0.0.1"
    assert serve_host(ClusterConfig(ray_address="local")) == "127.0.0.1"  # Ray on this machine alone
    assert serve_host(ClusterConfig(ray_address="head:6379", listen_host="10.0.0.7")) == "10.0.0.7"


def test_trainer_ranks_started_here_take_the_plan_s_gpus_and_the_cpu_without_one():
    plan = plan_gpus(_cfg(ranks=4, tp=4), 8)
    assert [plan.rank_device(r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    cpu = plan_gpus(_cfg(ranks=2, backend="embedded"), 0)
    assert [cpu.rank_device(r) for r in range(2)] == ["cpu", "cpu"]
