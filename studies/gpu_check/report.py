"""``make gpu-check``'s results (``*_<device>_measured.json``; ``gpu_check_<device>_measured.md``):
its units' times against the estimate, the GPU tests, the kernels beside flash-linear-attention,
the training step, the profile, sampling, and the learning cells."""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, gib, glue_point, provenance, short, table


def _about(data: dict[str, Any]) -> str:
    p = provenance(data)
    return (f"{(p['how'] or 'obtained').capitalize()} on {p['device']}, jax {p['jax']}, commit "
            f"{short(p['commit'])}, {p['time'] or 'time not recorded'}.")  # fmt: skip


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


@renderer("gpu_check.units")
def units(raw: Raw) -> str:
    rows = raw.data["units"]
    body = []
    for stage in dict.fromkeys(u["stage"] for u in rows):
        us = [u for u in rows if u["stage"] == stage]
        ok = sum(u["status"] == "ok" for u in us)
        body.append([f"`{stage}`", us[0].get("phase", ""), f"{ok} of {len(us)}",
                     f"{sum(u['estimate_s'] for u in us) / 60:.1f}",
                     f"{sum(u['seconds'] for u in us) / 60:.1f}"])  # fmt: skip
    failed = [f"`{u['stage']}/{u['unit']}`" for u in rows if u["status"] != "ok"]
    wins = [[str(w.get("window")), w.get("device_kind") or "", f"{w.get('estimate_s', 0):.0f}",
             f"{w.get('seconds', 0):.0f}", f"{w.get('units_done', 0)} of {w.get('units', 0)}",
             (w.get("started_utc") or "")[:16]] for w in raw.data.get("windows", [])]  # fmt: skip
    return "\n".join([
        _about(raw.data), "",
        *([table(["window", "device", "estimated s", "took s", "units done", "started (UTC)"],
                 wins, "llrrrl"), ""] if wins else []),
        table(["stage", "phase", "units ok", "estimated min", "took min"], body, "llrrr"),
        *([""] + [f"Failed: {', '.join(failed)} (their logs are in the run folder)."] if failed else []),
    ])  # fmt: skip


@renderer("gpu_check.compile_ab")
def compile_ab(raw: Raw) -> str:
    """The same settings timed from steps compiled here (deviceless, loaded) and compiled on
    the GPU, in one session: their ratio."""
    body = [[r["size"], f"`{r['attention']}`", context_label(r["context"]),
             str(r.get("chunk_size") or ""), _ms(r["loaded_ms"]), _ms(r["compiled_there_ms"]),
             f"{r['ratio']:.3f}"] for r in raw.data["rows"]]  # fmt: skip
    loaded = {(r["loaded"], r["looked_up"]) for r in raw.data["rows"]}
    note = ", ".join(f"{a} of {b} steps loaded" for a, b in sorted(loaded))
    if not any(a for a, _ in loaded):
        # The store holds programs compiled for the H100 only: on another card (an H200) both
        # units compiled on the GPU, and the ratio is two compiles' run-to-run agreement.
        note = (
            "none loaded: the store holds H100 programs, so both columns were compiled on "
            "this GPU and their ratio is the repeatability of two compiles and runs"
        )
    first = "loaded" if any(a for a, _ in loaded) else "step unit"
    return "\n".join([
        _about(raw.data) + f" Step unit: {note}.", "",
        table(["size", "attention", "context", "chunk", f"{first} median ms",
               "compiled-there median ms", f"{first} / there"], body, "lllrrrr"),
    ])  # fmt: skip


@renderer("gpu_check.kernel_sweep")
def kernel_sweep(raw: Raw) -> str:
    rows = raw.data["rows"]
    keys = list(dict.fromkeys((r["name"], r["kernel"]) for r in rows))
    Ts = sorted({r["T"] for r in rows})
    body = []
    for name, kernel in keys:
        for mode in ("fwd", "fwd+bwd"):
            cells = []
            for T in Ts:
                r = next((x for x in rows if (x["name"], x["kernel"], x["T"], x["mode"])
                          == (name, kernel, T, mode)), None)  # fmt: skip
                cells.append("" if r is None else f"{r['seconds'] * 1e3:.3g}"
                             if r.get("seconds") else str(r.get("status", "")))  # fmt: skip
            body.append([f"`{name}`", kernel, mode, *cells])
    return "\n".join([
        _about(raw.data) + " Median ms:", "",
        table(["name", "kernel", "mode", *(context_label(t) for t in Ts)], body,
              "lll" + "r" * len(Ts)),
    ])  # fmt: skip


