"""The built-in dataset as generated task families: from a seed, ordinary Harbor task dirs.

One fixed instance per task lets a policy memorise one command per task (`echo … > file` solved two of the old
hand-written tasks, and the policy then wrote it everywhere). Here each family (write a given text to a given
path, copy a file, count lines, ...) has `INSTANCES` instances whose file names, paths, contents and wording are
drawn from the seed, and no two instances of a family share the parameters that decide the answer (`Family.key`),
so no one command solves a family. Each instance declares its family (`[metadata].family`), so the split by
family holds some families wholly unseen and some instances of trained families out.

The output is a plain dataset dir (task.toml, instruction.md, environment/, tests/test.sh, solution/solve.sh),
loaded and gated like any other. `generate` is a function of the seed and `VERSION` only (same seed: the same
bytes), and writes under a cache dir keyed by both, once. A family is data: its wordings, files, oracle and
checks are templates (`str.format` over the instance's parameters), drawn by a few lines of `draw`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpoflow.fileio import publish_dir
from grpoflow.prepare.tree import Stop, Tree, Unknown, same_text
from grpoflow.samples import PASS

# Bump whenever what `generate` writes for a seed changes: the cache is keyed by it, and a run's dataset hash too.
VERSION = 5
INSTANCES = 4  # per family; the main job evaluates every instance, so this sets its evaluation's cost
MAX_DRAWS = 1000  # per family: far more than its pools need for `INSTANCES` distinct instances

Params = dict[str, str]

# Pools the instances draw from: plain lowercase words, so a path or text never needs shell quoting and sorts the
# same in every locale.
STEMS = ("notes", "report", "todo", "draft", "summary", "agenda", "ideas", "memo", "letter", "plan", "log", "list")
EXTS = ("txt", "md", "log", "dat")
DIRS = ("out", "build", "results", "archive", "backup", "cache", "tmp", "logs", "reports", "data")
WORDS = (
    "apple", "banana", "cherry", "delta", "echo", "falcon", "garden", "harbor", "island", "jungle", "kettle",
    "lemon", "marble", "nickel", "orange", "pepper", "quartz", "river", "salmon", "tiger", "violet", "walnut",
    "yellow", "zebra",
)  # fmt: skip
CITIES = ("paris", "oslo", "lima", "cairo", "tokyo", "delhi", "quito", "rome", "bern", "kyiv")
COLUMNS = {  # CSV column -> its values
    "name": ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"),
    "city": CITIES,
    "team": ("red", "blue", "green", "gold", "gray"),
    "fruit": ("apple", "pear", "plum", "fig", "kiwi", "lime"),
    "age": tuple(str(n) for n in range(19, 70, 7)),
}


def _file(rng: random.Random) -> str:
    return f"/app/{rng.choice(STEMS)}.{rng.choice(EXTS)}"


def _two_files(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(STEMS, 2)
    return f"/app/{a}.{rng.choice(EXTS)}", f"/app/{b}.{rng.choice(EXTS)}"


def _lines(rng: random.Random, n: int) -> str:
    return "".join(f"{w}\n" for w in rng.sample(WORDS, n))


def _sentence_lines(rng: random.Random, n: int) -> str:
    return "".join(" ".join(rng.choices(WORDS, k=rng.randint(2, 5))) + "\n" for _ in range(n))


@dataclass(frozen=True)
class Family:
    """One task family. Templates are `str.format`ted with the instance's parameters (`draw`); file templates
    map a path under `environment/app/` (what the agent finds in /app) or `tests/` (the verifier's expected
    answers, out of the agent's reach) to the file's text."""

    name: str
    difficulty: str
    category: str
    description: str
    wordings: tuple[str, ...]  # the instruction, one wording drawn per instance
    draw: Callable[[random.Random], Params]
    key: tuple[str, ...]  # the parameters that decide the answer: no two instances share any one of them
    checks: str  # verifier lines after the common head (`need_file`, `same_text`, `fail`, `finish`)
    solve: str  # the oracle's commands
    # `solve` and `checks` again, in Python (`grpoflow.prepare.tree`): what the oracle does to the files, and the
    # reward the verifier gives them; the leak check runs one instance's effect under another's grade.
    effect: Callable[[Tree, Params], None]
    grade: Callable[[Tree, Params], float]
    app: Mapping[str, str] = field(default_factory=dict)
    tests: Mapping[str, str] = field(default_factory=dict)


def _draw_write(rng: random.Random) -> Params:
    return {"path": _file(rng), "text": " ".join(rng.sample(WORDS, rng.randint(1, 3)))}


def _draw_dir(rng: random.Random) -> Params:
    parts = rng.sample(DIRS, rng.randint(1, 2))
    return {"path": "/app/" + "/".join(parts)}


def _draw_empty(rng: random.Random) -> Params:
    return {
        "path": f"/app/{rng.choice(('done', 'ready', 'ok', 'finished', 'lock', 'flag'))}{rng.choice(('', '.txt', '.flag'))}"
    }


def _draw_pair(rng: random.Random) -> Params:
    src, dst = _two_files(rng)
    return {"src": src, "dst": dst, "src_name": Path(src).name, "body": _sentence_lines(rng, rng.randint(2, 5))}


def _draw_delete(rng: random.Random) -> Params:
    junk, keep = _two_files(rng)
    return {
        "junk": junk, "keep": keep, "junk_name": Path(junk).name, "keep_name": Path(keep).name,
        "junk_body": _sentence_lines(rng, 2), "keep_body": _sentence_lines(rng, 3),
    }  # fmt: skip


def _draw_script(rng: random.Random) -> Params:
    name = f"{rng.choice(('run', 'start', 'build', 'check', 'deploy', 'greet', 'setup', 'clean'))}.sh"
    return {"path": f"/app/{name}", "name": name, "word": rng.choice(WORDS)}


def _draw_count(rng: random.Random) -> Params:
    src, out = _two_files(rng)
    n = rng.randint(3, 14)
    return {"src": src, "out": out, "src_name": Path(src).name, "body": _lines(rng, n), "count": str(n)}


def _draw_words(rng: random.Random) -> Params:
    src, out = _two_files(rng)
    body = _sentence_lines(rng, rng.randint(2, 5))
    return {"src": src, "out": out, "src_name": Path(src).name, "body": body, "count": str(len(body.split()))}


def _draw_sort(rng: random.Random) -> Params:
    src, out = _two_files(rng)
    words = rng.sample(WORDS, rng.randint(4, 8))
    return {
        "src": src, "out": out, "src_name": Path(src).name,
        "body": "".join(f"{w}\n" for w in words), "sorted": "".join(f"{w}\n" for w in sorted(words)),
    }  # fmt: skip


def _draw_column(rng: random.Random) -> Params:
    src, out = _two_files(rng)
    src = src.rsplit(".", 1)[0] + ".csv"
    columns = rng.sample(sorted(COLUMNS), 3)
    col = rng.choice(columns)
    rows = [[rng.choice(COLUMNS[c]) for c in columns] for _ in range(rng.randint(3, 6))]
    return {
        "src": src, "out": out, "src_name": Path(src).name, "col": col, "header": ",".join(columns),
        "field": str(columns.index(col) + 1),
        "body": ",".join(columns) + "\n" + "".join(",".join(r) + "\n" for r in rows),
        "expected": "".join(r[columns.index(col)] + "\n" for r in rows),
    }  # fmt: skip


def _draw_replace(rng: random.Random) -> Params:
    path = _file(rng)
    old, new = rng.sample(WORDS, 2)
    # Filler words that hold neither word, so `sed s/old/new/g` and the expected text agree on every line.
    filler = tuple(w for w in WORDS if old not in w and new not in w)
    lines = [rng.choices(filler, k=3) for _ in range(rng.randint(3, 5))]
    for line in rng.sample(lines, 2):
        line.insert(rng.randint(0, len(line)), old)
    body = "".join(" ".join(line) + "\n" for line in lines)
    return {
        "path": path, "name": Path(path).name, "old": old, "new": new,
        "body": body, "expected": body.replace(old, new),
    }  # fmt: skip


# Ways a one-line script can be broken that a shell reports when it runs it: a misspelled command, an unclosed
# quote, a missing redirection target directory.
_BUGS = (
    "ecoh {word} > {out}",
    "ehco {word} > {out}",
    'echo "{word} > {out}',
    "echo {word} > {out_dir}/missing/{out_name}",
)


def _draw_fix(rng: random.Random) -> Params:
    out = _file(rng)
    params = {
        "path": f"/app/{rng.choice(('write', 'make', 'save', 'emit', 'produce', 'store'))}_{Path(out).stem}.sh",
        "out": out, "out_dir": str(Path(out).parent), "out_name": Path(out).name, "word": rng.choice(WORDS),
    }  # fmt: skip
    params["bug"] = rng.choice(_BUGS).format(**params)
    params["path_name"] = Path(params["path"]).name
    return params


# Each family's oracle (`solve`) and verifier (`checks`) in Python, over a `Tree`. An effect raises `Stop` where
# the shell command fails (the oracle's `set -e`); a grade returns the reward `finish` would write.


def _grade_write(t: Tree, p: Params) -> float:
    return float(t.is_file(p["path"]) and same_text(t, p["path"], p["text"]))


def _grade_dir(t: Tree, p: Params) -> float:
    return float(t.is_dir(p["path"]))


def _grade_empty(t: Tree, p: Params) -> float:
    return float(t.is_file(p["path"]) and t.read(p["path"]) == "")


def _grade_delete(t: Tree, p: Params) -> float:
    return float(not t.exists(p["junk"]) and t.is_file(p["keep"]) and same_text(t, p["keep"], p["keep_body"]))


def _grade_copy(t: Tree, p: Params) -> float:
    if not (t.is_file(p["dst"]) and same_text(t, p["dst"], p["body"])):
        return 0.0
    return 1.0 if t.is_file(p["src"]) and same_text(t, p["src"], p["body"]) else 0.5


def _grade_rename(t: Tree, p: Params) -> float:
    if not (t.is_file(p["dst"]) and same_text(t, p["dst"], p["body"])):
        return 0.0
    return 0.5 if t.exists(p["src"]) else 1.0


def _script(p: Params) -> str:
    return f"#!/bin/sh\necho {p['word']}\n"


def _grade_executable(t: Tree, p: Params) -> float:
    path = p["path"]
    return float(t.is_file(path) and t.read(path) == _script(p) and path in t.executable)


def _grade_count(t: Tree, p: Params, partial: bool = True) -> float:
    if not t.is_file(p["out"]):
        return 0.0
    text = t.read(p["out"])
    if "".join(text.split()) == p["count"]:
        return 1.0
    first = text.split("\n", 1)[0].split()
    return 0.5 if partial and first[:1] == [p["count"]] else 0.0


def _grade_sort(t: Tree, p: Params) -> float:
    return float(t.is_file(p["out"]) and same_text(t, p["out"], p["sorted"]))


def _grade_column(t: Tree, p: Params) -> float:
    if not t.is_file(p["out"]):
        return 0.0
    if same_text(t, p["out"], p["expected"]):
        return 1.0
    head, _, rest = t.read(p["out"]).partition("\n")
    return 0.5 if head == p["col"] and rest.rstrip("\n") == p["expected"].rstrip("\n") else 0.0


def _grade_replace(t: Tree, p: Params) -> float:
    return float(t.is_file(p["path"]) and same_text(t, p["path"], p["expected"]))


def _fixed_script(p: Params) -> str:
    return f"#!/bin/sh\necho {p['word']} > {p['out']}\n"


def _grade_fix(t: Tree, p: Params) -> float:
    """The verifier runs the script: modelled for the two scripts this family writes, the broken one (fails) and
    the oracle's shape (`echo <word> > <file>`, which fails without the file's directory)."""
    if not t.is_file(p["path"]):
        return 0.0
    if t.is_file(p["out"]):  # `rm -f`: a directory stays
        t.remove_file(p["out"])
    script = t.read(p["path"])
    if script == f"#!/bin/sh\n# Writes a word to a file.\n{p['bug']}\n":
        return 0.0
    head, command, *more = script.split("\n")
    words = command.split()
    if head != "#!/bin/sh" or more != [""] or len(words) != 4 or words[0] != "echo" or words[2] != ">":
        raise Unknown(f"{p['path']}: a script this model does not run")
    target = words[3] if words[3].startswith("/") else f"/app/{words[3]}"
    try:
        t.write(target, words[1] + "\n")
    except Stop:
        return 0.0
    return float(t.is_file(p["out"]) and same_text(t, p["out"], p["word"]))


def _sort_lines(text: str) -> str:
    lines = text.splitlines()
    if sorted(lines) != sorted(lines, key=lambda line: line.replace(" ", "")):
        raise Unknown("lines whose order depends on the locale")  # a collating locale skips blanks
    return "".join(f"{line}\n" for line in sorted(lines))


def _cut_field(text: str, field_no: int) -> str:
    """`tail -n +2 | cut -d, -f<field_no>`: a line without a comma passes whole, a short one gives nothing."""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split(",")
        out.append(line if len(parts) == 1 else parts[field_no - 1] if field_no <= len(parts) else "")
    return "".join(f"{line}\n" for line in out)


def _effect_sort(t: Tree, p: Params) -> None:
    t.write(p["out"], "")  # the shell truncates `> out` before sort reads its input
    t.write(p["out"], _sort_lines(t.read(p["src"])))


def _effect_column(t: Tree, p: Params) -> None:
    if p["out"] == p["src"]:
        raise Unknown("a pipeline reading the file it truncates")
    t.write(p["out"], "")
    t.write(p["out"], _cut_field(t.read(p["src"]), int(p["field"])))


def _effect_replace(t: Tree, p: Params) -> None:
    t.write(p["path"], t.read(p["path"]).replace(p["old"], p["new"]))


def _count_lines(text: str) -> str:
    return f"{text.count(chr(10))}\n"


def _count_words(text: str) -> str:
    return f"{len(text.split())}\n"


# fmt: off
FAMILIES: tuple[Family, ...] = (
    Family(
        "write-text", "easy", "file", "Write a given text to a given file.",
        ("Write the text `{text}` to the file `{path}`.",
         "Create the file `{path}` holding exactly the line `{text}`.",
         "Put the words `{text}` into a new file at `{path}`."),
        _draw_write, ("path", "text"),
        'need_file {path}\nsame_text {path} /tests/expected.txt || fail "{path} does not hold exactly: {text}"\n'
        "finish 1",
        "printf '%s\\n' '{text}' > {path}",
        lambda t, p: t.write(p["path"], p["text"] + "\n"), _grade_write,
        tests={"expected.txt": "{text}\n"},
    ),
    Family(
        "make-dir", "easy", "file", "Create a given directory.",
        ("Create the directory `{path}`.",
         "Make a directory at `{path}` (with any missing parent directories).",
         "The directory `{path}` must exist: create it."),
        _draw_dir, ("path",),
        '[ -d {path} ] && [ ! -L {path} ] || fail "{path} is missing or not a directory"\nfinish 1',
        "mkdir -p {path}",
        lambda t, p: t.mkdir_p(p["path"]), _grade_dir,
    ),
    Family(
        "empty-file", "easy", "file", "Create a given empty file.",
        ("Create an empty file named `{path}`.",
         "Make a new, empty file at `{path}`.",
         "There must be an empty file `{path}`: create it."),
        _draw_empty, ("path",),
        # A file with text in it earns nothing: `echo ... > {path}` solves other families, and any share of the
        # reward for it here draws every family toward that one command.
        'need_file {path}\n[ -s {path} ] && fail "{path} is not empty"\nfinish 1',
        "touch {path}",
        lambda t, p: t.touch(p["path"]), _grade_empty,
    ),
    Family(
        "delete-file", "easy", "file", "Delete one file and keep the others.",
        ("Delete the file `{junk}`. Leave the other files in `/app` alone.",
         "Remove `{junk}`; do not touch `{keep}`.",
         "`{junk}` is no longer needed: delete it, and keep every other file in `/app`."),
        _draw_delete, ("junk",),
        '{{ [ -e {junk} ] || [ -L {junk} ]; }} && fail "{junk} still exists"\nneed_file {keep}\n'
        'same_text {keep} /tests/{keep_name} || fail "{keep} was changed"\nfinish 1',
        "rm -f {junk}",
        lambda t, p: t.remove_file(p["junk"]), _grade_delete,
        app={"{junk_name}": "{junk_body}", "{keep_name}": "{keep_body}"},
        tests={"{keep_name}": "{keep_body}"},
    ),
    Family(
        "copy-file", "easy", "file", "Copy a file to a new name.",
        ("Copy the file `{src}` to `{dst}`.",
         "Make a copy of `{src}` named `{dst}`, keeping the original.",
         "Duplicate `{src}` as `{dst}`."),
        _draw_pair, ("src", "dst"),
        'need_file {dst}\nsame_text {dst} /tests/{src_name} || fail "{dst} differs from the original {src}"\n'
        # A copy keeps the original; moving it away does only half the task.
        "[ -f {src} ] && same_text {src} /tests/{src_name} && finish 1\n"
        'echo "FAIL: {src} is gone or changed"\nfinish 0.5',
        "cp {src} {dst}",
        lambda t, p: t.copy(p["src"], p["dst"]), _grade_copy,
        app={"{src_name}": "{body}"},
        tests={"{src_name}": "{body}"},
    ),
    Family(
        "rename-file", "easy", "file", "Rename a file.",
        ("Rename the file `{src}` to `{dst}`.",
         "Move `{src}` to the new name `{dst}`.",
         "`{src}` should be called `{dst}` from now on: rename it."),
        _draw_pair, ("src", "dst"),
        'need_file {dst}\nsame_text {dst} /tests/{src_name} || fail "{dst} does not hold the text of {src}"\n'
        '{{ [ -e {src} ] || [ -L {src} ]; }} && {{ echo "FAIL: {src} still exists"; finish 0.5; }}\nfinish 1',
        "mv {src} {dst}",
        lambda t, p: t.move(p["src"], p["dst"]), _grade_rename,
        app={"{src_name}": "{body}"},
        tests={"{src_name}": "{body}"},
    ),
    Family(
        "make-executable", "easy", "shell", "Make a script executable.",
        ("Make the script `{path}` executable.",
         "Give `{path}` execute permission so it can be run as a program.",
         "`{path}` cannot be run yet: make it executable without changing its contents."),
        _draw_script, ("path",),
        'need_file {path}\ncmp -s {path} /tests/{name} || fail "{path} was modified"\n'
        '[ -x {path} ] || fail "{path} is not executable"\nfinish 1',
        "chmod +x {path}",
        lambda t, p: t.chmod_x(p["path"]), _grade_executable,
        app={"{name}": "#!/bin/sh\necho {word}\n"},
        tests={"{name}": "#!/bin/sh\necho {word}\n"},
    ),
    Family(
        "count-lines", "medium", "text", "Count the lines of a file.",
        ("The file `{src}` has several lines. Write the number of lines in it to `{out}` (only the number).",
         "How many lines does `{src}` have? Write just that number to `{out}`.",
         "Count the lines of `{src}` and save the count, and nothing else, in `{out}`."),
        _draw_count, ("count",),
        'need_file {out}\ngot="$(tr -d \'[:space:]\' < {out})"\n[ "$got" = "{count}" ] && finish 1\n'
        'first="$(awk \'NR == 1 {{ print $1 }}\' {out})"\n'
        '[ "$first" = "{count}" ] && {{ echo "FAIL: right count but extra text"; finish 0.5; }}\n'
        'fail "{out} holds \'$got\', expected {count}"',
        "wc -l < {src} > {out}",
        lambda t, p: t.write(p["out"], _count_lines(t.read(p["src"]))), _grade_count,
        app={"{src_name}": "{body}"},
    ),
    Family(
        "count-words", "medium", "text", "Count the words of a file.",
        ("Write the number of words in `{src}` to `{out}` (only the number).",
         "How many words does `{src}` hold? Write just that number to `{out}`.",
         "Count the words of `{src}` and save the count, and nothing else, in `{out}`."),
        _draw_words, ("count",),
        'need_file {out}\ngot="$(tr -d \'[:space:]\' < {out})"\n[ "$got" = "{count}" ] && finish 1\n'
        'fail "{out} holds \'$got\', expected {count}"',
        "wc -w < {src} > {out}",
        lambda t, p: t.write(p["out"], _count_words(t.read(p["src"]))), lambda t, p: _grade_count(t, p, partial=False),
        app={"{src_name}": "{body}"},
    ),
    Family(
        "sort-lines", "medium", "text", "Sort the lines of a file.",
        ("Sort the lines of `{src}` in alphabetical order and write the result to `{out}`.",
         "Write the lines of `{src}`, sorted alphabetically, to `{out}`.",
         "`{out}` should hold the lines of `{src}` in alphabetical order: create it."),
        _draw_sort, ("body",),
        'need_file {out}\nsame_text {out} /tests/expected.txt || fail "{out} is not the sorted lines of {src}"\n'
        "finish 1",
        "sort {src} > {out}",
        _effect_sort, _grade_sort,
        app={"{src_name}": "{body}"},
        tests={"expected.txt": "{sorted}"},
    ),
    Family(
        "extract-column", "medium", "text", "Extract one column of a CSV file.",
        ("`{src}` is a CSV file with the header `{header}`. Write the values of the `{col}` column (without the "
         "header), one per line and in the same order, to `{out}`.",
         "From the CSV file `{src}` (header `{header}`), write the `{col}` column's values, without the header "
         "line, one per line, to `{out}`."),
        _draw_column, ("col",),
        'need_file {out}\nsame_text {out} /tests/expected.txt && finish 1\n'
        'if [ "$(head -n 1 {out})" = "{col}" ] && [ "$(tail -n +2 {out})" = "$(cat /tests/expected.txt)" ]; then\n'
        '    echo "FAIL: the header line \'{col}\' was kept"\n    finish 0.5\nfi\n'
        'fail "{out} is not the {col} column"',
        "tail -n +2 {src} | cut -d, -f{field} > {out}",
        _effect_column, _grade_column,
        app={"{src_name}": "{body}"},
        tests={"expected.txt": "{expected}"},
    ),
    Family(
        "replace-word", "medium", "text", "Replace a word in a file.",
        ("Replace every occurrence of the word `{old}` with `{new}` in the file `{path}` (edit the file in place).",
         "In `{path}`, change each `{old}` to `{new}`, editing the file in place.",
         "Edit `{path}` so that every `{old}` becomes `{new}`."),
        _draw_replace, ("old", "new"),
        'need_file {path}\nsame_text {path} /tests/expected.txt || fail "{path} still has {old} or lost text"\n'
        "finish 1",
        "sed -i 's/{old}/{new}/g' {path}",
        _effect_replace, _grade_replace,
        app={"{name}": "{body}"},
        tests={"expected.txt": "{expected}"},
    ),
    Family(
        "fix-script", "medium", "shell", "Fix a small script that fails.",
        ("The script `{path}` should write the word `{word}` to `{out}`, but it fails. Fix the script.",
         "Running `sh {path}` fails; it is meant to write `{word}` into `{out}`. Repair it.",
         "`{path}` is broken: make it work, so that running it writes `{word}` to `{out}`."),
        _draw_fix, ("path", "out"),
        # The verifier runs the script itself, with no output file left from the agent's own runs.
        'need_file {path}\nrm -f {out}\n(cd /app && timeout 10 sh {path}) > /dev/null 2>&1 || '
        'fail "{path} still fails"\nneed_file {out}\n'
        '[ "$(cat {out})" = "{word}" ] || fail "running {path} does not write {word} to {out}"\nfinish 1',
        "printf '%s\\n' '#!/bin/sh' 'echo {word} > {out}' > {path}",
        lambda t, p: t.write(p["path"], _fixed_script(p)), _grade_fix,
        app={"{path_name}": "#!/bin/sh\n# Writes a word to a file.\n{bug}\n"},
    ),
)
# fmt: on

# The verifier's common head, as the hand-written tasks have it.
_VERIFIER_HEAD = """\
#!/bin/bash
# Verifier of a generated "{family}" task (grpoflow.prepare.families).
# `set -u`, not `set -e`: a failed check must end in reward 0, never in an exit that leaves no reward.
set -u
mkdir -p /logs/verifier
# Reward 0 goes down first, so a crash or early exit below still leaves a valid score.
echo 0 > /logs/verifier/reward.txt
# Harbor reads reward.json in preference to reward.txt: never let one the agent planted win.
rm -f /logs/verifier/reward.json

