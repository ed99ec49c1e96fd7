"""Machine translation's own test of a difference: sacreBLEU's paired bootstrap resampling (Koehn,
2004; sacreBLEU's ``--paired-bs``) of each row's translations against the baseline's, seed by seed, on
the same test set and with the BLEU the table reports (1,000 resamples). It answers whether a system
beats the baseline on this test set; the table's t-interval over seeds answers how much the training
seed moves the score. Both are shown."""

import json
from pathlib import Path

from ...common.files import check_regular_file
from ..score import paper_bleu, read_generate_output

SAMPLES = 1000


def translations(row, run):
    """(hypotheses, references) of a scored run: the generate output of the checkpoint its score names."""
    check_regular_file(Path(run, row.score_file), "score")
    result = json.loads(Path(run, row.score_file).read_text())
    output = Path(run, f"generate-test-{Path(result['checkpoint']).stem}.txt")
    check_regular_file(output, "generate output")
    return read_generate_output(output)


def paired(row, base, runs, base_runs):
    """{seed: {score, mean, ci, p}} of ``row`` against ``base`` for each seed both scored (``runs`` and
    ``base_runs``: {seed: run directory}), and the test's sacreBLEU signature; ({}, None) for a language
    model's rows or where a run's translations cannot be read."""
    from sacrebleu.significance import PairedTest

    if row.lm:
        return {}, None
    found, signature = {}, None
    for seed in sorted(set(runs) & set(base_runs)):
        try:
            hyps, refs = translations(row, runs[seed])
            base_hyps, base_refs = translations(base, base_runs[seed])
        except (OSError, ValueError, KeyError):
            continue
        if refs != base_refs:
            continue  # not the same test set: no paired test
        metric, prepare, _ = paper_bleu("wmt14" if row.dataset == "wmt14" else "iwslt14")
        test = PairedTest([(base.name, [prepare(h) for h in base_hyps]), (row.name, [prepare(h) for h in hyps])],
                          {"BLEU": metric}, [[prepare(r) for r in refs]], test_type="bs", n_samples=SAMPLES,
                          n_jobs=1)
        signatures, results = test()
        name = next(iter(signatures))
        result = results[name][1]
        found[seed] = dict(score=result.score, base=results[name][0].score, mean=result.mean, ci=result.ci,
                           p=result.p_value)
        signature = str(signatures[name])
    return found, signature
