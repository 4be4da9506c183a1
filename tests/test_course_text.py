"""The chapters' words: every term and API before its first use, facts that can be checked,
the glossary's links, and each chapter's opening line (time, what it assumes).

Each test reads ``notebooks/src/NN_*.py`` (and the built notebooks for the links); the
notebooks' own checked cells cover what needs running code.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"
GLOSSARY = ROOT / "notebooks" / "glossary.md"
CHAPTERS = sorted(SRC.glob("[0-9][0-9]_*.py"))
_MARKER = re.compile(r"^\s*### (BEGIN|END) (SOLUTION|STARTER)\s*$")


def cells(path: Path) -> list[tuple[str, str]]:
    """``(kind, text)`` per cell of a chapter source: kind is "markdown" or "code"; a markdown
    cell's text has its ``# `` prefixes taken off. Cells only in the solutions build are left out."""
    out: list[tuple[str, list[str]]] = []
    for line in path.read_text().split("\n"):
        if line.startswith("# %%"):
            solution_only = 'tags=["solution"]' in line
            out.append(("markdown" if "[markdown]" in line else "code", [], solution_only))
            continue
        if out:
            out[-1][1].append(line)
    result = []
    for kind, lines, solution_only in out:
        if solution_only:
            continue
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln[1:] for ln in lines]
        result.append((kind, "\n".join(lines)))
    return result


def prose(path: Path) -> str:
    return "\n".join(text for kind, text in cells(path) if kind == "markdown")


def chapter(number: str) -> Path:
    return next(p for p in CHAPTERS if p.name.startswith(number))


def _lines(code: str, in_answers: bool) -> str:
    """The lines of a code cell inside its answer regions, or outside them."""
    kept, inside = [], False
    for line in code.split("\n"):
        m = _MARKER.match(line)
        if m:
            inside = m.group(1) == "BEGIN" and m.group(2) == "SOLUTION"
            continue
        if inside == in_answers:
            kept.append(line)
    return "\n".join(kept)


def outside_answers(code: str) -> str:
    """A code cell without its answer regions (what a learner sees before writing anything)."""
    return _lines(code, in_answers=False)


def answers(code: str) -> str:
    return _lines(code, in_answers=True)


# --- the glossary and the opening lines -------------------------------------------------


def glossary_anchors() -> dict[str, str]:
    """anchor -> the entry's text. An entry is a ``### term`` heading, written so that JupyterLab
    (spaces -> '-') and GitHub (lower case, spaces -> '-') give it the same anchor."""
    entries = re.split(r"^### ", GLOSSARY.read_text(), flags=re.M)[1:]
    out = {}
    for entry in entries:
        heading, _, body = entry.partition("\n")
        assert re.fullmatch(r"[a-z0-9][a-z0-9 -]*", heading), f"glossary heading {heading!r}: lower case words"
        out[heading.replace(" ", "-")] = body
    return out


def test_every_glossary_entry_says_what_and_which_chapter():
    anchors = glossary_anchors()
    assert len(anchors) >= 40
    for anchor, body in anchors.items():
        assert re.search(r"\(chapters? \d\d", body), f"{anchor}: name the chapter that introduces it"
        sentences = body.strip().count(". ") + 1
        assert 1 <= sentences <= 4, f"{anchor}: one or two sentences ({sentences})"
    for term in ("page", "token-slot", "page-table", "row", "region", "prefill", "decode", "extend",
                 "source-design", "lift", "launch-floor", "seed-wrapper", "handle", "lock",
                 "lru-stamp", "dummy-row"):
        assert term in anchors, f"the glossary has no entry {term!r}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_opens_with_its_time_and_what_it_assumes(path):
    first = next(text for kind, text in cells(path) if kind == "markdown")
    heading, _, rest = first.strip().partition("\n")
    assert heading.startswith("# "), "the first cell opens with the chapter's title"
    opening = rest.strip().split("\n\n")[0]
    assert re.match(r"\*\*Time:\*\* about \d+ minutes", opening), f"{path.name}: '**Time:** about N minutes'"
    assert "**Assumes:**" in opening, f"{path.name}: '**Assumes:** ...' right after the time"


