"""The shell recipes end to end on a tiny IWSLT14-shaped archive."""

import json
import os
import random
import re
import subprocess
import tarfile

import pytest

from support import BIN, ROOT, TINY, cli, norm_query, once, processes_mentioning, stand_ins
from powernorm_fairseq.norms.placement import PLACEMENTS

pytestmark = pytest.mark.slow

TEST_SETS = ["IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
             "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012"]
WORDS_DE = "Das Haus ist groß und der Baum steht im Garten neben dem alten Auto".split()
WORDS_EN = "The house is big and the tree stands in the garden next to the old car".split()


def sh(*args, check=True, path=()):
    env = {**os.environ, "PATH": ":".join(map(str, [*path, BIN, os.environ["PATH"]])), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["bash", *map(str, args)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def recipe(*args, check=True):
    """:func:`sh` with the stand-ins first on PATH (``support.commands.stand_ins``):
    the recipe's fairseq commands, sacremoses, powernorm-average and the
    table's and study's commands run in forks of the fork servers, and the
    registry query is answered at once. The
    tests that signal a recipe, or check its options' effects, run it as it is."""
    return sh(*args, check=check, path=[stand_ins()])


def sentence(rng, n):
    idx = [rng.randrange(len(WORDS_DE)) for _ in range(n)]
    return " ".join(WORDS_DE[i] for i in idx) + " .", " ".join(WORDS_EN[i] for i in idx) + " ."


def make_archive(path, n_train=300, dirty=False):
    """A de-en.tgz with IWSLT14's member names and TED markup; ``dirty`` adds
    empty lines and bytes that are not UTF-8, as raw corpora can have."""
    rng = random.Random(0)
    root = path.parent / "de-en"
    root.mkdir()
    de, en = [], []
    for talk in range(3):  # the per-talk header lines of train.tags.*
        de += [f"<url>http://www.ted.com/talks/{talk}.html</url>", "<keywords>talks, science</keywords>",
               f"<talkid>{talk}</talkid>", f"<title>Ein Vortrag {talk}</title>",
               f"<description>Eine Beschreibung {talk}</description>"]
        en += [f"<url>http://www.ted.com/talks/{talk}.html</url>", "<keywords>talks, science</keywords>",
               f"<talkid>{talk}</talkid>", f"<title>A talk {talk}</title>",
               f"<description>A description {talk}</description>"]
        for _ in range(n_train // 3):
            s, t = sentence(rng, rng.randint(3, 15))
            de.append(s), en.append(t)
    de.append("kurz"), en.append(" ".join(["far", "too", "long", "for", "ratio"] * 3))  # ratio > 1.5
    de.append(" ".join(["Haus"] * 180)), en.append(" ".join(["house"] * 180))  # longer than 175
    if dirty:
        de += ["", "", "Das Haus \udcff ist gro\udce9"]  # an empty side, an empty pair, latin-1 bytes
        en += ["the house .", "", "the house is big"]
    for lang, text in (("de", de), ("en", en)):
        (root / f"train.tags.de-en.{lang}").write_bytes(
            ("\n".join(text) + "\n").encode("utf-8", errors="surrogateescape"))
    for name in TEST_SETS + ["IWSLT14.TED.tst2013"]:  # the last one must not be used
        for lang, words in (("de", 0), ("en", 1)):
            segs = [f'<seg id="{i + 1}"> {sentence(rng, 6)[words]} {name[-4:]}’s </seg>' for i in range(4)]
            (root / f"{name}.de-en.{lang}.xml").write_text(
                f'<mteval>\n<srcset setid="{name}" srclang="german">\n<doc docid="1">\n'
                + "\n".join(segs) + "\n</doc>\n</srcset>\n</mteval>\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(root, arcname="de-en")
    return path


@pytest.fixture(scope="session")
def iwslt(tmp_path_factory):
    """The tiny archive prepared once for the session (its tests only read it)."""
    def prepare(tmp):
        recipe("data-prep/prepare-iwslt14.sh", "--archive", make_archive(tmp / "de-en.tgz"), "--out", tmp / "prepared")

    tmp = once(tmp_path_factory, "iwslt", prepare)
    return tmp / "de-en.tgz", tmp / "prepared", None


def lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_iwslt14_preparation_outputs(iwslt):
    _, out, _ = iwslt
    tmp = out / "tmp"
    cleaned = lines(tmp / "train.tags.de")
    assert not [l for l in cleaned if "<" in l or "url" in l or "talkid" in l]
    assert "ein vortrag 0" in cleaned  # <title> kept without its tags, lowercased
    assert len(cleaned) == 300 + 3 + 3  # sentences, titles, descriptions; two bad pairs dropped
    assert not [l for l in cleaned if len(l.split()) > 175]
    assert "kurz" not in cleaned  # the 1:15 pair fails the 1.5 ratio
    for lang in ("de", "en"):
        full = lines(tmp / f"train.tags.{lang}")
        assert lines(tmp / f"valid.{lang}") == full[22::23]
        assert lines(tmp / f"train.{lang}") == [l for i, l in enumerate(full, 1) if i % 23]
        for split in ("train", "valid", "test"):
            text = (tmp / f"{split}.{lang}").read_text(encoding="utf-8")
            assert text == text.lower()
    test = lines(tmp / "test.en")
    assert len(test) == 5 * 4
    assert [l.split()[-2] for l in test[::4]] == ["2010", "2012", "2010", "2011", "2012"]
    assert test[0].endswith("2010 &apos;s")  # ’ became ' (then Moses-escaped)
    raw = lines(out / "raw" / "test.en")
    # the reference sacreBLEU scores is the test set's own text: ’ kept
    assert len(raw) == 20 and raw[0].endswith("2010’s") and "<seg" not in raw[0]
    bpe_test = (tmp / "bpe" / "test.de").read_text(encoding="utf-8")
    assert "@@ " in bpe_test  # unseen words are split into BPE units
    assert len(lines(tmp / "bpe" / "test.de")) == 20
    assert (out / "bin" / ".done").exists() and (out / "bin" / "dict.en.txt").exists()
    assert (out / "bin" / "dict.en.txt").read_text() == (out / "bin" / "dict.de.txt").read_text()


def test_iwslt14_empty_lines_and_invalid_utf8(tmp_path):
    archive = make_archive(tmp_path / "de-en.tgz", dirty=True)
    out = tmp_path / "prepared"
    proc = recipe("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", out)
    assert "train.tags.raw.de: 1 line(s) with invalid UTF-8, bytes replaced by U+FFFD" in proc.stderr
    cleaned = lines(out / "tmp" / "train.tags.de")
    assert len(cleaned) == 300 + 3 + 3 + 1  # the empty side and the empty pair are dropped by cleaning
    assert "das haus \ufffd ist gro \ufffd" in cleaned  # the replacement is kept, tokenized
    assert (out / "bin" / ".done").exists()


def test_iwslt14_disk_full_leaves_nothing_that_passes_for_done(tmp_path):
    """A file-size limit makes writes fail mid-way as a full disk does; a rerun
    with room finishes, and only then is the data-bin marked done."""
    archive = make_archive(tmp_path / "de-en.tgz")
    out = tmp_path / "prepared"
    full = subprocess.run(["bash", "-c", f"ulimit -f 20; bash data-prep/prepare-iwslt14.sh --archive {archive} "
                           f"--out {out}"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert full.returncode != 0
    assert not (out / "bin" / ".done").exists()
    assert not [p for p in out.rglob("*") if p.is_file() and p.stat().st_size >= 20 * 1024
                and not p.name.endswith(".tmp")], "a file at the size limit was kept as complete"
    recipe("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", out)
    assert (out / "bin" / ".done").exists()
    assert len(lines(out / "tmp" / "test.en")) == 20


def test_iwslt14_rerun_skips_and_force_redoes(iwslt):
    archive, out, _ = iwslt
    again = sh("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", out)
    assert "already prepared" in again.stderr


@pytest.mark.parametrize("content, message", [
    (b"this is not a gzip file", "corrupt or unreadable archive"),
    (None, "no such file"),
])
def test_iwslt14_bad_archive_stops_with_its_name(tmp_path, content, message):
    archive = tmp_path / "de-en.tgz"
    if content is not None:
        archive.write_bytes(content)
    proc = sh("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", tmp_path / "out", check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and str(archive) in proc.stderr
    assert not (tmp_path / "out" / "bin").exists()


def test_iwslt14_truncated_archive_is_rejected(tmp_path, iwslt):
    archive, _, _ = iwslt
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(archive.read_bytes()[:200])
    proc = sh("data-prep/prepare-iwslt14.sh", "--archive", cut, "--out", tmp_path / "out", check=False)
    assert proc.returncode != 0 and str(cut) in proc.stderr
    assert not (tmp_path / "out" / "bin").exists()


def make_wmt_archives(directory):
    """The five WMT14 archives with the members the recipe reads."""
    rng = random.Random(1)
    directory.mkdir()
    members = {
        "training-parallel-europarl-v7.tgz": "training/europarl-v7.de-en",
        "training-parallel-commoncrawl.tgz": "commoncrawl.de-en",
        "training-parallel-nc-v12.tgz": "training/news-commentary-v12.de-en",
    }
    def archive(name, pairs, member):  # member(lang, kind, pairs) -> (its name, its text)
        with tarfile.open(directory / name, "w:gz") as tar:
            for lang, kind in (("de", "ref"), ("en", "src")):
                arcname, text = member(lang, kind, [p[lang == "en"] for p in pairs])
                f = directory / "member"
                f.write_text(text)
                tar.add(f, arcname=arcname)

    def plain(stem):
        return lambda lang, kind, sides: (f"{stem}.{lang}", "\n".join(sides) + "\n")

    def sgm(lang, kind, sides):
        segs = "\n".join(f'<seg id="{i + 1}"> {side}  ’s</seg>' for i, side in enumerate(sides))
        return (f"test-full/newstest2014-deen-{kind}.{lang}.sgm",
                f'<refset setid="newstest2014">\n<doc>\n{segs}\n</doc>\n</refset>\n')

    for name, stem in members.items():
        pairs = [sentence(rng, rng.randint(3, 12)) for _ in range(60)]
        archive(name, pairs + [("Ein hochmodernes Haus .", "A state-of-the-art house .")], plain(stem))
    archive("dev.tgz", [sentence(rng, 6) for _ in range(7)], plain("dev/newstest2013"))
    archive("test-full.tgz", [sentence(rng, 5) for _ in range(9)], sgm)
    return directory


def test_wmt14_preparation(tmp_path):
    archives = make_wmt_archives(tmp_path / "archives")
    out = tmp_path / "wmt"
    recipe("data-prep/prepare-wmt14en2de.sh", "--archive-dir", archives, "--out", out)
    tok = lines(out / "tmp" / "train.tok.en")
    assert len(tok) == 3 * 61
    assert "A state @-@ of @-@ the @-@ art house ." in tok  # Moses -a splits hyphens
    assert len(lines(out / "raw" / "valid.en")) == 7 and len(lines(out / "raw" / "test.de")) == 9
    raw_ref = lines(out / "raw" / "test.de")
    assert "<seg" not in raw_ref[0] and raw_ref[0].endswith(" ’s")  # untouched but for sacreBLEU's cleaning
    tokenized = lines(out / "tmp" / "test.tok.de")[0]
    assert "&apos;" in tokenized and "’" not in tokenized  # ’ became ' before tokenizing, as fairseq
    # a test-full.tgz that is not sacrebleu's wmt14/full (by its md5) is not called so
    assert not (out / "raw" / "test.de.sacrebleu").exists()
    assert len(lines(out / "tmp" / "bpe" / "test.en")) == 9
    assert (out / "bin" / ".done").exists()
    (archives / "dev.tgz").unlink()
    proc = recipe("data-prep/prepare-wmt14en2de.sh", "--archive-dir", archives, "--out", tmp_path / "again",
                  check=False)
    assert proc.returncode != 0 and f"missing archive: {archives}/dev.tgz" in proc.stderr


def epoch_records(log):
    """{epoch: (train loss, valid loss)} from fairseq's end-of-epoch records,
    in its simple or json log format."""
    found = {}
    for tag, body in re.findall(r"^\S+ \S+ \| INFO \| (train|valid) \| (.*)$", log, re.M):
        row = ({k.removeprefix(f"{tag}_"): v for k, v in json.loads(body).items()} if body.startswith("{")
               else dict(item.split(" ", 1) for item in body.split(" | ") if " " in item))
        found.setdefault(int(row["epoch"]), {})[tag] = float(row["loss"])
    return {epoch: (r["train"], r["valid"]) for epoch, r in found.items()}


def console_epochs(text):
    return {int(e): (float(t), float(v)) for e, t, v in
            re.findall(r"^  epoch +(\d+)(?:/\d+)? \| train loss ([\d.]+) \| valid loss ([\d.]+) \|", text, re.M)}


def test_train_average_evaluate(iwslt, tmp_path):
    """The recipes show a line per epoch, keep fairseq's whole log in the
    run's train.log and generate.log, and show it all with --verbose."""
    _, out, _ = iwslt
    save = tmp_path / "run"
    flags = ["--dataset", "iwslt14", "--data", out / "bin", "--norm", "pn", "--gpus", "0", "--save-dir", save,
             "--tokens-per-update", "1000"]
    fairseq_flags = [*TINY, "--warmup-updates", "4", "--max-tokens", "1000", "--tensorboard-logdir", ""]
    quiet = recipe("scripts/train.sh", *flags, "--", *fairseq_flags, "--max-epoch", "3")
    assert (save / "checkpoint3.pt").exists() and "done training" in (save / "train.log").read_text()
    log = (save / "train.log").read_text()
    assert console_epochs(quiet.stderr) == epoch_records(log) and sorted(epoch_records(log)) == [1, 2, 3]
    assert "PowerNormTransformerEncoder(" in log and "PowerNormTransformerEncoder(" not in quiet.stderr + quiet.stdout
    assert f"log: {save / 'train.log'}" in quiet.stderr and "| INFO |" not in quiet.stderr + quiet.stdout
    # epoch k of the --max-epoch N (and the time left: test_tools.py), on the console and in the run's log
    assert re.search(r"^  epoch 1/3 \| train loss ", quiet.stderr, re.M), quiet.stderr
    assert re.search(r"^\S+ \S+ \| INFO \| powernorm_fairseq\.progress \| epoch 3/3 \| train loss ", log, re.M)
    more = recipe("scripts/train.sh", *flags, "--", *fairseq_flags, "--max-epoch", "4", "--log-format", "json")
    assert "resumed from" in more.stderr and "(epoch 4, " in more.stderr
    assert console_epochs(more.stderr) == {4: epoch_records((save / "train.log").read_text())[4]}
    verbose = recipe("scripts/train.sh", *flags, "--verbose", "--", *fairseq_flags, "--max-epoch", "4")
    assert "| INFO | fairseq_cli.train |" in verbose.stdout and "done training" in verbose.stdout
    log_before, command_before = (save / "train.log").read_bytes(), (save / "command.txt").read_text()
    bad = recipe("scripts/train.sh", *flags, "--seed", "2", "--", *fairseq_flags, "--pn-eps", "-1", check=False)
    assert bad.returncode != 0 and bad.stderr.splitlines()[-1].startswith("fairseq-train: error: ")
    assert "--pn-eps" in bad.stderr.splitlines()[-1] and "failed" not in bad.stderr
    # refused: nothing written into the run's directory
    assert (save / "train.log").read_bytes() == log_before and (save / "command.txt").read_text() == command_before
    assert "--seed 1" in command_before
    proc = recipe("scripts/evaluate.sh", "--dataset", "iwslt14", "--data", out / "bin", "--save-dir", save,
                 "--average", "2", "--cpu")
    assert "| INFO |" not in proc.stderr and "Translated 20 sentences" in (save / "generate.log").read_text()
    assert (save / "averaged_last_2.pt").exists()
    result = json.loads((save / "bleu-test.json").read_text())
    assert result["sentences"] == 20 and result["checkpoints_averaged"] == 2
    assert "case-insensitive" in result["bleu"][1] and "raw references" in result["sacrebleu"][1]
    assert "2 checkpoint(s) averaged" in proc.stdout


def test_sentencepiece_prepare_train_evaluate_interactive(iwslt, tmp_path):
    """--bpe sentencepiece end to end: a joint model trained on the tokenized
    training text and saved beside the data, the data encoded then binarized,
    and generate, evaluate.sh and fairseq-interactive decoding it back to the
    tokenized text the BLEU definitions score."""
    archive, bpe_out, _ = iwslt
    out = tmp_path / "spm"
    recipe("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", out, "--bpe", "sentencepiece",
          "--bpe-size", "60")
    model = out / "bin" / "spm.model"
    assert model.exists() and (out / "bin" / ".done").exists()
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert 40 <= sp.get_piece_size() <= 60
    encoded, tokenized = lines(out / "tmp" / "bpe" / "test.de"), lines(out / "tmp" / "test.de")
    assert "\u2581" in encoded[0] and "@@" not in encoded[0]
    assert [sp.decode(line.split()) for line in encoded] == tokenized  # identity normalization: lossless
    assert lines(out / "tmp" / "test.en") == lines(bpe_out / "tmp" / "test.en")  # the same tokenized text

    save = tmp_path / "run"
    recipe("scripts/train.sh", "--dataset", "iwslt14", "--data", out / "bin", "--norm", "pn", "--gpus", "0",
          "--save-dir", save, "--tokens-per-update", "1000", "--", *TINY, "--max-epoch", "2", "--warmup-updates", "4",
          "--max-tokens", "1000",
          "--tensorboard-logdir", "")
    recipe("scripts/evaluate.sh", "--dataset", "iwslt14", "--data", out / "bin", "--save-dir", save,
          "--average", "1", "--cpu")
    generated = (save / "generate-test-checkpoint_last.txt").read_text(encoding="utf-8")
    hyps = [l for l in generated.splitlines() if l.startswith(("H-", "T-"))]
    assert len(hyps) == 40 and not [l for l in hyps if "\u2581" in l]
    targets = sorted((int(l.split("\t")[0][2:]), l.split("\t")[1]) for l in hyps if l.startswith("T-"))
    pairs = list(zip([t for _, t in targets], lines(out / "tmp" / "test.en"), strict=True))
    for t, r in pairs:  # references decoded exactly up to a character the tiny training text never had
        words = t.split()
        known = next((i for i, w in enumerate(words) if "<unk>" in w), len(words))
        assert known >= 5 and words[:known] == r.split()[:known] and (known < len(words) or t == r), (t, r)
    assert json.loads((save / "bleu-test.json").read_text())["sentences"] == 20

    proc = cli("fairseq-interactive", out / "bin", "--user-dir", ROOT / "powernorm_fairseq",
               "--path", save / "checkpoint_last.pt", "-s", "de", "-t", "en", "--cpu", "--beam", "2",
               "--bpe", "sentencepiece", "--sentencepiece-model", model, input=tokenized[0] + "\n", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    source = [l for l in proc.stdout.splitlines() if l.startswith("S-")]
    assert source and "\u2581" in source[0]  # the input was encoded with the model
    assert [l for l in proc.stdout.splitlines() if l.startswith("D-") and "\u2581" not in l]

    bad = recipe("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", out, "--bpe", "wordpiece", check=False)
    assert bad.returncode != 0 and bad.stderr.strip().endswith(
        "--bpe must be one of {subword-nmt,sentencepiece}, got 'wordpiece'")
    other = recipe("data-prep/prepare-iwslt14.sh", "--archive", archive, "--out", out, check=False)
    assert other.returncode != 0 and "prepared with --bpe sentencepiece; add --force" in other.stderr


def test_quickstart_preparation_with_either_subword_tool(tmp_path):
    rng = random.Random(1)
    src = tmp_path / "raw"
    src.mkdir()
    for split, n in (("train", 120), ("valid", 10), ("test", 10)):
        pairs = [sentence(rng, rng.randrange(3, 12)) for _ in range(n)]
        (src / f"{split}.de").write_text("".join(de + "\n" for de, _ in pairs))
        (src / f"{split}.en").write_text("".join(en + "\n" for _, en in pairs))
    for method, beside in (("subword-nmt", "bpe.codes"), ("sentencepiece", "spm.model")):
        out = tmp_path / method
        recipe("data-prep/prepare-quickstart.sh", "--src-dir", src, "--out", out, "--bpe", method, "--bpe-size", "40")
        assert (out / "bin" / ".done").exists() and (out / "bin" / beside).exists()
        assert len(lines(out / "tmp" / "test.en")) == 10
    # the README's fairseq-interactive line on raw, untokenized text, with the codes kept beside the data
    data, save = tmp_path / "subword-nmt" / "bin", tmp_path / "run"
    recipe("scripts/train.sh", "--dataset", "quickstart", "--data", data, "--norm", "pn", "--gpus", "0",
          "--save-dir", save, "--", *TINY, "--max-epoch", "1", "--tensorboard-logdir", "")
    proc = cli("fairseq-interactive", data, "--user-dir", ROOT / "powernorm_fairseq", "--path",
               save / "checkpoint_last.pt", "-s", "de", "-t", "en", "--tokenizer", "moses", "--bpe", "subword_nmt",
               "--bpe-codes", data / "bpe.codes", "--cpu", input="Das Haus ist groß.\n", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    source = [line for line in proc.stdout.splitlines() if line.startswith("S-")]
    assert source and source[0].split("\t")[1].endswith(" .")  # Moses split the full stop off
    assert [line for line in proc.stdout.splitlines() if line.startswith("D-") and "@@" not in line]
    bad = recipe("data-prep/prepare-quickstart.sh", "--src-dir", src, "--out", tmp_path / "x", "--bpe-merges", "0",
                check=False)
    assert bad.returncode != 0 and bad.stderr.strip().endswith("--bpe-size must be a positive integer, got '0'")


def test_train_script_options(tmp_path):
    """The refused --norm through the real registry query (lib.sh's ``python
    -c``); the other runs with the stand-ins' answer to it."""
    dry = recipe("scripts/train.sh", "--config", "configs/wmt14-pn.sh", "--gpus", "8", "--dry-run")
    cmd = dry.stdout
    assert "--arch powernorm_transformer_wmt_en_de_big" in cmd and "--norm-type pn" in cmd
    assert "--update-freq 4" in cmd  # 131,072 tokens = 8 GPUs x 4,096 x 4
    assert "--distributed-world-size 8 --norm-sync batch" in cmd  # every worker's statistics, one batch
    # every placement and QK-norm of the plugin; a worker of a run started on 16 machines keeps the batch too
    dry = recipe("scripts/train.sh", "--config", "configs/wmt14-pn.sh", "--placement", "deepnorm", "--qk-norm",
                 "rmsnorm", "--gpus", "1", "--world-size", "16", "--dry-run")
    assert "--norm-placement deepnorm --qk-norm rmsnorm" in dry.stdout and "--update-freq 2" in dry.stdout
    assert "--distributed-world-size 16 --norm-sync batch" in dry.stdout
    dry = recipe("scripts/train.sh", "--config", "configs/iwslt14-ln.sh", "--norm", "bn", "--seed", "3",
                 "--dry-run", "--gpus", "0", "--", "--max-update", "10")
    assert "--norm-type bn" in dry.stdout and "--seed 3" in dry.stdout and dry.stdout.rstrip().endswith("10")
    bad = sh("scripts/train.sh", "--norm", "layer", "--dry-run", check=False)
    assert bad.returncode == 2 and "--norm must be one of {ln,bn,pn,pn-v,bn-original,rbn,scalenorm," in bad.stderr
    assert bad.stderr.rstrip().endswith("got 'layer'")
    nodict = recipe("scripts/train.sh", "--data", tmp_path, "--gpus", "0", "--save-dir", tmp_path / "run",
                    check=False)
    assert nodict.returncode != 0 and f"no binarized data in '{tmp_path}'" in nodict.stderr
    assert not (tmp_path / "run").exists()


def flag(command, name):
    words = command.split()
    return words[words.index(name) + 1] if name in words else None


def test_every_world_size_trains_the_row_s_batch_per_update(tmp_path):
    """workers x --max-tokens x --update-freq is the row's batch per update for every number of workers
    (and with a --max-tokens cap after --, or train.sh's --update-freq); a number that cannot divide it is
    refused in one line naming both. The paper's limits are in the rows' commands."""
    stand_ins(tmp_path)
    rows = {"configs/iwslt14-pn.sh": 4096, "configs/wmt14-pn.sh": 131072, "configs/lm-ptb-pn.sh": 16384}
    for config, total in rows.items():
        script = "scripts/train-lm.sh" if "/lm-" in config else "scripts/train.sh"
        for world in (1, 3, 32):
            for extra in ([], ["--", "--max-tokens", "512"], ["--update-freq", "2"]):
                dry = sh(script, "--config", config, "--dry-run", "--gpus", "0", "--world-size", str(world),
                         *extra, check=False, path=[tmp_path])
                if total % world:
                    assert dry.returncode == 2 and dry.stderr.strip().splitlines()[-1].endswith(
                        f"{world} workers (--gpus/--world-size) cannot divide the row's {total} tokens per update; "
                        f"use a number of workers that divides {total}"), (config, world, dry.stderr)
                    continue
                assert dry.returncode == 0, dry.stderr
                got = int(flag(dry.stdout, "--max-tokens")) * int(flag(dry.stdout, "--update-freq")) * \
                    int(flag(dry.stdout, "--distributed-world-size") or 1)
                assert got == total and dry.stdout.split().count("--max-tokens") == 1, (config, world, extra)
                assert (flag(dry.stdout, "--distributed-world-size") or "1") == str(world)
                if "--max-tokens" in extra and total // world >= 512:
                    assert flag(dry.stdout, "--max-tokens") == "512"
    refused = sh("scripts/train.sh", "--config", "configs/iwslt14-pn.sh", "--dry-run", "--gpus", "0", "--",
                 "--update-freq", "4", check=False, path=[tmp_path])
    assert refused.returncode == 2 and "--update-freq after --: give it as this script's --update-freq N" in \
        refused.stderr
    refused = sh("scripts/train.sh", "--config", "configs/iwslt14-pn.sh", "--dry-run", "--gpus", "0",
                 "--update-freq", "3", check=False, path=[tmp_path])
    assert refused.returncode == 2 and "--update-freq 3 cannot divide the 4096 tokens" in refused.stderr
    iwslt = sh("scripts/train.sh", "--config", "configs/iwslt14-pn.sh", "--dry-run", "--gpus", "0",
               path=[tmp_path]).stdout
    assert (flag(iwslt, "--max-update"), flag(iwslt, "--patience"), flag(iwslt, "--keep-last-epochs"),
            flag(iwslt, "--warmup-updates"), flag(iwslt, "--lr")) == ("100000", "5", "10", "8000", "0.0015")
    wmt = sh("scripts/train.sh", "--config", "configs/wmt14-pn.sh", "--dry-run", "--gpus", "8", path=[tmp_path]).stdout
    assert (flag(wmt, "--max-update"), flag(wmt, "--patience"), flag(wmt, "--lr")) == ("300000", "10", "0.003")
    assert "--fp16" in wmt.split()
    bn = sh("scripts/train.sh", "--config", "configs/iwslt14-bn.sh", "--dry-run", "--gpus", "0",
            "--average", "5", path=[tmp_path]).stdout
    assert flag(bn, "--norm-type") == "bn-original" and flag(bn, "--keep-last-epochs") == "5"


def test_the_readme_s_training_command_is_the_recipe_s(tmp_path):
    """README's fairseq-train example: every flag and value the IWSLT14 PN row's recipe gives (but where
    the user's data, save directory and logs go)."""
    import shlex

    stand_ins(tmp_path)
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"^fairseq-train DATA .*?(?<!\\)$", readme, re.M | re.S)[0].replace("\\\n", " ")
    recipe_line = sh("scripts/train.sh", "--config", "configs/iwslt14-pn.sh", "--dry-run", "--gpus", "1",
                     path=[tmp_path]).stdout

    def flags(words):
        pairs, key = {}, None
        for word in words:
            if word.startswith("--"):
                key = word
                pairs[key] = None
            elif key:
                pairs[key], key = word, None
        return pairs

    ours, theirs = flags(shlex.split(shown)), flags(shlex.split(recipe_line))
    where = ("--user-dir", "--save-dir", "--log-format", "--log-interval", "--tensorboard-logdir")
    assert {k: v for k, v in ours.items() if k not in where} == {k: v for k, v in theirs.items() if k not in where}


def test_one_scoring_of_a_run_at_a_time(tmp_path):
    """evaluate.sh locks the run's directory: a second scoring of it (the local launcher and a SLURM job of
    the same run) is one line, and nothing of the first's is touched; the lock leaves no file."""
    import fcntl

    save = tmp_path / "run"
    save.mkdir()
    fd = os.open(save, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        busy = recipe("scripts/evaluate.sh", "--dataset", "quickstart", "--save-dir", save, check=False)
    finally:
        os.close(fd)
    assert busy.returncode == 2 and busy.stderr.strip().splitlines()[-1] == (
        f"evaluate.sh: error: another evaluate.sh is scoring '{save}' now; wait for it to end")
    assert list(save.iterdir()) == []


def test_every_config_is_a_valid_row(tmp_path):
    """Each row through its script's --dry-run. The scripts check --norm
    against the registry with one ``python -c`` (an import of torch, seconds
    per row): the stand-ins' ``python`` gives that query the registry's answer
    as this process reads it, and runs the real interpreter for anything else."""
    assert "NORM_TYPES" in norm_query()
    stand_ins(tmp_path)
    configs = sorted((ROOT / "configs").glob("*.sh"))
    assert len(configs) >= 13
    for cfg in configs:
        text = cfg.read_text()
        assert text.startswith("# "), f"{cfg.name} lacks its one-line reason"
        script = "scripts/train-lm.sh" if cfg.name.startswith("lm-") else "scripts/train.sh"
        dry = sh(script, "--config", cfg, "--dry-run", "--gpus", "1", path=[tmp_path])
        assert "fairseq-train" in dry.stdout
    bad = tmp_path / "bad.sh"  # and a row the registry refuses, through the same shim
    bad.write_text(configs[0].read_text() + "NORM=layer\n")
    refused = sh("scripts/train.sh", "--config", bad, "--dry-run", "--gpus", "1", check=False, path=[tmp_path])
    assert refused.returncode == 2 and "--norm must be one of {ln,bn,pn," in refused.stderr


def make_lm_archives(directory):
    """simple-examples.tgz (members under ./simple-examples/, as Mikolov's
    archive has them) and wikitext-103-v1.zip, each with a toy corpus."""
    from support import lm_corpus

    sizes = {"train": (300, 1), "valid": (30, 2), "test": (150, 3)}  # > 1,000 test tokens: fairseq prints "1,234"
    ptb = directory / "ptb-src" / "simple-examples" / "data"
    ptb.mkdir(parents=True)
    for split, (n, seed) in sizes.items():  # PTB's lines start and end with a space
        (ptb / f"ptb.{split}.txt").write_text("".join(f" {line} \n" for line in lm_corpus(n, seed)))
    with tarfile.open(directory / "simple-examples.tgz", "w:gz") as tar:
        tar.add(ptb.parent, arcname="./simple-examples")
    import zipfile

    with zipfile.ZipFile(directory / "wikitext-103-v1.zip", "w") as z:
        for split, (n, seed) in sizes.items():
            z.writestr(f"wikitext-103/wiki.{split}.tokens",
                       " = Title = \n" + "".join(f" {line} \n" for line in lm_corpus(n, seed + 10)))
    return directory / "simple-examples.tgz", directory / "wikitext-103-v1.zip"


def test_language_model_recipes_prepare_train_and_evaluate(tmp_path):
    ptb_archive, wiki_archive = make_lm_archives(tmp_path)
    for dataset, archive in (("ptb", ptb_archive), ("wikitext103", wiki_archive)):
        out = tmp_path / dataset
        recipe("data-prep/prepare-lm.sh", "--dataset", dataset, "--archive", archive, "--out", out)
        assert (out / "bin" / ".done").exists() and (out / "bin" / "dict.txt").exists()
        member = "ptb-src/simple-examples/data/ptb.test.txt" if dataset == "ptb" else None
        if member:
            assert (out / "tmp" / "test.txt").read_text() == (tmp_path / member).read_text()
        again = recipe("data-prep/prepare-lm.sh", "--dataset", dataset, "--archive", archive, "--out", out)
        assert "already prepared" in again.stderr
    wrong = recipe("data-prep/prepare-lm.sh", "--dataset", "wikitext103", "--archive", ptb_archive,
                  "--out", tmp_path / "wrong", check=False)
    assert wrong.returncode != 0 and "has no member wikitext-103/wiki.train.tokens" in wrong.stderr.splitlines()[-1]
    assert not (tmp_path / "wrong" / "bin").exists()
    (tmp_path / "junk.zip").write_bytes(b"not an archive")
    junk = recipe("data-prep/prepare-lm.sh", "--dataset", "ptb", "--archive", tmp_path / "junk.zip",
                 "--out", tmp_path / "junk", check=False)
    assert junk.returncode != 0 and "corrupt or unreadable archive" in junk.stderr.splitlines()[-1]
    bad = recipe("data-prep/prepare-lm.sh", "--dataset", "ptb3", check=False)
    assert "--dataset must be one of {ptb,wikitext103}, got 'ptb3'" in bad.stderr.splitlines()[-1]

    save = tmp_path / "run"
    tiny = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
            "--decoder-attention-heads", "4", "--tokens-per-sample", "32", "--max-tokens", "256",
            "--max-update", "60", "--warmup-updates", "5", "--lr", "0.005", "--dropout", "0.1"]
    recipe("scripts/train-lm.sh", "--config", "configs/lm-ptb-pn.sh", "--data", tmp_path / "ptb" / "bin",
          "--gpus", "0", "--save-dir", save, "--", *tiny)
    assert "--norm-type pn" in (save / "command.txt").read_text()
    proc = recipe("scripts/evaluate-lm.sh", "--save-dir", save, "--data", tmp_path / "ptb" / "bin", "--cpu")
    result = json.loads((save / "perplexity-test.json").read_text())
    test_tokens = sum(len(line.split()) + 1 for line in lines(tmp_path / "ptb" / "tmp" / "test.txt"))
    assert result["tokens"] == test_tokens and result["context_window"] == 24
    assert result["perplexity"] == pytest.approx(2 ** result["loss_base2"], abs=0.006)  # fairseq rounds to 0.01
    assert result["perplexity"] < len(lines(tmp_path / "ptb" / "bin" / "dict.txt")) / 2
    assert f"perplexity {result['perplexity']:.2f}" in proc.stdout
    too_long = recipe("scripts/evaluate-lm.sh", "--save-dir", save, "--data", tmp_path / "ptb" / "bin",
                     "--context-window", "32", check=False)
    assert too_long.returncode == 2 and "--context-window must be an integer in [0, 32)" in too_long.stderr


def test_language_model_train_script_options():
    """As test_train_script_options: the refusal through the real registry query."""
    dry = recipe("scripts/train-lm.sh", "--config", "configs/lm-wikitext103-ln.sh", "--gpus", "8", "--dry-run")
    cmd = dry.stdout
    assert "--arch powernorm_transformer_lm" in cmd and "--norm-type ln" in cmd and "--task language_modeling" in cmd
    assert "--update-freq 2" in cmd  # 32,768 tokens = 8 GPUs x 2,048 x 2
    bad = sh("scripts/train-lm.sh", "--norm", "power", "--dry-run", check=False)
    assert bad.returncode == 2 and bad.stderr.rstrip().endswith("got 'power'")


@pytest.mark.parametrize("script", ["train.sh", "train-lm.sh"])
@pytest.mark.parametrize("flags, message", [
    (["--placement", "mid"], "--placement must be one of {" + ",".join(PLACEMENTS) + "}, got 'mid'"),
    (["--qk-norm", "bn"], "--qk-norm must be one of {"),
    (["--seed", "-1"], "--seed must be a non-negative integer, got '-1'"),
])
def test_train_scripts_refuse_bad_run_options(script, flags, message):
    bad = recipe(f"scripts/{script}", *flags, "--dry-run", check=False)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith(f"{script}: error: {message}")


def test_sigterm_to_train_sh_ends_the_whole_tree_and_the_rerun_resumes(toy_data, tmp_path):
    """A scheduler's SIGTERM (Slurm's preemption, timeout) reaches only the
    script; fairseq-train and the log reader end with it, and a rerun resumes."""
    import signal
    import time

    save = tmp_path / "run"
    flags = ["--dataset", "iwslt14", "--data", toy_data, "--norm", "pn", "--gpus", "0", "--save-dir", save,
             "--tokens-per-update", "600"]
    fairseq_flags = [*TINY, "--warmup-updates", "4", "--max-tokens", "600", "--tensorboard-logdir", "",
                     "--save-interval-updates", "5"]
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore"}
    script = subprocess.Popen(["bash", "scripts/train.sh", *map(str, flags), "--", *fairseq_flags,
                               "--max-update", "100000"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (save / "checkpoint_1_5.pt").exists():
            assert time.time() < deadline and script.poll() is None, "the run never saved"
            time.sleep(0.2)
        assert len(processes_mentioning(str(save))) >= 2  # the script and fairseq-train
        script.send_signal(signal.SIGTERM)
        script.wait(timeout=60)
        deadline = time.time() + 60
        while processes_mentioning(str(save)) and time.time() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(save)) == []  # nothing left training under ppid 1
    finally:
        for pid in processes_mentioning(str(save)):
            os.kill(pid, signal.SIGKILL)
    rerun = recipe("scripts/train.sh", *flags, "--", *fairseq_flags, "--max-update", "12")  # signalled no more
    assert re.search(r"resumed from \S+ \(epoch \d+, (\d+) updates\)", rerun.stderr), rerun.stderr[-2000:]