finish() {{
    rm -f /logs/verifier/reward.json
    echo "$1" > /logs/verifier/reward.txt
    echo "reward: $1"
    exit 0
}}
fail() {{ echo "FAIL: $*"; finish 0; }}
# A regular file, not a symlink: a link could point at an expected answer under /tests.
need_file() {{ [ -f "$1" ] && [ ! -L "$1" ] || fail "$1 is missing or not a regular file"; }}
# Equal text up to trailing newlines ($(...) strips them on both sides).
same_text() {{ [ "$(cat -- "$1")" = "$(cat -- "$2")" ]; }}

"""
_SOLVE_HEAD = """\
#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
"""
_TASK_TOML = """\
schema_version = "1.4"

[metadata]
description = "{description}"
difficulty = "{difficulty}"
category = "{category}"
family = "{family}"
tags = ["grpoflow-builtin", "generated"]
generator_version = {version}

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
network_mode = "no-network"
workdir = "/app"
cpus = 1
memory_mb = 2048
"""
_README = """\
# {family}

Generated by `grpoflow.prepare.families` (family `{family}`, generator version {version}).
Input files: the agent needs the files under `environment/app/` in `/app` when it starts; the grpoflow sandbox
copies them there, and `environment/Dockerfile` does the same for docker users. The verifier reads its expected
answers from `tests/`, never from `/app`.
"""


def start_tree(family: Family, params: Params) -> Tree:
    """The files an instance's agent starts with, as its family's model sees them."""
    fmt = {**params, "family": family.name, "version": VERSION}
    return Tree.of({f"/app/{k.format(**fmt)}": v.format(**fmt) for k, v in family.app.items()})


def solves(a: tuple[Family, Params], b: tuple[Family, Params]) -> bool:
    """Whether instance `a`'s oracle, run in instance `b`'s sandbox, passes `b`'s verifier (by the families'
    models; a case the model cannot tell counts as a pass)."""
    tree = start_tree(*b)
    try:
        a[0].effect(tree, a[1])
    except Stop:
        pass  # the oracle ends there; what it wrote before stays
    except Unknown:
        return True
    try:
        return b[0].grade(tree, b[1]) >= PASS
    except Unknown:
        return True


def leaks(a: tuple[Family, Params], b: tuple[Family, Params]) -> bool:
    """Whether either instance's oracle solves the other's task: a policy trained on one would pass the other
    with the same command, so the two cannot stand on both sides of a split."""
    return solves(a, b) or solves(b, a)


def check_model(name: str, family: Family, params: Params) -> None:
    """An instance's own oracle passes its model and the untouched files do not: else the family's model (or its
    templates) is wrong, and the leak check with it."""
    tree = start_tree(family, params)
    if family.grade(tree, params) >= PASS:
        raise ValueError(f"{name}: the untouched files pass family {family.name}'s model of its verifier")
    if not solves((family, params), (family, params)):
        raise ValueError(f"{name}: its oracle does not pass family {family.name}'s model of its verifier")


def instances(seed: int) -> dict[str, tuple[Family, Params]]:
    """Task name -> (its family, its parameters): `INSTANCES` per family, drawn from `seed` alone, each family
    from a stream of its own and in `FAMILIES` order (so adding a family at the end does not change the others'
    instances). A draw that shares a key with an earlier instance of its family, or leaks with an earlier instance
    of its category (`leaks`: near-sibling families share a category), is drawn again."""
    out: dict[str, tuple[Family, Params]] = {}
    for family in FAMILIES:
        rng = random.Random(f"{seed}:{family.name}")
        seen: set[tuple[str, str]] = set()
        n = 0
        for _ in range(MAX_DRAWS):
            params = family.draw(rng) | {"wording": str(rng.randrange(len(family.wordings)))}
            key = {(k, params[k]) for k in family.key}
            if key & seen:
                continue  # the pools are large enough that a fresh draw soon differs in every key
            if any(leaks((family, params), other) for other in out.values() if other[0].category == family.category):
                continue
            seen |= key
            n += 1
            check_model(f"{family.name}-{n}", family, params)
            out[f"{family.name}-{n}"] = (family, params)
            if n == INSTANCES:
                break
        else:  # a family whose pools are too small must fail here, not hang prepare
            raise ValueError(f"family {family.name}: {MAX_DRAWS} draws gave {n} of {INSTANCES} distinct instances")
    return out


def task_files(family: Family, params: Params) -> dict[str, str]:
    """One instance's files: path relative to its task dir -> text."""
    fmt = {**params, "family": family.name, "version": VERSION}
    files = {
        "task.toml": _TASK_TOML.format(
            description=family.description, difficulty=family.difficulty, category=family.category, **fmt
        ),
        "instruction.md": family.wordings[int(params["wording"])].format(**fmt) + "\n",
        "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n"
        + ("COPY app/ /app/\n" if family.app else ""),
        "tests/test.sh": _VERIFIER_HEAD.format(**fmt) + family.checks.format(**fmt) + "\n",
        "solution/solve.sh": _SOLVE_HEAD + family.solve.format(**fmt) + "\n",
    }
    if family.app:
        files["README.md"] = _README.format(**fmt)
    files |= {f"environment/app/{k.format(**fmt)}": v.format(**fmt) for k, v in family.app.items()}
    files |= {f"tests/{k.format(**fmt)}": v.format(**fmt) for k, v in family.tests.items()}
    return files


