import os
from pathlib import Path


def test_the_environment_is_the_image():
    assert Path.cwd() == Path("/workspace")
    assert os.environ["TOTAL_FILE"] == "/workspace/total.txt"


def test_total():
    assert Path("/workspace/total.txt").read_text().strip() == "47"
