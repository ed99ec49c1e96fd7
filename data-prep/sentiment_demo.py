"""A small sentiment set for demos and tests, written offline from templates:
``python data-prep/sentiment_demo.py N SEED > demo.tsv`` (text<TAB>label).

Each sentence is built from a template whose label is true of its text: a
profit, sales or order figure that rises, or a loss that narrows, is
positive; the opposite is negative; a figure or fact with no direction is
neutral. Some words cross classes ("loss rose" is negative, "profit rose"
positive; "fell" is in both), so a bag of words does not decide every line.
The classes come in Financial PhraseBank's all-agree proportions (about 61%
neutral, 25% positive, 14% negative). This is not Financial PhraseBank, and
no number from it is a PhraseBank result.
"""

import random
import sys

COMPANIES = ["Aspo", "Componenta", "Elisa", "Fiskars", "Kemira", "Konecranes", "Metso", "Nokian Tyres", "Orion",
             "Outokumpu", "Ponsse", "Raisio", "Ramirent", "Stockmann", "Tieto", "Uponor", "Vaisala", "Wartsila",
             "YIT", "Lassila & Tikanoja"]
GOOD = ["net sales", "operating profit", "order intake", "net profit", "earnings per share", "operating margin",
        "revenue", "cash flow"]
BAD = ["operating loss", "net loss", "pre-tax loss", "costs"]
UP = ["rose", "increased", "grew", "climbed", "went up"]
DOWN = ["fell", "decreased", "dropped", "declined", "went down"]
PERIODS = ["in the first quarter", "in the second quarter", "in January-June", "in 2008", "in the third quarter",
           "for the full year", "in the review period"]
CITIES = ["Helsinki", "Espoo", "Tampere", "Vantaa", "Oulu", "Turku", "Stockholm"]
THINGS = ["a new distribution centre", "its annual report", "a stock exchange release", "a new chief executive",
          "its interim report", "the agenda of the annual general meeting"]


def money(rng):
    return f"EUR {rng.randint(2, 900)}.{rng.randint(0, 9)} mn"


def sentence(rng, label):
    c, p = rng.choice(COMPANIES), rng.choice(PERIODS)
    pct = f"{rng.randint(1, 60)} %"
    direction = {"positive": (UP, DOWN), "negative": (DOWN, UP)}
    if label in direction:
        good_way, bad_way = direction[label]
        metric, way = (rng.choice(GOOD), good_way) if rng.random() < 0.7 else (rng.choice(BAD), bad_way)
        return rng.choice([
            f"{c} 's {metric} {rng.choice(way)} by {pct} to {money(rng)} {p} .",
            f"{metric.capitalize()} {rng.choice(way)} by {pct} {p} , {c} said .",
            f"{c} said its {metric} {rng.choice(way)} {p} , to {money(rng)} .",
        ])
    metric = rng.choice(GOOD + BAD)
    return rng.choice([
        f"{c} is headquartered in {rng.choice(CITIES)} .",
        f"{c} 's {metric} was {money(rng)} {p} .",
        f"{c} will publish {rng.choice(THINGS)} {p} .",
        f"{c} has operations in {rng.randint(3, 40)} countries and employs {rng.randint(200, 20000)} people .",
        f"The figures for {metric} {p} are given in {c} 's report .",
    ])


def main(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        u = rng.random()
        label = "neutral" if u < 0.61 else "positive" if u < 0.86 else "negative"
        print(f"{sentence(rng, label)}\t{label}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