def write_tasks(root: Path, seed: int) -> None:
    """Write every instance's task dir under the dir `root`."""
    for name, (family, params) in instances(seed).items():
        write_task(root / name, task_files(family, params))


def write_task(task_dir: Path, files: Mapping[str, str]) -> None:
    """One task dir from `task_files`' output."""
    task_dir = task_dir.resolve()
    for rel, text in files.items():
        path = (task_dir / rel).resolve()
        # A dataset's files stay inside their task dir, generated ones too (a parameter is never a path out).
        if not path.is_relative_to(task_dir):
            raise ValueError(f"{task_dir.name}: generated file {rel} lies outside its task dir")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        # Modes set, not left to the umask: the same seed gives the same tree. Harbor runs both scripts by path.
        path.chmod(0o755 if rel in ("tests/test.sh", "solution/solve.sh") else 0o644)


def generate(seed: int, cache_dir: Path) -> Path:
    """The dataset dir of `seed`'s instances, `<cache_dir>/families/v<VERSION>-seed<seed>`, written on first use
    and published by one rename, so a concurrent or interrupted run never sees half of it."""
    dest = Path(cache_dir) / "families" / f"v{VERSION}-seed{seed}"
    if not dest.is_dir():
        with publish_dir(dest) as tmp:
            write_tasks(tmp, seed)
    return dest
