"""Write ``corpus.txt``: the training text of ``examples/train_lm.py``.

The text is generated here, from a small grammar of our own, so that the repository owns
every word of it: the day-book of an invented harbour town, Mossgate. Each line is one
entry of one to three sentences (short notes, trade records, weather, sums, bits of
talk), so lines have very different lengths, which is what the example needs to show
token-weighted accumulation. The generator is seeded: running it again rewrites the same
file byte for byte.

    python examples/data/make_corpus.py            # rewrites examples/data/corpus.txt
    python examples/data/make_corpus.py --lines 200 --out /tmp/small.txt
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

PEOPLE = [
    "the miller", "the ferry keeper", "the weaver", "the net mender", "old Tamsin",
    "the baker", "the harbour master", "young Pell", "the lamp lighter", "the rope maker",
    "the schoolteacher", "Ada of the salt sheds", "the two Orrin brothers", "the cooper",
    "the tide watcher", "the widow Brack",
]
GOODS = ["sacks of barley", "barrels of cider", "coils of rope", "baskets of eels",
         "bolts of grey cloth", "crates of lamp oil", "loaves of rye bread", "jars of honey",
         "bundles of reeds", "blocks of salt", "baskets of apples", "nets"]
PLACES = ["the east bridge", "the salt sheds", "the long quay", "the mill pond",
          "the chapel steps", "the market square", "the north lighthouse", "the boat yard",
          "the willow lane", "the toll gate", "the fish market", "the upper meadow"]
BOATS = ["the Heron", "the Patient Ann", "the Little Gull", "the Morrow", "the Red Kettle"]
TIMES = ["at dawn", "before noon", "at midday", "after the bell", "in the afternoon",
         "at dusk", "late in the evening", "just after sunrise"]
WEATHER = [
    "A grey fog lay on the water until {time_late}.",
    "Rain came in from the sea and did not stop.",
    "The wind turned to the {wind} and the gulls flew low.",
    "Clear sky, a cold wind from the {wind}, the tide high {time}.",
    "Thunder over the hills, but no rain reached the town.",
    "A warm day. The mill pond was flat as glass.",
    "Snow on the roofs {time}, gone by evening.",
]
WINDS = ["north", "south", "east", "west"]
NUMBERS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen"]
CARRY = ["carried", "brought", "sold", "took", "delivered", "rowed"]
QUESTIONS = [
    ("Is the mill open today?", ["Only until noon.", "Not while the wheel is broken.",
                                 "Yes, and the flour is fine."]),
    ("Has the Heron come back?", ["Not yet, the sea is too rough.", "She came in at dawn.",
                                  "We saw her lights past the lighthouse."]),
    ("Who rang the bell?", ["The tide watcher, as always.", "Nobody knows.",
                            "Young Pell, for a joke."]),
    ("Will it rain tomorrow?", ["The gulls say it will.", "Not with this wind.",
                                "Ask the tide watcher."]),
    ("How many eels did you catch?", ["More than yesterday.", "Not enough to sell.",
                                      "Count them yourself."]),
]
SPEAK = ["asked", "said", "called", "whispered"]
REPLY = ["answered", "said", "laughed", "replied"]


def cap(text: str) -> str:
    """Upper-case the first letter only (``str.capitalize`` would lower the rest)."""
    return text[:1].upper() + text[1:]


def number(n: int) -> str:
    return NUMBERS[n] if n < len(NUMBERS) else str(n)


def sentence(rng: random.Random, kind: str) -> str:
    person = rng.choice(PEOPLE)
    if kind == "trade":
        n = rng.randint(2, 12)
        return (f"{cap(person)} {rng.choice(CARRY)} {number(n)} {rng.choice(GOODS)} "
                f"to {rng.choice(PLACES)} {rng.choice(TIMES)}.")
    if kind == "boat":
        boat = rng.choice(BOATS)
        verb = rng.choice(["left the harbour", "came in", "stayed at anchor", "was mended"])
        return f"{cap(boat)} {verb} {rng.choice(TIMES)}."
    if kind == "weather":
        return rng.choice(WEATHER).format(time=rng.choice(TIMES), wind=rng.choice(WINDS),
                                          time_late=rng.choice(["noon", "midday", "evening"]))
    if kind == "sum":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"{cap(number(a))} and {number(b)} make {number(a + b)}."
    if kind == "talk":
        question, answers = rng.choice(QUESTIONS)
        other = rng.choice([p for p in PEOPLE if p != person])
        answer = rng.choice(answers)
        answer = answer[:-1] + "," if answer.endswith(".") else answer
        return (f"\"{question}\" {rng.choice(SPEAK)} {person}. "
                f"\"{answer}\" {other} {rng.choice(REPLY)}.")
    if kind == "count":
        n = rng.randint(0, 18)
        thing = rng.choice(["gulls on the roof", "boats in the harbour", "lamps on the quay",
                            "children at the school", "carts on the bridge"])
        return f"{cap(number(n))} {thing} {rng.choice(TIMES)}."
    raise ValueError(kind)


KINDS = ["trade", "trade", "boat", "weather", "sum", "talk", "count"]


def entry(rng: random.Random, day: int) -> str:
    parts = [sentence(rng, rng.choice(KINDS)) for _ in range(rng.choice([1, 1, 1, 2, 2, 3]))]
    if rng.random() < 0.15:
        parts.insert(0, f"Day {day}.")
    while len(" ".join(parts)) > 180:  # keep lines within the example's block size
        parts.pop()
    return " ".join(parts)


def make_corpus(lines: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return "".join(entry(rng, 1 + i // 9) + "\n" for i in range(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "corpus.txt"))
    args = parser.parse_args(argv)
    text = make_corpus(args.lines, args.seed)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {args.lines} lines, {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
