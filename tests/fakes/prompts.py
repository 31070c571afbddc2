"""Prompt records of the built-in tasks, by name, for tests that run trials without a prepared run."""

from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord


def builtin_prompts(*names: str) -> list[PromptRecord]:
    return [
        PromptRecord(
            instance_id=n,
            task_path=str(builtin_dataset_path() / n),
            instruction=load_task(builtin_dataset_path() / n).instruction,
        )
        for n in names
    ]
