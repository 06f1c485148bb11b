"""Every Python block of the README runs as pasted (each on its own, in a fresh namespace)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 7


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_pasted(index, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "__main__"})
    finally:
        torch.set_num_threads(threads)


def test_readme_starts_with_the_offline_sample_command_and_no_shared_folder():
    top = README.read_text(encoding="utf-8").split("## ")[0]
    assert 'pip install torch==2.13.0 -e ".[bench]" && rnndrop-lm ptb --data sample' in top
    assert "../shared" not in top and "shared/data" not in top
