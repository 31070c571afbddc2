"""The trajectory viewer's page on hand-made trials: best and worst per group, the cut-off turn marked, text
escaped."""

from grpoflow.fileio import write_jsonl_atomic
from grpoflow.paths import RunPaths
from grpoflow.run.viewer import best_and_worst, render_viewer
from tests.fakes.samples import make_sample


def _trial(group, k, reward, status="COMPLETED", reply="ls"):
    s = make_sample(group, k, reward, status)
    s.messages = [{"role": "user", "content": "make <b>ok</b>"}, {"role": "assistant", "content": reply}]
    return s


def test_best_and_worst_with_a_trial_without_verdict():
    a, b, c = _trial("g", 0, 0.5), _trial("g", 1, 1.0), _trial("g", 2, None, "FAILED")
    assert best_and_worst([a, b, c]) == (b, c)
    assert best_and_worst([a, _trial("g", 3, 0.5)]) == (a, a)  # all alike: the first stands for them


def test_the_page_marks_the_cut_turn_and_escapes_text(tmp_path):
    trials = [_trial("g", 0, 1.0), _trial("g", 1, 0.0, "TRUNCATED", reply="touch ok && echo <cut")]
    write_jsonl_atomic(tmp_path / "details" / "step_0" / "samples.jsonl", (s.model_dump(mode="json") for s in trials))
    page = render_viewer(RunPaths(tmp_path), "r")
    assert "g-0" in page and "g-1" in page and "worst" in page
    assert "make &lt;b&gt;ok&lt;/b&gt;" in page and "<b>ok</b>" not in page
    cut = page.index("cut off here")
    assert page.rindex("touch ok &amp;&amp; echo &lt;cut", 0, cut) > page.index("g-1")


def test_a_compacted_trial_shows_all_its_segments_and_long_output_is_cut(tmp_path):
    first, second = _trial("g", 0, 1.0), _trial("g", 0, 1.0, reply="echo " + "x" * 9000)
    second.segment_index = 1
    second.messages = [{"role": "assistant", "content": "echo " + "x" * 9000}]
    write_jsonl_atomic(
        tmp_path / "details" / "step_0" / "samples.jsonl", (s.model_dump(mode="json") for s in [first, second])
    )
    page = render_viewer(RunPaths(tmp_path), "r")
    assert "(segment 0)" in page and "(segment 1)" in page and page.count("g-0") >= 1
    assert "2 generated tokens" in page  # both segments' (1 each)
    assert "more characters)" in page and "x" * 5000 not in page
