"""The tables and their rows: ``configs/<table>-<row>.sh``, the script that
trains a row and the one that scores it, and the paper's number where the
config's first line gives it (``paper: 35.9 BLEU``)."""

import re
from dataclasses import dataclass
from pathlib import Path

from ...common.files import check_regular_file

ROOT = Path(__file__).resolve().parents[3]  # the checkout: configs/ and scripts/
CONFIGS = ROOT / "configs"
SCRIPTS = ROOT / "scripts"
TABLES = ("iwslt14", "wmt14", "twt", "lm-ptb", "lm-wikitext103", "quickstart", "field")


@dataclass(frozen=True)
class Row:
    table: str
    name: str
    config: Path
    dataset: str  # what train.sh / train-lm.sh and the scoring script call it
    paper: float = None  # the paper's number for this row, where it gives one

    @property
    def lm(self):
        return self.table.startswith("lm-")

    @property
    def metric(self):
        return "perplexity" if self.lm else "BLEU"

    @property
    def train_script(self):
        return SCRIPTS / ("train-lm.sh" if self.lm else "train.sh")

    @property
    def score_script(self):
        return SCRIPTS / ("evaluate-lm.sh" if self.lm else "evaluate.sh")

    @property
    def score_file(self):
        """What the scoring script writes into the run's directory."""
        return "perplexity-test.json" if self.lm else "bleu-test.json"

    @property
    def scored_checkpoint(self):
        """The checkpoint the score is of (evaluate.sh averages the last epochs: newer than the last)."""
        return "checkpoint_best.pt" if self.lm else "checkpoint_last.pt"


def names(table):
    """The table's rows in order: the LayerNorm baseline(s) first (their names
    end in ``ln``), then the others by name."""
    found = sorted(p.name[len(table) + 1:-3] for p in CONFIGS.glob(f"{table}-*.sh"))
    return sorted(found, key=lambda name: not name.endswith("ln"))


def row(table, name):
    config = CONFIGS / f"{table}-{name}.sh"
    check_regular_file(config, "config")
    text = config.read_text()
    dataset = re.search(r"^DATASET=(\w+)", text, re.M)
    paper = re.search(r"paper: ([\d.]+) (?:BLEU|perplexity)", text.splitlines()[0])
    default = "ptb" if table.startswith("lm-") else "iwslt14"  # the scripts' own defaults
    return Row(table, name, config, dataset.group(1) if dataset else default,
               float(paper.group(1)) if paper else None)


def score_of(row, run):
    """(the row's metric, sacreBLEU or None, sacreBLEU's signature or None) from a scored run's file."""
    import json

    check_regular_file(Path(run, row.score_file), "score")
    result = json.loads(Path(run, row.score_file).read_text())
    if row.lm:
        return result["perplexity"], None, None
    return result["bleu"][0], result["sacrebleu"][0], result.get("sacrebleu_signature")