def _links(text: str):
    """Link targets of Markdown text, outside code (``kernel[grid](args)`` is not a link)."""
    text = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _check_target(base: Path, target: str, anchors: dict[str, str]) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None
    file, _, anchor = target.partition("#")
    path = (base / file).resolve()
    if not path.exists():
        return f"{target}: no file {path.relative_to(ROOT)}"
    if path == GLOSSARY.resolve() and anchor and anchor not in anchors:
        return f"{target}: the glossary has no entry '{anchor}'"
    if path == GLOSSARY.resolve() and not anchor:
        return None
    return None


@pytest.mark.parametrize("build", ["learner", "solutions"])
def test_every_relative_link_of_every_built_notebook_resolves(build):
    """Links to the glossary and to other chapters work in JupyterLab and on GitHub, in both
    builds (a solutions notebook sits one folder down)."""
    anchors = glossary_anchors()
    folder = ROOT / "notebooks" / ("solutions" if build == "solutions" else "")
    problems, glossary_links = [], 0
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            for target in _links(cell.source):
                glossary_links += "glossary.md#" in target
                problem = _check_target(path.parent, target, anchors)
                if problem:
                    problems.append(f"{path.relative_to(ROOT)}: {problem}")
    assert not problems, "\n".join(problems)
    assert glossary_links >= 100


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_links_the_glossary(path):
    linked = set(re.findall(r"\]\(glossary\.md#([a-z0-9-]+)\)", prose(path)))
    assert len(linked) >= 5, f"{path.name} links {sorted(linked)}: link each term's first use"


# --- every API before its first use -------------------------------------------------------


def test_every_triton_api_an_answer_needs_was_shown_before():
    """A ``tl.*`` call that an exercise's answer needs appears outside any answer earlier: in
    an earlier chapter, or earlier in the same one (prose or code). Chapter 03's part 3 needs
    ``tl.num_programs``: chapter 01's primer shows it."""
    seen: set[str] = set()
    missing = []
    for path in CHAPTERS:
        for kind, text in cells(path):
            if kind == "code":
                for api in sorted(set(re.findall(r"\btl\.(\w+)", answers(text))) - seen):
                    missing.append(f"{path.name}: an answer uses tl.{api}, shown nowhere before")
                seen |= set(re.findall(r"\btl\.(\w+)", outside_answers(text)))
            else:
                seen |= set(re.findall(r"\btl\.(\w+)", text))
    assert not missing, "\n".join(missing)
    first_primer = prose(chapter("01")).split("### 2.")[0]
    assert "tl.num_programs(0)" in first_primer


def test_chapter_03_says_the_parts_go_in_order_before_the_exercise():
    text = chapter("03").read_text()
    exercise = text.index("def my_alloc_extend_kernel")
    said = text.find("Do the parts in order")
    assert 0 <= said < exercise
    assert "num_part1" in text[said:exercise]


def test_the_source_design_is_defined_in_chapter_00_and_linked_where_used():
    assert "**the source design**" in prose(chapter("00")).split("## ")[0]  # in the opening section
    for path in CHAPTERS:
        text = prose(path)
        first = re.search(r"source\s+design", text)
        if first is None:
            continue
        window = text[max(0, first.start() - 2):first.end() + 30]
        assert "](glossary.md#source-design)" in window, f"{path.name}: link its first use"


def test_chapter_05_marks_its_lru_departure_and_explains_the_clock():
    text = prose(chapter("05"))
    departure = text.index("**[Departure](glossary.md#departure): the split's upper half gets the new stamp")
    said = text[departure:departure + 1200]
    for fact in ("split_at", "_tree_walk", "python/minisgl/kvcache/radix_cache.py"):
        assert fact in said
    assert "jumps by 2 on an insert" in text


def _table_fields(text: str, after: str, first_column: bool = False) -> set[str]:
    """The backticked names (``s.tree.nodes`` gives tree and nodes) in the first Markdown table
    after ``after``."""
    start = text.index(after)
    table = re.search(r"(^\|.*\|\n)+", text[start:], flags=re.M).group(0)
    names = set()
    for row in table.split("\n")[2:]:
        if first_column:
            row = row.split("|")[1] if row.count("|") > 1 else ""
        for name in re.findall(r"`([\w.]+)`", row):
            parts = name.strip(".").split(".")
            names |= {p for p in (parts[1:] if parts[0] == "s" else parts) if not p[0].isupper()}
    return names  # type names (MemorySplit) left out