def _launch(r: dict[str, Any]) -> str:
    """A bench_glue row's launch: ``xla``, or the kernel's (``kernels.launch.Launch.label``)."""
    from linear_gpt2.kernels.launch import Launch

    return "xla" if r.get("launch") is None else Launch(**r["launch"]).label()


def _ms3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _marked(r: dict[str, Any], now: dict[str, Any]) -> str:
    """A Pallas row's launch and whether it is the default: the one the file timed the others
    against (``default`` in the row) and the one ``kernels.launch.DEFAULTS`` holds now."""
    then = bool(r.get("default"))
    is_now = r.get("launch") == now.get(r["kernel"])
    mark = {(True, True): " (default)", (True, False): " (default when measured)",
            (False, True): " (default now)"}.get((then, is_now), "")  # fmt: skip
    return _launch(r) + mark


@renderer("gpu_check.glue_kernels")
def glue_kernels(raw: Raw) -> str:
    """Per glue kernel and rows: XLA's oracle, the default launch and the fastest candidate,
    with the bytes a pass must move per second and their share of the card's HBM; then every
    candidate's time over the default's, the default then and now marked; then what
    ``glue_launch``'s rule picks from the file."""
    import dataclasses

    from linear_gpt2.kernels.launch import DEFAULTS
    from studies.gpu_check import glue_launch

    now = {k: dataclasses.asdict(v) for k, v in DEFAULTS.items()}
    rows = raw.data["rows"]
    keys = list(dict.fromkeys((r["kernel"], r["rows"]) for r in rows))
    body, every = [], []

    def cell(r):
        if r is None or r.get("status") != "ok":
            return ["—" if r is None else r["status"], "", ""]
        frac = "" if r.get("fraction") is None else f"{r['fraction']:.2f}"
        gbs = "" if r.get("gb_per_s") is None else f"{r['gb_per_s']:,.0f}"
        return [f"{r['net_ms']:.3f}", gbs, frac]

    for kernel, n in keys:
        group = [r for r in rows if (r["kernel"], r["rows"]) == (kernel, n)]
        xla = next((r for r in group if r["impl"] == "xla"), None)
        default = next((r for r in group if r.get("default")), None)
        ok = [r for r in group if r["impl"] == "pallas" and r.get("status") == "ok"]
        best = min(ok, key=lambda r: r["net_ms"]) if ok else None
        ratio = (f"{best['net_ms'] / default['net_ms']:.3f}"
                 if best and default and default.get("status") == "ok" else "")  # fmt: skip
        body.append([f"`{kernel}`", f"{n:,}", *cell(xla), *cell(default),
                     "—" if best is None else _launch(best), *cell(best)[:1], ratio])  # fmt: skip
        every += [[f"`{kernel}`", f"{n:,}", _marked(r, now), *cell(r)[:1],
                   "" if r.get("to_default") is None else f"{r['to_default']:.3f}"]
                  for r in group if r["impl"] == "pallas"]  # fmt: skip
    picks = glue_launch.picks(raw.data)
    chosen = []
    for kernel, p in picks.items():
        mean = "" if p.geomean is None else f"{p.geomean:.3f}"
        verdict = "adopted" if p.adopted else "kept the default" if p.best else "none faster"
        chosen.append([f"`{kernel}`", _launch({"launch": p.measured}),
                       "—" if p.best is None else _launch({"launch": p.best}), mean, verdict,
                       _launch({"launch": now[kernel]}) if kernel in now else "—"])  # fmt: skip
    s = raw.data["meta"].get("settings", {})
    return "\n".join([
        _about(raw.data) + f" Widths {s.get('widths')}; medians of {s.get('rounds')} rounds of "
        f"{s.get('iters')} calls, the programs side by side. ms: net of the copy of an input a "
        "kernel writes over (a jitted call may not overwrite its argument; the step's may). "
        "GB/s: the bytes one pass must move (inputs read once, outputs written once) per "
        "second; of HBM: over the card's datasheet bandwidth. default: the launch the others "
        "were timed against (the kernels' default when measured).", "",
        table(["kernel", "rows", "xla ms", "xla GB/s", "xla of HBM", "default ms",
               "default GB/s", "default of HBM", "fastest launch", "its ms",
               "fastest / default"], body, "lrrrrrrrlrr"),
        "", "Every launch against the default (default now: `kernels/launch.py`'s `DEFAULTS`):",
        "", table(["kernel", "rows", "launch", "ms", "/ default"], every, "lrlrr"),
        "", "The default each kernel gets from this file (`studies/gpu_check/glue_launch.py`): "
        "of the launches faster than the default at every row count, the one with the smallest "
        "geometric mean of its time over the default's, adopted if that mean is at most "
        f"{glue_launch.THRESHOLD}. The file's noise of that ratio (per candidate and row count, "
        "the half-range of its per-round ratios; their median): "
        f"{_ms3(glue_launch.ratio_noise(raw.data))}.", "",
        table(["kernel", "default when measured", "best of those faster at every row count",
               "geometric mean", "rule", "default now"], chosen, "lllrll"),
    ])  # fmt: skip


