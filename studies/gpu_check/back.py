"""Back here in one command: a window's archive unpacked, its run folder merged into
``runs/gpu_check/<device>/``, every results file collected again from the merged folder (so
windows of several sessions add up), new raw files added to the index of
``benchmarks/results/README.md``, the reports rendered, and the headline tables printed before
and after.

The device comes from the archive's ``environment.json``: an H200's window lands in
``*_h200_measured.*`` and ``runs/gpu_check/h200/``, and its tables are printed alone, never
beside the H100's.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from studies.gpu_check import host

# The README's measured table (step_time.vs_post, 124M, flash and LT_chunked) is rendered from
# this file until a gpu-check window writes step_time_h100_measured.json.
README_HEADLINE = "step_time_h100_124M_flash_LT_chunked.json"
POST = "published_post.json"


def headline(results: Path, dev: str) -> str:
    """The headline tables as the results files of ``dev`` give them now: the 124M step of
    ``flash`` and ``LT_chunked`` beside the post's, the kernels, the steps compiled here
    against compiled there. Nothing of another device."""
    from studies import common as reports

    results = Path(results)
    steps = results / f"step_time_{dev}_measured.json"
    parts = []
    if not steps.is_file() and dev == "h100" and (results / README_HEADLINE).is_file():
        steps = results / README_HEADLINE
    if steps.is_file() and dev == "h100" and (results / POST).is_file():
        parts += [f"124M step, ms, ours / the post's H100 ({steps.name}):",
                  reports.block("step_time.vs_post", steps.name, POST, size="124M",
                                attentions="flash,LT_chunked")]  # fmt: skip
    elif steps.is_file():  # another device: its own table, beside nothing of the H100's
        parts += [f"step, ms ({steps.name}):", reports.block("gpu_check.steps", steps.name)]
    for stem, name, title in (
        (f"kernels_{dev}_measured.json", "gpu_check.kernels", "kernels"),
        (f"compile_ab_{dev}_measured.json", "gpu_check.compile_ab",
         "steps compiled here against compiled on the GPU"),
        (f"glue_ab_{dev}_measured.json", "gpu_check.glue",
         "the glue kernels at pallas against xla (kernels/choice.py: AUTO_PICKS_PALLAS)"),
    ):  # fmt: skip
        if (results / stem).is_file():
            extra = [f"gpu_tests_{dev}_measured.json"] if name == "gpu_check.glue" and (
                results / f"gpu_tests_{dev}_measured.json").is_file() else []  # fmt: skip
            parts += [f"{title} ({stem}):", reports.block(name, stem, *extra)]
    if not parts:
        return f"(no results of {dev} yet)"
    text, _ = reports.render_text("\n".join(parts), results, f"headline of {dev}")
    return re.sub(r"<!-- (generated: [^>]*|end generated) -->\n?", "", text).strip()


def add_to_index(results: Path, written: list[Path]) -> bool:
    """New raw files (JSON with a ``meta``) named in the ``results.index`` block of
    ``results/README.md``, where there is one (the test of the reports requires every raw file
    there). True when the marker changed."""
    readme = Path(results) / "README.md"
    if not readme.is_file():
        return False
    text = readme.read_text()
    m = re.search(r"<!-- generated: results\.index ([^>]*?) -->", text)
    if m is None:
        return False
    names = m.group(1).split()
    for path in written:
        path = Path(path)
        if path.suffix != ".json" or path.name in names:
            continue
        try:
            if "meta" in json.loads(path.read_text()):
                names.append(path.name)
        except (OSError, json.JSONDecodeError):
            continue
    spec = " ".join(sorted(set(names)))
    if spec == m.group(1):
        return False
    readme.write_text(text[: m.start(1)] + spec + text[m.end(1) :])
    return True


def merge_back(archive: Path, results: Path, runs_root: Path, render_root: Path | None,
               out=print) -> dict:  # fmt: skip
    """The whole way back (module docstring); ``render_root``: the repository whose documents
    are rendered again (None: only the pages of ``results``). Returns what was done."""
    from studies import common as reports
    from studies.gpu_check import collect, stages

    results, runs_root = Path(results), Path(runs_root)
    tmp = host.scratch()
    try:
        run_src, env = host.unpack(Path(archive), tmp)
        dev = host.device_label(env)
        before = headline(results, dev)
        dest = runs_root / dev
        merged = host.merge_run(run_src, dest)
        env_here = json.loads((dest / "environment.json").read_text())
        plan = stages.build(results, tiny=bool(env_here.get("tiny")))
        written = collect.collect_all(plan, dest, results, env_here, dev)
        add_to_index(results, written)
        if render_root is not None:
            rendered = reports.write(Path(render_root))
        else:
            rendered = reports.write(results, sorted(results.glob("*.md")))
        after = headline(results, dev)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kind = env.get("device_kind")
    out(f"unpacked {archive}: {len(merged)} units of {kind} ({dev}) into {dest}")
    if dev != "h100":
        out(f"({dev}: its own files, *_{dev}_measured.*; not compared with the H100's)")
    out(f"\nbefore:\n{before}\n\nafter:\n{after}")
    for path in written:
        out(f"wrote {path}")
    for path in rendered:
        out(f"rendered {path}")
    return {"device": dev, "merged": merged, "written": written, "rendered": rendered,
            "environment": env}  # fmt: skip
