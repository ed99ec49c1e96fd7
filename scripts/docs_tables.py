"""The tables of docs/ that code defines, generated from it.

    python scripts/docs_tables.py          # rewrite every generated table in place
    python scripts/docs_tables.py --check  # exit 1 naming each stale one (tests/test_docs.py)

A generated table stands between ``<!-- generated: NAME -->`` and
``<!-- end generated -->``; NAME is one of ``TABLES``:

* ``flags``: every norm flag (``powernorm-flags``, from ``models/options.py``);
* ``kinds``: every norm kind, its class, options and running statistics (the registry ``NORMS``);
* ``targets``: the launch and CPU-speed targets that ``bench/`` measures against
  (``bench/common.py``, ``bench/launches.py``).
"""

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BLOCK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def flags() -> str:
    from powernorm_fairseq.cli.flags import markdown

    return markdown()


def kinds() -> str:
    from powernorm_fairseq.norms import NORMS, TORCH_OPTIONS

    out = ["| kind | class | options | running statistics | what it computes |", "|---|---|---|---|---|"]
    for kind, cls in NORMS.items():
        options = [n for n in inspect.signature(cls).parameters if n not in ("dim", *TORCH_OPTIONS)]
        if not cls.__doc__:
            raise SystemExit(f"docs_tables: {cls.__name__} has no docstring to describe {kind!r} with")
        first = re.split(r"(?<=\.)\s(?=[A-Z])", " ".join(inspect.cleandoc(cls.__doc__).split("\n\n")[0].split()))[0]
        summary = first.replace("``", "`")
        out.append(f"| `{kind}` | `{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}` | "
                   f"{', '.join(f'`{o}`' for o in options) or '-'} | {'yes' if cls.running_stats else 'no'} | "
                   f"{summary} |")
    return "\n".join(out)


def _bench(name):
    """A section of bench/ (its files import each other by name)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def targets() -> str:
    common, section = _bench("common"), _bench("launches")
    out = ["| norm | launches per training step of a layer (GPU) | CPU time / `F.layer_norm`, float32 | bfloat16 |",
           "|---|---|---|---|"]
    layers = common.TARGETS["layers"]
    for label, launches in section.LAUNCH_TARGETS.items():
        kind = label.split()[0]
        f32, bf16 = (f"<= {layers[d][kind]}" if kind in layers[d] else "-" for d in ("float32", "bfloat16"))
        out.append(f"| {label} | <= {launches} | {f32} | {bf16} |")
    return "\n".join(out)


TABLES = {"flags": flags, "kinds": kinds, "targets": targets}


def refresh(text: str, made: dict) -> str:
    """``text`` with each generated table replaced by what code gives now."""
    def fill(match):
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"docs_tables: unknown table {name!r}; one of {', '.join(TABLES)}")
        if name not in made:
            made[name] = TABLES[name]()
        return match.group(1) + made[name] + "\n" + match.group(4)
    return BLOCK.sub(fill, text)


def stale() -> list:
    """The docs whose generated tables differ from what code gives now."""
    made = {}
    return [str(page.relative_to(ROOT)) for page in sorted((ROOT / "docs").glob("*.md"))
            if refresh(page.read_text(), made) != page.read_text()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each stale page")
    args = parser.parse_args(argv)
    if args.check:
        pages = stale()
        if pages:
            print(f"docs_tables: stale generated tables in {', '.join(pages)}: run python scripts/docs_tables.py",
                  file=sys.stderr)
        return 1 if pages else 0
    made = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        new = refresh(text, made)
        if new != text:
            page.write_text(new)
            print(f"docs_tables: {page.relative_to(ROOT)} refreshed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