@renderer("gpu_check.tests")
def tests(raw: Raw) -> str:
    body, failures = [], []
    for f in raw.data["files"]:
        count = {
            k: sum(t["outcome"] == k for t in f["tests"])
            for k in ("passed", "failed", "error", "skipped")
        }
        body.append([f"`{f['file']}`", *count.values()])
        failures += [f"- `{f['file']}::{t['name']}` {t['outcome']}: {t['message']}"
                     for t in f["tests"] if t["outcome"] in ("failed", "error")]  # fmt: skip
    pk = raw.data["meta"]["settings"].get("packages") or {}
    versions = ", ".join(f"{k} {v}" for k, v in pk.items() if v) or "not recorded"
    return "\n".join([
        _about(raw.data) + f" Packages: {versions}.", "",
        table(["file", "passed", "failed", "error", "skipped"], body, "lrrrr"),
        *([""] + failures if failures else []),
    ])  # fmt: skip


@renderer("gpu_check.kernels")
def kernels(raw: Raw) -> str:
    rows = raw.data["rows"]
    out = [_about(raw.data)]
    for shape in dict.fromkeys((r["B"], r["H"], r["D"]) for r in rows):
        for forget in dict.fromkeys(r["forget"] for r in rows if (r["B"], r["H"], r["D"]) == shape):
            sel = [r for r in rows if (r["B"], r["H"], r["D"]) == shape and r["forget"] == forget]
            impls = list(dict.fromkeys(r["impl"] for r in sel))
            body = []
            for T in sorted({r["T"] for r in sel}):
                cells = []
                for impl in impls:
                    for mode in ("fwd", "fwd+bwd"):
                        r = next((x for x in sel if x["impl"] == impl and x["T"] == T
                                  and x["mode"] == mode), None)  # fmt: skip
                        cells.append("" if r is None else f"{r['ms']:.3g} ({r['tflops']:.0f})"
                                     if r.get("ms") else r.get("status", ""))  # fmt: skip
                body.append([context_label(T), *cells])
            head = ["T", *(f"{i} {m}" for i in impls for m in ("fwd", "fwd+bwd"))]
            checks = [f"`{r['impl']}` {r['check_rel_err']:.1e}" for r in sel
                      if r.get("check_rel_err") is not None and r["mode"] == "fwd"]  # fmt: skip
            B, H, D = shape
            out += ["", f"(B, H, D) = ({B}, {H}, {D}), forgetting: {forget}; ms (TFLOP/s, "
                    "each variant's count: softmax's 4 T D per head not halved for causality, "
                    "as nanoGPT counts):", "",
                    table(head, body, "l" + "r" * (len(head) - 1))]  # fmt: skip
            if checks:
                out += ["", "Outputs against ours before timing (||out - ours|| / ||ours||): "
                        + ", ".join(dict.fromkeys(checks)) + "."]  # fmt: skip
    out += [f"- {n}" for n in raw.data.get("notes", [])]
    return "\n".join(out)


@renderer("gpu_check.steps")
def steps(raw: Raw) -> str:
    s = raw.data["meta"]["settings"]
    body = []
    for r in raw.data["results"]:
        ok = r["status"] == "ok"
        body.append([r["size"], f"`{r['attention']}`", context_label(r["context"]),
                     _ms(r.get("min_ms")) if ok else r["status"], _ms(r.get("median_ms")),
                     _ms(r.get("max_ms")), f"{r.get('remat')}, {r.get('loss_chunk')}",
                     r.get("chunk_size") or "", gib(r.get("memory_bytes"), 1)])  # fmt: skip
    share = s.get("allocator_fraction")
    return "\n".join([
        _about(raw.data) + f" {s.get('steps_timed')} steps timed after {s.get('warmup')}; "
        f"allocator share {share if share is not None else 'not set (CPU)'}.", "",
        table(["size", "attention", "context", "min ms", "median ms", "max ms",
               "remat, loss_chunk (auto)", "chunk", "compiled GiB"], body, "lllrrrlrr"),
    ])  # fmt: skip


