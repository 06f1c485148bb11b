"""The README and docs/ say what is true: every Python block runs as pasted and prints or asserts
what the page says, every relative link resolves, every flag of a command exists, and the commands
meant to be pasted in order train into folders of their own."""

import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages whose Python blocks run here (the others hold results, not code to paste).
RUNNABLE = [README, DOCS / "usage.md"]
# The pages written as the user guide: their commands are checked against the parsers.
GUIDE_PAGES = ("usage.md", "language-models.md", "distributed.md", "results.md", "speed.md", "modules.md",
               "gpu.md")
GUIDE = [README, *(DOCS / name for name in GUIDE_PAGES)]

# A Python block, optionally followed by the ```text block of what it prints.
BLOCK = re.compile(r"```python\n(.*?)```(?:\n\n```text\n(.*?)```)?", re.S)


def _blocks(page: Path) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


CASES = [pytest.param(code, expected, id=f"{page.name}-{i + 1}")
         for page in RUNNABLE for i, (code, expected) in enumerate(_blocks(page))]


def test_the_pages_have_python_blocks():
    assert len(_blocks(README)) >= 3
    assert len(_blocks(DOCS / "usage.md")) >= 6


@pytest.mark.parametrize(("code", "expected"), CASES)
def test_block_prints_what_the_page_says(code, expected):
    """Each block on its own in a fresh namespace; it checks something: the output shown after it,
    or its own asserts."""
    checks = expected is not None or re.search(r"^assert ", code, re.M)
    assert checks, "a block must assert or show its output"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "page block", "exec"), {"__name__": "__main__"})
    finally:
        torch.set_num_threads(threads)
    if expected is not None:
        assert out.getvalue() == expected


def test_readme_starts_with_the_offline_sample_command_and_no_shared_folder():
    top = README.read_text(encoding="utf-8").split("## ")[0]
    assert 'pip install torch==2.13.0 -e ".[bench]" && rnndrop-lm ptb --data sample' in top
    assert 'pip install torch==2.13.0 -e ".[test]" && ruff check . && python -m pytest -n auto\n' in top
    assert "../shared" not in top and "shared/data" not in top
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'torch==2.13.0 -e ".[test]" && ruff check . && python -m pytest -n auto\n' in ci


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150


# --- links -----------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target!r}: no such file"
        if anchor:
            assert anchor in _anchors(file), f"{page.name}: link to {target!r}: no such heading"


# --- commands --------------------------------------------------------------------------------

def _commands(page: Path, *, inline: bool) -> list[list[str]]:
    """The commands of a page's bash blocks (continuations joined, comments dropped, `&&` split),
    and with ``inline`` also those in `code spans`; each as its words."""
    text = page.read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            lines += line.split(" #")[0].split("&&")
    if inline:
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    return [_words(line) for line in lines if line.strip()]


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line.replace("*", "x"))
    except ValueError:  # prose in a code span, e.g. an apostrophe
        return line.split()


def _program(words: list[str]) -> tuple[str, list[str]] | None:
    """('rnndrop-lm' or a script path, its arguments), for the commands this repository provides."""
    for i, word in enumerate(words):
        if word == "rnndrop-lm":
            return "rnndrop-lm", words[i + 1:]
        if word == "-m" and words[i + 1:i + 2] == ["rnndrop.lm"]:
            return "rnndrop-lm", words[i + 2:]
        if re.fullmatch(r"(benchmarks|examples)/\w+\.py", word):
            if word in ("benchmarks/ptb.py", "benchmarks/wikitext2.py"):
                return "rnndrop-lm", [Path(word).stem, *words[i + 1:]]
            return word, words[i + 1:]
    return None


def _help(argv: list[str], script: str | None, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [script or "rnndrop-lm", *argv, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        if script is None:
            runpy.run_module("rnndrop.lm", run_name="__main__", alter_sys=False)
        else:
            runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_flag_of_a_command_exists(monkeypatch, capsys):
    helps: dict[tuple[str, str], str] = {}
    checked = 0
    for page in GUIDE:
        for words in _commands(page, inline=True):
            found = _program(words)
            if found is None:
                continue
            program, args = found
            sub = args[0] if program == "rnndrop-lm" and args and not args[0].startswith("-") else ""
            if (program, sub) not in helps:
                script = None if program == "rnndrop-lm" else program
                helps[program, sub] = _help([sub] if sub else [], script, monkeypatch, capsys)
            for flag in (arg.split("=")[0] for arg in args if arg.startswith("--")):
                assert re.search(re.escape(flag) + r"(?![\w-])", helps[program, sub]), \
                    f"{page.name}: {program} {sub} has no flag {flag} ({' '.join(words)})"
                checked += 1
    assert checked >= 40 and ("rnndrop-lm", "evaluate") in helps and ("benchmarks/speed.py", "") in helps


def _out_folder(args: list[str]) -> str:
    """Where `rnndrop-lm ptb|wikitext2 ARGS` writes: --out, else runs/<corpus>[-sample]-<config>."""
    def value(flag: str, default: str | None) -> str | None:
        return args[args.index(flag) + 1] if flag in args else default

    corpus = {"ptb": "ptb", "wikitext2": "wikitext-2"}[args[0]]
    sample = "-sample" if value("--data", None) == "sample" else ""
    return value("--out", f"runs/{corpus}{sample}-{value('--config', 'mini')}")


def test_commands_pasted_in_order_train_into_folders_of_their_own():
    """Two different training commands never share an output folder (the second would stop at once,
    or with --resume continue the other job); a trained run that a page uses was trained by one."""
    jobs: dict[str, set[str]] = {}
    used = []
    for page in GUIDE:
        for words in _commands(page, inline=False):
            found = _program(words)
            if found is None or found[0] != "rnndrop-lm" or not found[1] or "--help" in found[1]:
                continue
            args = found[1]
            if args[0] in ("ptb", "wikitext2"):
                job = " ".join(a for a in args if a != "--resume")
                jobs.setdefault(_out_folder(args), set()).add(job)
            elif args[0] in ("evaluate", "generate"):
                used.append((page.name, args[1]))
    assert len(jobs) >= 10
    shared = {out: cmds for out, cmds in jobs.items() if len(cmds) > 1}
    assert not shared, f"different training commands write to the same folder: {shared}"
    for page, run in used:
        assert any(run.startswith(out + "/") for out in jobs), f"{page}: {run} is trained by no command"
