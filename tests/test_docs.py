"""README.md and docs/ as written: every relative link resolves, and every
quoted ``bash …`` and ``fairseq-…`` command names a script and flags that
exist (checked with the script's ``--help`` or fairseq's own parser, never run)."""

import re
import shlex
import subprocess

import pytest

from support import ROOT

pytestmark = pytest.mark.fast

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`((?:bash|fairseq-(?:train|generate|interactive|eval-lm|preprocess|validate))\b[^`]*)`")


def prose(text):
    return FENCE.sub("", text)


def slug(heading):
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    return {slug(line.lstrip("#")) for line in prose(path.read_text()).splitlines() if line.startswith("#")}


def commands():
    """(document, command) for every quoted command line: those in code
    blocks (continuation lines joined, comments dropped, pipes split) and
    inline ones."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip()
                for part in re.split(r"\s*(?:\||&&|;)\s*", line):
                    if part.startswith(("bash ", "fairseq-")):
                        found.append((doc.name, part))
        found += [(doc.name, c) for c in INLINE.findall(prose(text))]
    return found


def test_the_readme_fits_a_first_read():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_docs_and_the_benchmark_guide_stay_within_60k_characters():
    pages = [*(ROOT / "docs").glob("*.md"), ROOT / "bench" / "README.md"]
    sizes = {p.name: len(p.read_text()) for p in pages}
    assert sum(sizes.values()) <= 60_000, sorted(sizes.items(), key=lambda kv: -kv[1])


def broken_links(docs):
    broken = []
    for doc in docs:
        for target in LINK.findall(prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    assert not broken_links(DOCS), broken_links(DOCS)


def test_the_checker_finds_the_commands_and_sees_broken_links(tmp_path):
    quoted = [c for _, c in commands()]
    assert any(c.startswith("fairseq-train ") for c in quoted) and "bash scripts/test.sh" in quoted
    page = tmp_path / "page.md"
    page.write_text("# The Title, here\n[a](page.md#the-title-here) [b](missing.md) [c](#other)\n"
                    "```\n[d](not-a-link.md)\n```\n")
    assert broken_links([page]) == ["page.md: missing.md (no such file)", "page.md: #other (no such heading)"]


FAIRSEQ_PARSERS = {
    "fairseq-train": "get_training_parser", "fairseq-generate": "get_generation_parser",
    "fairseq-interactive": "get_interactive_generation_parser", "fairseq-eval-lm": "get_eval_lm_parser",
    "fairseq-preprocess": "get_preprocessing_parser", "fairseq-validate": "get_validation_parser",
}


#: a command line each tool parses, for the flags of a tool named in prose with only some of them
CANONICAL = {
    "fairseq-train": ["DATA", "--user-dir", "powernorm_fairseq", "--arch", "powernorm_transformer_iwslt_de_en"],
    "fairseq-generate": ["DATA", "--user-dir", "powernorm_fairseq", "--path", "CKPT"],
    "fairseq-interactive": ["DATA", "--user-dir", "powernorm_fairseq", "--path", "CKPT"],
    "fairseq-eval-lm": ["DATA", "--user-dir", "powernorm_fairseq", "--path", "CKPT", "--task", "language_modeling"],
    "fairseq-validate": ["DATA", "--user-dir", "powernorm_fairseq", "--path", "CKPT"],
    "fairseq-preprocess": [],
}


def parse(tool, argv):
    """fairseq's own parser of ``tool`` (with the flags of the architecture and
    task that argv names) on argv: (the parser, the arguments it does not know)."""
    from fairseq import options

    import powernorm_fairseq.models  # noqa: F401  (registers: the package was imported before fairseq here)

    parser = getattr(options, FAIRSEQ_PARSERS[tool])()
    if tool == "fairseq-preprocess":
        return parser, parser.parse_known_args(argv)[1]
    return parser, options.parse_args_and_arch(parser, argv, parse_known=True)[1]


@pytest.mark.parametrize("doc, command", [c for c in commands() if c[1].startswith("fairseq-")],
                         ids=lambda v: v if v.endswith(".md") else v[:60])
def test_fairseq_commands_parse(doc, command, monkeypatch):
    """fairseq's own parser, with the architecture's and task's flags, knows
    every flag; a tool named in prose must exist, with the flags it is given."""
    tool, *argv = shlex.split(command)
    assert tool in FAIRSEQ_PARSERS, f"{doc}: unknown command {tool}"
    monkeypatch.chdir(ROOT)  # --user-dir powernorm_fairseq, as the docs say, from the repository root
    if argv and not argv[0].startswith("-"):  # a whole command line
        _, unknown = parse(tool, argv)
        assert not unknown, f"{doc}: {tool} does not know {unknown}"
    else:
        parser, _ = parse(tool, CANONICAL[tool])
        unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in parser._option_string_actions]
        assert not unknown, f"{doc}: {tool} has no {unknown}"


_HELP = {}


@pytest.mark.slow
def test_bash_commands_name_scripts_and_flags_that_exist():
    """Each script exists and its --help names each flag the docs give it
    (those before a bare ``--``, after which fairseq's flags follow)."""
    wrong = []
    for doc, command in commands():
        if not command.startswith("bash "):
            continue
        script, *args = shlex.split(command)[1:]
        if not (ROOT / script).is_file():
            wrong.append(f"{doc}: {command}: no such script")
            continue
        if script not in _HELP:
            proc = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
            _HELP[script] = proc.stdout + proc.stderr if proc.returncode == 0 else None
        help_text = _HELP[script]
        if help_text is None:
            wrong.append(f"{doc}: {script} --help fails")
            continue
        flags = [a.split("=")[0] for a in (args[:args.index("--")] if "--" in args else args) if a.startswith("--")]
        wrong += [f"{doc}: {command}: {script} has no {f}" for f in flags
                  if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
        wrong += [f"{doc}: {command}: no such file {a}" for a in args
                  if re.match(r"(configs|data-prep|scripts)/\S+\.sh$", a) and not (ROOT / a).is_file()]
    assert not wrong, wrong


def _docs_tables():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tables_code_defines_are_generated_and_current():
    """The flag, kind and target tables of docs/ are what scripts/docs_tables.py
    makes from the code now; a stale one, or an unknown name, is caught."""
    tables = _docs_tables()
    assert tables.stale() == []
    text = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    assert {m.group(2) for m in tables.BLOCK.finditer(text)} == set(tables.TABLES)
    made = {}
    old = "<!-- generated: targets -->\n| norm | launches |\n<!-- end generated -->"
    assert tables.refresh(old, made) != old and "| pn (Algorithm 2) | <= 4 |" in tables.refresh(old, made)
    with pytest.raises(SystemExit, match="unknown table 'nope'"):
        tables.refresh("<!-- generated: nope -->\n<!-- end generated -->", made)