def test_chapter_06_tabulates_cache_regions_before_the_lift_reads_them():
    from kvlab.manager.cache_regions import CacheRegions

    text = chapter("06").read_text()
    fields = _table_fields(prose(chapter("06")), "returns what it did as a", first_column=True)
    assert {"row_before", "row_after", "freed_pages"} <= fields
    for name in fields:
        assert hasattr(CacheRegions, name) or name in CacheRegions.__dataclass_fields__, name
    table = text.index("| `row_before` |")
    for use in (".row_before", ".row_after", ".freed_pages"):
        assert table < text.index(use), f"{use} is used before the table"


def test_chapter_07_tabulates_the_step_records_before_check_timeline():
    from kvlab.prefix.radix_node import NodeInfo
    from kvlab.serving.sim.timeline import MemorySplit, StepRecord

    text = chapter("07").read_text()
    fields = _table_fields(prose(chapter("07")), "The fields of a step")
    assert {"nodes", "page_ids", "row_rids", "free_pages", "memory"} <= fields
    known = set(StepRecord.__dataclass_fields__) | set(NodeInfo._fields) | set(MemorySplit._fields)
    known |= {"nodes", "total", "in_use"}
    assert fields <= known, fields - known
    assert text.index("| `s.row_rids` |") < text.index("def check_timeline")


def test_chapter_09_lift_runs_the_learners_scan():
    text = chapter("09").read_text()
    lift = text[text.index("# ## Lift"):text.index("# ## Optional")]
    assert re.search(r'kvlab\.check\.choose\(\s*"extend_scan", my_extend_scan', lift)
    assert "scan_starts(scan_kernel" in lift


def test_chapter_09_marks_the_host_cost_part_optional():
    headings = re.findall(r"^## (.+)$", prose(chapter("09")), flags=re.M)
    host = [h for h in headings if "public call" in h]
    assert host and all(h.startswith("Optional") for h in host)


def test_the_public_call_table_counts_syncs_in_words():
    from kvlab.course.scenes.ch09_making_it_fast import load_bench, public_call_rows

    rows = public_call_rows(load_bench())
    body = "\n".join(rows[1:])
    assert re.search(r"\b0 syncs\b", body) and re.search(r"\b1 sync\b", body)
    assert not re.search(r"\d\s?s\b", body), "a count of syncs must not read as seconds"


# --- facts ------------------------------------------------------------------------------


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_every_kvlab_name_in_the_prose_exists():
    """``kvlab.serving.tiny_engine.TinyTransformer`` (not ``kvlab.attention.paged_attention``): a name the prose gives must be
    where it says."""
    wrong = []
    for path in CHAPTERS:
        for name in sorted(set(re.findall(r"`(kvlab(?:\.[A-Za-z_]\w*)+)", prose(path)))):
            try:
                _resolve(name)
            except (ImportError, AttributeError):
                wrong.append(f"{path.name}: {name}")
    assert not wrong, "\n".join(wrong)


def test_the_course_map_lists_every_chapter():
    text = prose(chapter("00"))
    course_map = text[text.index("## The course map"):]
    for path in CHAPTERS:
        number = path.name[:2]
        row = re.search(rf"^\| {number} \|.*$", course_map, flags=re.M)
        assert row, f"the course map has no row for chapter {number}"
        assert f"{path.stem}.ipynb" in row.group(0)
    assert re.search(r"^\| 11 \|.*hash-chained prefix cache.*11_hash_prefix_cache\.ipynb", course_map,
                     flags=re.M | re.I)


def test_page_sizes_are_powers_of_two_in_chapter_02():
    text = prose(chapter("02"))
    assert "1, 2, ..., 32" not in text
    assert "`P` = 1, 2, 4, 8, 16 or 32" in text and "powers of two" in text


def test_a_finished_request_keeps_its_whole_pages_in_the_prefix_cache():
    """mini-sglang's cache_req(finished=True) inserts the whole pages and frees only the
    duplicates and the tail: chapter 00 must not say the pages are freed."""
    from kvlab.course.scenes.ch00_tour import THREE_REQUESTS, describe_step, scheduler_timeline

    lines = [describe_step(s) for s in scheduler_timeline(THREE_REQUESTS, prefill_budget=8) if s.finished]
    assert lines and all("prefix cache" in line and "(pages freed)" not in line for line in lines)
    text = prose(chapter("00"))
    assert "give their KV back" not in text
    assert "python/minisgl/scheduler/cache.py" in text and "cache_req(finished=True)" in text