@renderer("gpu_check.sample")
def sample(raw: Raw) -> str:
    rows = raw.data["rows"]
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    by = {(r.get("size"), r["decoder"], r["context"]): r for r in rows}
    body = []
    for size in dict.fromkeys(r.get("size") for r in rows):
        for ctx in sorted({r["context"] for r in rows if r.get("size") == size}):
            cells = []
            for d in decoders:
                r = by.get((size, d, ctx))
                cells.append("" if r is None else _ms(r["median_ms"]) if r["status"] == "ok"
                             else r["status"])  # fmt: skip
            body.append([size, context_label(ctx), *cells])
    s = raw.data["meta"].get("settings", {})
    return "\n".join(
        [
            _about(raw.data) + f" ms per token, the median over {s.get('rounds')} "
            f"rounds of {s.get('steps')} tokens, batch 1, {s.get('dtype')}.",
            "",
            table(["size", "context", *decoders], body, "ll" + "r" * len(decoders)),
        ]
    )


@renderer("gpu_check.profile")
def profile(raw: Raw) -> str:
    out = [_about(raw.data)]
    for p in raw.data["profiles"]:
        body = [[i, f"`{op['name'][:70]}`", op["count"], f"{op['ms']:.3f}", f"{op['share']:.1%}"]
                for i, op in enumerate(p["top"], 1)]  # fmt: skip
        out += ["", f"`{p['attention']}` {p['size']} at {context_label(p['context'])}: "
                f"{p['steps']} steps traced, {p['device_ms']:.1f} ms of {p['where']} time per "
                f"step; the {len(p['top'])} ops that take the most:", "",
                table(["#", "op", "calls per step", "ms per step", "share"], body, "rlrrr")]  # fmt: skip
    return "\n".join(out)


@renderer("gpu_check.mqar")
def mqar(raw: Raw) -> str:
    body = []
    for r in raw.data["runs"]:
        acc = r.get("val_acc") or []
        best = max((a for _, a in acc), default=None)
        body.append([r["name"], r.get("stopped_by") or "not finished", r.get("steps") or "",
                     "" if best is None else f"{best:.3f}",
                     "" if not acc else f"{acc[-1][1]:.3f}"])  # fmt: skip
    return "\n".join(
        [
            _about(raw.data),
            "",
            table(["run", "stopped by", "updates", "best test accuracy", "last"], body, "llrrr"),
        ]
    )


@renderer("gpu_check.context")
def context(raw: Raw) -> str:
    body = []
    for r in raw.data["runs"]:
        body.append([r["variant"], r.get("context"), r.get("seed"), _ms(r.get("min_loss")),
                     r.get("min_step"), _ms(r.get("final_loss")),
                     r.get("rising_from") or "still falling"])  # fmt: skip
    gaps = []
    for g in raw.data["gaps"]:
        if g["gap"] is None:
            continue
        noise = "" if g["seed_noise"] is None else f", seed spread {g['seed_noise']:.3f}"
        verdict = {True: "above", False: "within", None: "no second seed:"}[g["above_noise"]]
        gaps.append(f"- {g['context']}: `{g['variant']}` {g['gap']:+.3f} against `flash` "
                    f"({verdict} the seed noise{noise}).")  # fmt: skip
    return "\n".join([
        _about(raw.data), "",
        table(["variant", "context", "seed", "lowest held-out loss", "at update", "final",
               "rising from update"], body, "lrrrrrr"),
        *([""] + gaps if gaps else []),
    ])  # fmt: skip


