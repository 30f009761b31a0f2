"""A small C4-format corpus generated deterministically, so training and tests work offline.

The text comes from a template grammar over word lists: short stories whose characters keep
their names, pets and objects within a document (so a model can learn to copy from context),
recipes with numbered steps, arithmetic facts and weather reports. It is English-like with real
structure, so a small GPT's loss drops visibly within a minute of CPU training.

Determinism: only :class:`random.Random` with integer seeds and its ``random``/``randrange``/
``choice``/``shuffle`` methods are used, whose outputs are fixed across platforms and Python
versions. The *text* is therefore identical everywhere; the gzip bytes may differ between zlib
builds, which is why :func:`sample_digest` hashes the decompressed lines.

Layout (names as in allenai/c4 so the C4 code path reads them unchanged)::

    <dir>/c4-train.0000{0..3}-of-00004.json.gz      4 x 1000 documents
    <dir>/c4-validation.00000-of-00001.json.gz      1 x 250 documents
    <dir>/sample.json                               marker: generator version, seed, digest
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from pathlib import Path

GENERATOR_VERSION = 1
TRAIN_FILES, TRAIN_DOCS_PER_FILE = 4, 1000
VAL_FILES, VAL_DOCS_PER_FILE = 1, 250

NAMES = "Anna Ben Clara David Emma Felix Grace Henry Iris Jack Lena Max Nora Oscar Paul Rosa Sam Tara Victor Zoe".split()
PETS = "dog cat rabbit parrot horse goat duck turtle".split()
PET_NAMES = "Biscuit Pepper Shadow Sunny Pickles Maple Comet Luna Rocky Daisy".split()
OBJECTS = "kite ball hat book lamp bicycle drum map basket umbrella".split()
COLORS = "red blue green yellow white black orange purple".split()
PLACES = "village city farm island town valley forest harbor".split()
SPOTS = "bridge river market hill garden school library bakery".split()
FEELINGS = "happy sad tired excited worried proud".split()
FOODS = "bread soup cake pie salad pancakes stew cookies".split()
INGREDIENTS = "flour sugar butter milk eggs salt carrots onions apples rice honey cheese".split()
UNITS = "cups spoons grams pinches".split()
VERBS = "mix stir bake boil chop pour fold whisk".split()
WEATHER = "sunny rainy cloudy windy snowy foggy".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()


def _story(r: random.Random) -> str:
    # Entities are drawn once and reused, so later sentences are predictable from earlier ones.
    name, friend = r.sample(NAMES, 2)
    pet, pet_name = r.choice(PETS), r.choice(PET_NAMES)
    color, obj = r.choice(COLORS), r.choice(OBJECTS)
    place, spot, lost_at = r.choice(PLACES), r.choice(SPOTS), r.choice(SPOTS)
    lines = [
        f"The {color} {obj}",
        "",
        f"{name} lived in a small {place} near the {spot}. {name} had a {pet} named {pet_name} "
        f"and a {color} {obj}.",
        f"Every morning, {name} and {pet_name} walked to the {spot}.",
    ]
    if r.random() < 0.5:
        lines.append(f"One day, {name} lost the {color} {obj} near the {lost_at}. {name} was sad.")
        lines.append(
            f"{pet_name} the {pet} looked everywhere and found the {obj} near the {lost_at}."
        )
        lines.append(f'{name} said, "Thank you, {pet_name}!" Now {name} was {r.choice(FEELINGS)}.')
    else:
        lines.append(f"One day, {friend} came to visit {name} in the {place}.")
        lines.append(f'{friend} asked, "Can I play with your {color} {obj}?" {name} said yes.')
        lines.append(f"{name}, {friend} and {pet_name} played by the {spot} until the evening.")
    lines.append(f"That night, {name} put the {color} {obj} next to the bed and fell asleep.")
    return "\n".join(lines)


def _recipe(r: random.Random) -> str:
    food = r.choice(FOODS)
    items = r.sample(INGREDIENTS, r.randrange(3, 6))
    lines = [f"How to make {food}", "", f"To make {food} you need:"]
    for item in items:
        lines.append(f"- {r.randrange(1, 5)} {r.choice(UNITS)} of {item}")
    lines.append("")
    for i, item in enumerate(items, start=1):
        lines.append(f"Step {i}: {r.choice(VERBS)} the {item}.")
    minutes = 5 * r.randrange(2, 13)
    lines.append(f"Step {len(items) + 1}: cook for {minutes} minutes. Your {food} is ready!")
    return "\n".join(lines)


def _arithmetic(r: random.Random) -> str:
    lines = ["Simple sums", ""]
    for _ in range(r.randrange(4, 9)):
        a, b = r.randrange(0, 11), r.randrange(0, 11)
        if r.random() < 0.5:
            lines.append(
                f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."
            )
        else:
            lines.append(f"{a} + {b} = {a + b}.")
    return "\n".join(lines)


def _weather(r: random.Random) -> str:
    place = r.choice(PLACES)
    start = r.randrange(len(DAYS))
    lines = [f"Weather in the {place}", ""]
    temp = r.randrange(0, 25)
    for i in range(r.randrange(3, 7)):
        day = DAYS[(start + i) % len(DAYS)]
        temp = max(-5, min(35, temp + r.randrange(-3, 4)))
        lines.append(f"On {day} it will be {r.choice(WEATHER)} with a high of {temp} degrees.")
    return "\n".join(lines)


_KINDS = (_story, _story, _recipe, _arithmetic, _weather)


def document(seed: int, split: str, index: int) -> dict[str, str]:
    """One C4-format record (``text``, ``timestamp``, ``url``); a pure function of its arguments."""
    # A per-document generator makes any document reproducible on its own.
    r = random.Random(f"{seed}/{split}/{index}")
    parts = [r.choice(_KINDS)(r) for _ in range(r.randrange(1, 4))]
    ts = f"2019-04-{r.randrange(1, 29):02d}T{r.randrange(24):02d}:{r.randrange(60):02d}:{r.randrange(60):02d}Z"
    return {
        "text": "\n\n".join(parts),
        "timestamp": ts,
        "url": f"https://sample.linear-gpt2.invalid/{split}/{index}",
    }


def file_names(split: str) -> list[str]:
    n = TRAIN_FILES if split == "train" else VAL_FILES
    return [f"c4-{split}.{i:05d}-of-{n:05d}.json.gz" for i in range(n)]


def _lines(seed: int, split: str, file_index: int) -> list[str]:
    per = TRAIN_DOCS_PER_FILE if split == "train" else VAL_DOCS_PER_FILE
    start = file_index * per
    return [json.dumps(document(seed, split, start + i)) + "\n" for i in range(per)]


def sample_digest(seed: int = 0) -> str:
    """sha256 of all generated lines (train then validation), independent of gzip's bytes."""
    h = hashlib.sha256()
    for split in ("train", "validation"):
        for i, _ in enumerate(file_names(split)):
            for line in _lines(seed, split, i):
                h.update(line.encode())
    return h.hexdigest()


def ensure_sample(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the sample corpus into ``directory`` unless the marker says it is already there.

    Files are written to a temporary name and renamed, and the marker last, so an interrupted
    run leaves no half-written file that a later run would accept.
    """
    out = Path(directory)
    marker = out / "sample.json"
    want = {"generator_version": GENERATOR_VERSION, "seed": seed}
    if marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except json.JSONDecodeError:
            have = {}
        names = [n for s in ("train", "validation") for n in file_names(s)]
        if {k: have.get(k) for k in want} == want and all((out / n).is_file() for n in names):
            return out
    out.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    for split in ("train", "validation"):
        for i, name in enumerate(file_names(split)):
            lines = _lines(seed, split, i)
            for line in lines:
                h.update(line.encode())
            tmp = out / (name + ".tmp")
            with (
                open(tmp, "wb") as raw,
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
            ):
                gz.write("".join(lines).encode())
            os.replace(tmp, out / name)
    marker.write_text(json.dumps({**want, "sha256_lines": h.hexdigest()}, indent=1) + "\n")
    return out
