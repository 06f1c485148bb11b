"""The job's report on a terminal: the Markdown's tables aligned, its markup gone."""

from rnndrop.lm.cli.terminal import markdown_for_terminal

MARKDOWN = """# ptb benchmark, config `mini`

Command:

```bash
rnndrop-lm ptb --data sample
```

| regime | dropout | test ppl | test ppl, MC |
|---|---|---|---|
| none | — | 204.6 ± 3.8 | — |
| tied | emb 0.1 · rec 0.2 | 161.4 ± 3.4 | 163.7 (S=50) |

After the table.
"""


def test_tables_are_aligned_columns_and_the_markup_is_gone():
    text = markdown_for_terminal(MARKDOWN)
    lines = text.splitlines()
    assert lines[:2] == ["ptb benchmark, config mini", "=" * len("ptb benchmark, config mini")]
    assert "    rnndrop-lm ptb --data sample" in lines and not any("```" in line for line in lines)
    assert "|" not in text and "`" not in text and "---" not in text
    header = next(i for i, line in enumerate(lines) if line.startswith("regime"))
    table = lines[header : header + 4]
    assert set(table[1]) <= {"─", " "}
    # every column starts at the same place on every row; numbers end at the same place
    starts = [line.index("test ppl") for line in table[:1]]
    assert table[2].index("204.6") == table[3].index("161.4") and starts
    assert table[2].rindex("—") + 1 == len(table[2]) and table[3].endswith("163.7 (S=50)")
    assert len(table[2].rstrip()) <= len(table[3])
    assert lines[header + 5] == "After the table." and text.endswith("\n")


def test_words_per_second_marked_compiled_stays_a_right_aligned_number():
    text = markdown_for_terminal("| regime | words/s |\n|---|---|\n| none | 126,000 |\n"
                                 "| tied | 191,355 (compiled) |\n| untied | 90,000 (1 of 2 compiled) |\n"
                                 "| gaussian | 10,084 (compiled; 199,877 after epoch 1) |\n")
    rows = text.splitlines()[2:6]
    assert len({len(row) for row in rows}) == 1 and rows[0].endswith(" 126,000")
    assert rows[1].endswith("191,355 (compiled)") and rows[2].endswith("90,000 (1 of 2 compiled)")
    assert rows[3].endswith("10,084 (compiled; 199,877 after epoch 1)")


def test_a_monte_carlo_column_of_several_sample_counts_stays_a_right_aligned_number():
    text = markdown_for_terminal("| regime | test ppl, MC |\n|---|---|\n| naive | 163.7 ± 10.0 (S=50) |\n"
                                 "| tied | 99.0 (S=2, 5) |\n")
    rows = text.splitlines()[2:4]
    assert len(rows[0]) == len(rows[1]) and rows[1].endswith(" 99.0 (S=2, 5)")  # right-aligned