@renderer("gpu_check.compile_here")
def compile_here(raw: Raw) -> str:
    """``make gpu-compile``'s record: the window's steps compiled here for the GPU target, the
    bundle a device command carries, and JAX's cache-key fields here beside the GPU's."""
    d, s = raw.data, raw.data["meta"]["settings"]
    mib = 2**20
    entries = d["entries"]
    store = sum(e.get("bytes", 0) for e in entries)
    bundle = d["bundle"]
    total = sum(bundle.values())
    out = [
        f"For window {s['window']}, the store holds {len(entries)} training steps compiled for "
        f"`{s['target']}` (deviceless) at commit "
        f"{short(raw.data['meta']['environment'].get('git_commit'))}: {store / mib:.2f} MiB "
        "(lzma). Carried by the device command: "
        + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in bundle.items())
        + f"; {total / mib:.1f} MiB of the {s['carry_limit_bytes'] / mib:.0f} MiB limit.",
    ]
    if d.get("key_fields"):
        state = {True: "same", False: "differs", None: "not recorded"}

        def cell(v) -> str:
            return "" if v is None else f"`{str(v)[:48]}`".replace("\n", " ") if v else "(none)"

        body = [[r["field"], cell(r["here"]), cell(r["gpu"]), state[r["match"]]]
                for r in d["key_fields"]]  # fmt: skip
        out += ["", f"JAX's persistent-cache key of a deviceless compile against the GPU's "
                f"(`{s['key_source']}`):", "",
                table(["field", "here (deviceless)", "last GPU run", ""], body, "llll")]  # fmt: skip
    return "\n".join(out)


# The file of the glue kernels' gpu tests (stages.GLUE_TESTS), as the tests' raw file names it.
GLUE_TESTS_FILE = "tests/test_kernels_glue_gpu.py"


def _glue_tests(raw: Raw | None) -> tuple[str, bool | None]:
    """The glue kernels' gpu tests in ``raw`` (``gpu_tests_<dev>_measured.json``): a sentence,
    and whether every one passed (None: not run on this device)."""
    found = [f for f in (raw.data["files"] if raw else []) if f["file"] == GLUE_TESTS_FILE]
    if not found:
        return (
            f"The glue kernels' gpu tests (`{GLUE_TESTS_FILE}`) have not run on this device.",
            None,
        )
    tests = found[0]["tests"]
    passed = sum(t["outcome"] == "passed" for t in tests)
    bad = [f"`{t['name']}` {t['outcome']}" for t in tests if t["outcome"] != "passed"]
    text = (f"The glue kernels' gpu tests (`{GLUE_TESTS_FILE}`, the Triton lowering against the "
            f"oracle and float64): {passed} of {len(tests)} passed"
            + (f"; {', '.join(bad)}." if bad else "."))  # fmt: skip
    return text, bool(tests) and passed == len(tests)


# The setting whose ratio to xla decides kernels/choice.py's AUTO_PICKS_PALLAS (the glue stage
# times it beside xla and beside others: studies/gpu_check/stages.py's glue_variants).
GLUE_CANDIDATE = "pallas"