def test_chapter_03_marks_sglangs_padding_page():
    text = prose(chapter("03"))
    said = text.index("free_pages = arange(1, num_pages + 1)")
    assert "Departure" in text[said - 200:said] and "python/sglang/srt/mem_cache/allocator.py" in text[said:said + 300]


# --- the learner's moment: order, names, messages -------------------------------------------


def test_progress_lists_each_chapter_s_exercises_in_the_order_its_notebook_checks_them():
    import kvlab.check

    for path in CHAPTERS:
        answers_at = {m.group(1) for m in re.finditer(r"^def (\w+)\(", path.read_text(), flags=re.M)}
        calls = re.findall(r"^kvlab\.check\.(\w+)\(\s*(\w+)", path.read_text(), flags=re.M)
        asked = list(dict.fromkeys(name for name, fn in calls if fn in answers_at))  # on the answer cells' functions
        listed = [n for n in kvlab.check.exercises() if kvlab.check.EXERCISES[n].chapter == path.name[:2]]
        assert asked == listed, f"{path.name} checks {asked}, progress() lists {listed}"


def test_no_chapter_names_a_checker_module():
    """A lift cell names the package's function (or the reference solution), never the checker
    module that keeps it (``kvlab.course.exercises.ch05_match...``)."""
    for path in CHAPTERS:
        assert not re.search(r"kvlab\.check\.ch\d\d|from kvlab\.check\.ch", path.read_text()), path.name


def _asserts_without_a_message(code: str) -> list[int]:
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:  # IPython syntax (a magic): no plain asserts to find
        return []
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert) and node.msg is None]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_cell_asserts_without_a_message(path):
    """A failing assert in a chapter says what differs: a bare ``AssertionError:`` stops Run All
    and tells the learner nothing."""
    bare = []
    for kind, text in cells(path) + [("code", t) for t in _solution_only_code(path)]:
        if kind == "code":
            bare += [text.split("\n")[n - 1].strip() for n in _asserts_without_a_message(text)]
    assert not bare, f"{path.name}: asserts without a message:\n" + "\n".join(bare)


def _solution_only_code(path: Path) -> list[str]:
    out, current = [], None
    for line in path.read_text().split("\n"):
        if line.startswith("# %%"):
            current = [] if ('tags=["solution"]' in line and "[markdown]" not in line) else None
            if current is not None:
                out.append(current)
            continue
        if current is not None:
            current.append(line)
    return ["\n".join(c) for c in out]


def test_chapter_10_explains_before_it_shows_and_speaks_of_batch_entries():
    text, words = chapter("10").read_text(), prose(chapter("10"))
    for term in ("chunked-prefill", "cuda-graph", "dummy-row", "token-budget"):
        assert f"](glossary.md#{term})" in words, f"chapter 10 does not link {term}"
    exercise = text.index("def my_paged_attention_step")
    assert 0 <= text.find("paged_decode_attention(q, k_pool, v_pool, page_table, rows, seq_lens") < exercise
    first_print = text.index("on_step=lambda step: print(step)")
    for name in ("`padded_to`", "`graph_steps`"):
        assert 0 <= text.find(name) < first_print, f"{name} is printed before it is explained"
    # a lane is Triton's (a block element, chapter 01); a decode batch has entries
    assert not re.search(r"\blanes?\b", text, flags=re.I)
    dummy = glossary_anchors()["dummy-row"]
    assert "maps the" in dummy and "dummy page" in dummy and "kvlab keeps it unmapped" not in dummy


def test_chapter_11_explains_the_random_prompts_hits_and_checks_it():
    text = chapter("11").read_text()
    said = text.index("**Random prompts: hits only when memory is short.**")
    cell = text[said:text.index("# %% [markdown]", said + 10)]
    assert "preempted" in cell and ("re-admitted" in cell or "admitted again" in cell)
    assert "assert (hits > 0) == (pool != \"ample\")" in cell
