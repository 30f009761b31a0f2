"""Every reported number is generated: the blocks of README.md, docs/*.md and
benchmarks/results/*.md equal what their raw files render, and a changed raw file changes them.

No JAX: the renderers read JSON, JSONL and CSV only, so the whole file runs in about a second.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from studies import common as reports
from studies.common import core

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Another person's page, left as it is (it holds no table).
NOT_OURS = {ROOT / "docs" / "design.md"}
# A reported number: a decimal, a thousands-separated count, or a number with a unit.
NUMBER = re.compile(
    r"\d+\.\d+|\d{1,3}(,\d{3})+|\b\d+(\.\d+)? ?(ms|s|us|GiB|MiB|KiB|GB|MB|KB|kB|x|%)(?!\w)"
)


def copy_docs(dest: Path) -> Path:
    """README.md, docs/ and benchmarks/results/ (without the figures) under ``dest``."""
    shutil.copy(ROOT / "README.md", dest / "README.md")
    shutil.copytree(ROOT / "docs", dest / "docs")
    shutil.copytree(
        RESULTS, dest / "benchmarks" / "results", ignore=shutil.ignore_patterns("*.png")
    )
    return dest


def test_every_generated_block_equals_what_its_raw_files_render():
    differ = reports.check(ROOT)
    assert not differ, "run `python scripts/render_reports.py`:\n" + "\n".join(differ)


def test_a_changed_raw_file_is_rendered_again(tmp_path):
    """The check is not vacuous: change one number in a raw file and exactly the blocks that
    read it differ; writing renders the new number into them, and the check passes again."""
    root = copy_docs(tmp_path)
    raw = root / "benchmarks" / "results" / "memory_check_h100.json"
    data = json.loads(raw.read_text())
    row = next(r for r in data["rows"] if r["context"] == 1048576)
    assert f"{row['median_ms'] / 1e3:.2f} s" in (RESULTS / "step_time_h100_measured.md").read_text()
    row["median_ms"] = 6543.21
    raw.write_text(json.dumps(data))
    differ = reports.check(root)
    assert differ and all("memory_check_h100.json" in line for line in differ), differ
    pages = {line.split(":")[0] for line in differ}
    assert pages == {"benchmarks/results/memory_check_h100.md", "docs/results.md",
                     "benchmarks/results/step_time_h100_measured.md", "README.md"}, pages  # fmt: skip
    written = reports.write(root)
    assert {p.relative_to(root).as_posix() for p in written} == pages
    page = (root / "benchmarks" / "results" / "step_time_h100_measured.md").read_text()
    assert "6543" in page and "6.54 s" in page
    assert reports.check(root) == []
    # Hand-written text around the blocks is kept.
    assert "Where ours is slower than the post" in page


def test_every_table_and_results_page_is_generated():
    """Each markdown table (a line starting with '|') of the README, docs/ and the results pages
    sits inside a generated block, and every raw file of benchmarks/results is in the index."""
    loose = []
    for path in core.documents(ROOT):
        if path in NOT_OURS:
            continue
        text = path.read_text()
        inside = set()
        lines = text.split("\n")
        for b in core.parse(text, str(path)):
            inside |= set(range(b.start, b.end + 1))
        fenced = False
        for i, line in enumerate(lines):
            fenced ^= line.startswith("```")
            if line.startswith("|") and i not in inside and not fenced and NUMBER.search(line):
                loose.append(f"{path.relative_to(ROOT)}:{i + 1}: {line[:60]}")
    assert not loose, "tables with numbers outside generated blocks:\n" + "\n".join(loose)
    index = next(b for b in core.parse((RESULTS / "README.md").read_text(), "README.md")
                 if b.name == "results.index")  # fmt: skip
    stems = {reports.index.stem(s) for s in index.sources}
    raw = {p.name for p in RESULTS.iterdir() if p.suffix in (".json", ".jsonl", ".csv")}
    assert {n for n in raw if reports.index.stem(n) not in stems} == set()


# Pages whose prose (outside generated blocks, code and inline code) holds no reported number;
# the other docs also describe settings (tolerances, sizes), which are not results.
PROSE_CHECKED = ("README.md", "docs/results.md", "benchmarks/results/*.md")
NOT_RESULTS = {"80GB", "80 GB", "99%"}  # the product's name, the papers' stopping accuracy


def test_no_hand_written_number_in_the_results_prose():
    found = []
    for pattern in PROSE_CHECKED:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text()
            inside = set()
            for b in core.parse(text, str(path)):
                inside |= set(range(b.start, b.end + 1))
            fenced = False
            for i, line in enumerate(text.split("\n")):
                fenced ^= line.startswith("```")
                if fenced or i in inside or line.startswith("```"):
                    continue
                for m in NUMBER.finditer(re.sub(r"`[^`]*`", "", line)):
                    if m.group(0) not in NOT_RESULTS:
                        found.append(f"{path.relative_to(ROOT)}:{i + 1}: {m.group(0)!r}")
    assert not found, "numbers written by hand (render them from a raw file):\n" + "\n".join(found)


def test_every_raw_file_says_how_where_and_with_what():
    """The fields issue 28 asks of each raw file: how it was obtained, device, jax version and
    commit (or an explicit unknown with its reason in ``backfilled``)."""
    for path in sorted(RESULTS.glob("*.json")):
        meta = json.loads(path.read_text()).get("meta")
        assert meta, f"{path.name}: no meta"
        assert meta.get("how") in reports.fmt.HOW, path.name
        env = meta["environment"]
        for key in ("device_kind", "jax_version", "git_commit"):
            assert key in env, f"{path.name}: environment.{key} missing"
            if key == "jax_version" and env.get("torch_version"):
                continue  # measured with PyTorch (Zoology's own code): no JAX involved
            if env[key] is None and meta["how"] != "published":
                reasons = " ".join(str(v) for v in meta.get("backfilled", {}).values())
                assert "unknown" in reasons or "not recorded" in reasons, (path.name, key)
    for name in ("step_time_h100_124M_flash_LT_chunked", "step_time_h100_large_4k_16k"):
        settings = json.loads((RESULTS / f"{name}.json").read_text())["meta"]["settings"]
        assert settings["allocator_fraction"] and settings["steps_timed"]


def test_bad_markers_and_missing_raw_files_are_one_line_errors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- generated: nope x.json -->\n<!-- end generated -->\n")
    with pytest.raises(reports.ReportError, match="unknown generated block 'nope'; known: "):
        reports.check(tmp_path, [page])
    page.write_text("<!-- generated: ab_step_time.page gone.json -->\n<!-- end generated -->\n")
    with pytest.raises(reports.ReportError, match="reads gone.json, which does not exist"):
        reports.check(tmp_path, [page])
    page.write_text("<!-- generated: ab_step_time.page a.json -->\nno end\n")
    with pytest.raises(reports.ReportError, match="has no '<!-- end generated -->'"):
        reports.check(tmp_path, [page])
    # A writer's new page is its template, rendered; a second call keeps the hand text.
    shutil.copy(RESULTS / "ab_step_time_default.json", tmp_path / "a.json")
    new = tmp_path / "new.md"
    reports.page(new, "# Title\n\n" + reports.block("ab_step_time.page", "a.json"))
    assert "Ratio of medians" in new.read_text()
    new.write_text(new.read_text() + "\nhand-written\n")
    reports.page(new, "unused")
    assert new.read_text().endswith("hand-written\n") and "# Title" in new.read_text()


def test_the_command_checks_and_writes(tmp_path):
    root = copy_docs(tmp_path)
    script = [sys.executable, str(ROOT / "scripts" / "render_reports.py"), "--root", str(root)]
    ok = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    said = ok.stdout.strip().splitlines()  # success says so, in one line
    assert len(said) == 1 and said[0].startswith("every generated block agrees"), ok.stdout
    assert re.search(r"\((\d+) blocks in (\d+) documents\)", said[0])
    page = root / "benchmarks" / "results" / "ab_step_time_default.md"
    page.write_text(page.read_text().replace("Ratio of medians", "Ratio"))
    bad = subprocess.run([*script, "--check"], capture_output=True, text=True)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and "ab_step_time_default.md:1: ab_step_time.page" in lines[0]
    assert subprocess.run(script, capture_output=True).returncode == 0
    assert "Ratio of medians" in page.read_text()


def test_rendering_needs_no_jax():
    """The check runs in every `make test` and on any machine: the renderers read files only
    (but the option table of docs/attention.md, which asks the variants' specs when rendered)."""
    code = (
        "import sys; from studies import common as reports; reports.load_renderers(); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')], 'jax'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