@renderer("gpu_check.glue")
def glue(raw: Raw, tests: Raw | None = None) -> str:
    """The step with the glue kernels at each setting, timed side by side in one process per
    point: each setting's median, the ratio to the baseline (xla), which won and in how many
    rounds; then the verdict on ``AUTO_PICKS_PALLAS`` with the glue kernels' gpu tests."""
    s = raw.data["meta"]["settings"]
    body, ratios, failed = [], [], []
    for r in raw.data["rows"]:
        base = r["baseline"]
        for v, ratio in r["ratio"].items():
            ms_b, ms_v = r["median_ms"][base], r["median_ms"][v]
            # The winner and by how much: the loser's time over the winner's.
            won_by = f"`{v}` {1 / ratio:.3f}x" if ratio < 1 else f"`{base}` {ratio:.3f}x"
            rr = r["round_ratios"].get(v) or []
            rounds = sum((x < 1) == (ratio < 1) for x in rr)
            mem = r.get("memory_bytes") or {}
            body.append([glue_point(r), f"`{v}`", _ms(ms_b), _ms(ms_v), f"{ratio:.3f}", won_by,
                         f"{rounds} of {len(rr)}",
                         f"{gib(mem.get(base), 1)} / {gib(mem.get(v), 1)}"])  # fmt: skip
            ratios.append((r, v, ratio))
    names = list(s.get("side_by_side") or {}) or ["xla", GLUE_CANDIDATE]
    base = names[0]
    cand = GLUE_CANDIDATE if GLUE_CANDIDATE in names else names[-1]
    others = [v for v in names[1:] if v != cand]
    # The verdict reads the baseline and the candidate alone; other settings are reported beside.
    ratios = [x for x in ratios if x[1] == cand]
    for r in raw.data["rows"]:
        failed += [f"{glue_point(r)} at `{v}`: {st}" for v, st in r["status"].items()
                   if st != "ok" and v in (base, cand)]  # fmt: skip
    test_text, tests_ok = _glue_tests(tests)
    faster = [x for x in ratios if x[2] < 1]
    if ratios and len(faster) == len(ratios) and not failed and tests_ok:
        verdict = (f"**`{cand}` won at every point** (its step time / `{base}`'s "
                   f"{min(x[2] for x in ratios):.3f} to {max(x[2] for x in ratios):.3f}) and every "
                   "gpu test passed: `AUTO_PICKS_PALLAS` may be turned on.")  # fmt: skip
    else:
        why = []
        if not ratios:
            why.append("no point was timed at both settings")
        slower = [f"{glue_point(r)} ({x:.3f})" for r, _, x in ratios if x >= 1]
        if slower:
            why.append(f"`{cand}` was not faster at {', '.join(slower)}")
        if failed:
            why.append("a setting failed: " + "; ".join(failed))
        if tests_ok is None:
            why.append("the gpu tests have not run")
        elif not tests_ok:
            why.append("a gpu test did not pass")
        verdict = f"**Keep `AUTO_PICKS_PALLAS` off**: {'; '.join(why)}."
    sets = s.get("side_by_side") or {}
    beside = [_beside(raw.data["rows"], cand, v, sets.get(v, {}), sets.get(cand, {}))
              for v in others]  # fmt: skip
    steps = (s.get("rounds") or 0) * (s.get("repeats") or 0)
    sizes = ", ".join(dict.fromkeys(r["size"] for r in raw.data["rows"]))
    return "\n".join([
        _about(raw.data) + f" The training step ({sizes}; clip + AdamW, state donated, "
        f"{s.get('dtype')}) compiled on the device with the glue kernels (`model.layernorm_kernel`, "
        f"`mlp_kernel`, `loss_kernel`, `bias_kernel`) at each setting, in one process per point; "
        f"{s.get('warmup')} warm-up steps each, then {s.get('rounds')} rounds of "
        f"{s.get('repeats')} steps, the settings' order alternating from round to round; "
        f"medians of the {steps} timed steps; ratio = the setting's / `{base}`'s.", "",
        table(["point", "setting", f"`{base}` ms", "setting's ms", "ratio",
               "faster (by: slower / faster)", "rounds it won", "GiB (each)"], body, "llrrrlrr"),
        "",
        test_text, "", verdict, *(f"\n{b}" for b in beside),
    ])  # fmt: skip


@renderer("gpu_check.glue_summary")
def glue_summary(raw: Raw) -> str:
    """One sentence for the README: each setting's step time over the baseline's, the range
    over the points the device timed (measured), and where the table is."""
    rows = raw.data["rows"]
    base = rows[0]["baseline"] if rows else "xla"
    spans = []
    for v in dict.fromkeys(v for r in rows for v in r["ratio"]):
        xs = [r["ratio"][v] for r in rows if v in r["ratio"] and r["status"].get(v) == "ok"]
        if xs:
            spans.append(f"`{v}` {min(xs):.2f} to {max(xs):.2f}")
    points = "; ".join(glue_point(r) for r in rows)
    return (f"{_about(raw.data)} The training step's time over `{base}`'s (the glue in XLA's "
            f"fusions), the settings side by side in one process per point ({points}): "
            f"{', '.join(spans) or 'nothing timed'} (`pallas`: the glue kernels; `unrolled`: "
            "the kernels and the blocks unrolled).")  # fmt: skip


def _beside(rows: list[dict[str, Any]], cand: str, v: str, options: dict[str, Any],
            cand_options: dict[str, Any]) -> str:  # fmt: skip
    """Setting ``v`` against the candidate at every point both timed (their medians' ratio):
    not part of the verdict on ``AUTO_PICKS_PALLAS`` (e.g. ``unrolled``, the candidate with
    ``model.scan_layers: false``); the options named are those where ``v``'s differ."""
    changed = ", ".join(f"`model.{k}: {str(x).lower()}`" for k, x in options.items()
                        if cand_options.get(k) != x)  # fmt: skip
    cells = []
    for r in rows:
        ms = r["median_ms"]
        if ms.get(v) and ms.get(cand) and r["status"].get(v) == r["status"].get(cand) == "ok":
            cells.append(f"{glue_point(r)} {ms[v] / ms[cand]:.3f}")
    said = "; ".join(cells) if cells else "no point was timed at both"
    return (
        f"`{v}`{f' ({changed})' if changed else ''} against `{cand}`, step time / "
        f"`{cand}`'s: {said}."
    )
