"""Score ``fairseq-generate`` output the way the PowerNorm paper reports BLEU:
``powernorm-score``.

* ``--bleu iwslt14``: case-insensitive BLEU on the tokenized, BPE-removed
  output (``fairseq-generate --remove-bpe``), as fairseq's IWSLT14 recipe.
* ``--bleu wmt14``: case-sensitive tokenized BLEU after splitting hyphenated
  compounds (``a-b`` -> ``a ##AT##-##AT## b``), as fairseq's
  ``compound_split_bleu.sh`` and Vaswani et al. (2017).

Beside it, always, sacreBLEU on detokenized text (sacremoses detokenizer) with
its signature, against the raw reference when one is given. A file
``RAW_REF.sacrebleu`` beside it, written by a preparation whose test archive
is sacrebleu's own (``wmt14/full en-de``), names that test set and language
pair, and the signature then says so (``test:wmt14/full|lang:en-de``, as
``sacrebleu -t`` prints). Every line says which BLEU it is and how many
checkpoints were averaged.
"""

import json
import re
import sys
from pathlib import Path

from sacrebleu.metrics import BLEU

from ..common.files import atomic_path, check_regular_file, end_cleanly_on_sigterm
from ..common.flags import ArgumentParser


def scored(checkpoint):
    """The checkpoints a score is of: those ``checkpoint`` was averaged from,
    or itself, each with its update count."""
    from ..common import checkpoints

    state = checkpoints.load(checkpoint)
    return state.get("averaged_from") or [{"file": Path(checkpoint).name, "updates": checkpoints.updates(state)}]


def read_reference(path):
    check_regular_file(path, "reference")
    return Path(path).read_text(encoding="utf-8").splitlines()


def read_generate_output(path):
    """Hypotheses and references of a fairseq-generate log, in test-set order."""
    hyps, refs = {}, {}
    check_regular_file(path, "fairseq-generate log")  # a FIFO would hold the command for ever
    with open(path, encoding="utf-8") as f:
        for line in f:
            kind, _, rest = line.rstrip("\n").partition("-")
            if kind not in ("H", "T") or "\t" not in rest:
                continue
            fields = rest.split("\t")
            if not fields[0].isdigit():
                continue
            if kind == "H":
                hyps[int(fields[0])] = fields[2] if len(fields) > 2 else ""
            else:
                refs[int(fields[0])] = fields[1] if len(fields) > 1 else ""
    if not hyps or hyps.keys() != refs.keys():
        raise ValueError(f"{path}: no complete H-/T- pairs (is it fairseq-generate output?)")
    ids = sorted(hyps)
    return [hyps[i] for i in ids], [refs[i] for i in ids]


def split_compounds(line):
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def paper_bleu(scheme):
    """(sacreBLEU's metric, how a tokenized line is prepared for it, its name) of the paper's BLEU for
    ``scheme``: IWSLT14's case-insensitive tokenized BLEU, or WMT14's case-sensitive one on
    compound-split text."""
    if scheme == "wmt14":
        return BLEU(tokenize="none", force=True), split_compounds, "tokenized BLEU, case-sensitive, compound-split"
    return BLEU(tokenize="none", lowercase=True, force=True), str, "tokenized BLEU, case-insensitive"


def score(hyps, refs, scheme, lang, raw_refs=None, test_set=None):
    """{name: (score, description)} for the paper's BLEU and sacreBLEU;
    ``test_set`` is (name, language pair) when ``raw_refs`` is sacrebleu's own."""
    tok, prepare, tok_name = paper_bleu(scheme)
    tok_score = tok.corpus_score([prepare(h) for h in hyps], [[prepare(r) for r in refs]])
    from sacremoses import MosesDetokenizer  # 0.5 s to import: only where text is detokenized

    detok = MosesDetokenizer(lang=lang)
    detok_hyps = [detok.detokenize(h.split()) for h in hyps]
    if raw_refs is None:
        detok_refs, ref_name = [detok.detokenize(r.split()) for r in refs], "detokenized test references"
    else:
        if len(raw_refs) != len(hyps):
            raise ValueError(f"raw reference has {len(raw_refs)} lines, output has {len(hyps)}")
        detok_refs, ref_name = raw_refs, "raw references"
        if test_set:
            ref_name = f"sacrebleu's {test_set[0]} {test_set[1]} references"
    sacre = BLEU()
    sacre_score = sacre.corpus_score(detok_hyps, [detok_refs])
    signature = sacre.get_signature()
    if test_set:
        signature.info.update(test=test_set[0], lang=test_set[1])
    return {
        "bleu": (tok_score.score, tok_name),  # unrounded: the tables' intervals are of the scores as they are
        "sacrebleu": (sacre_score.score, f"sacreBLEU on detokenized output vs {ref_name}"),
        "sacrebleu_signature": str(signature),
        "sentences": len(hyps),
    }


def main(argv=None):
    end_cleanly_on_sigterm()
    parser = ArgumentParser(prog="powernorm-score", description=__doc__.split("\n\n")[0])
    parser.add_argument("generate_output", help="a fairseq-generate log (run with --remove-bpe)")
    parser.add_argument("--bleu", choices=("iwslt14", "wmt14"), required=True,
                        help="which of the paper's BLEU definitions to compute")
    parser.add_argument("--target-lang", default="en", help="language of the detokenizer (default: en)")
    parser.add_argument("--raw-ref", help="untokenized reference, one line per test sentence")
    parser.add_argument("--checkpoints", type=int, default=1, help="how many checkpoints were averaged")
    parser.add_argument("--json", help="also write the scores to this JSON file")
    parser.add_argument("--checkpoint", help="the checkpoint the output was generated with: the JSON names it and "
                        "the checkpoints it was averaged from (powernorm-average), with their updates")
    args = parser.parse_args(argv)

    try:
        hyps, refs = read_generate_output(args.generate_output)
        raw = read_reference(args.raw_ref) if args.raw_ref else None
        origin = Path(f"{args.raw_ref}.sacrebleu")
        test_set = tuple(origin.read_text().split()) if args.raw_ref and origin.is_file() else None
        if test_set is not None and len(test_set) != 2:
            raise ValueError(f"{origin}: expected 'TEST_SET LANGPAIR', e.g. 'wmt14/full en-de'")
        result = score(hyps, refs, args.bleu, args.target_lang, raw, test_set)
    except (OSError, ValueError) as err:
        parser.exit(2, f"powernorm-score: error: {err}\n")
    result["checkpoints_averaged"] = args.checkpoints
    if args.checkpoint:
        try:
            result["checkpoint"], result["scored"] = args.checkpoint, scored(args.checkpoint)
        except ValueError as err:  # the plugin's InputFileError: unreadable, or no checkpoint
            parser.exit(2, f"powernorm-score: error: --checkpoint {err}\n")
    for key in ("bleu", "sacrebleu"):
        value, name = result[key]
        print(f"{value:6.2f}  {name}; {args.checkpoints} checkpoint(s) averaged")
    print(f"        sacreBLEU signature: {result['sacrebleu_signature']}")
    if args.json:
        with atomic_path(args.json) as tmp:
            Path(tmp).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
