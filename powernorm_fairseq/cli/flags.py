"""``powernorm-flags``: every norm flag of the plugin's models, with its
default and allowed values, from the one place they are defined
(``models.options.NormConfig``). fairseq's ``--help`` does not list a model's
flags, so this is where to find them."""

import argparse

from ..common.flags import ArgumentParser


def rows():
    """(flag, default, values, role, help) of every norm flag; role: function
    (it must match wherever a model is rebuilt from a checkpoint) or training."""
    from ..models.options import norm_fields

    lm = {f.name for f in norm_fields(lm=True)}
    for f in norm_fields():
        options = f.metadata["argparse"]
        flag = "--" + f.name.replace("_", "-")
        action = options.get("action")
        if action is argparse.BooleanOptionalAction:
            flag += " / --no-" + f.name.replace("_", "-")
        values = ",".join(options["choices"]) if "choices" in options else options.get("metavar", "")
        if action == "store_true":
            values, default = "", "off"
        else:
            default = "see meaning" if f.default is None else str(f.default)
        role = f.metadata["role"] + ("" if f.name in lm else ", translation")
        yield flag, default, values, role, " ".join(f.metadata["help"].split())


def markdown() -> str:
    """The flags as a Markdown table (docs/norms.md holds it, generated)."""
    from ..norms import NORM_TYPES

    kinds = ",".join(NORM_TYPES)
    out = ["| flag | default | values | role | meaning |", "|---|---|---|---|---|"]
    for row in rows():
        cells = [f"`{c}`" if i < 3 and c else c for i, c in enumerate(row)]
        if row[2] in (kinds, "{" + kinds + "}"):  # the kinds table lists them once
            cells[2] = "any kind"
        if row[1] == "see meaning":  # the meaning says what the default is
            cells[1] = "—"
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    parser = ArgumentParser(prog="powernorm-flags", description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=("table", "markdown"), default="table")
    args = parser.parse_args(argv)
    if args.format == "markdown":
        print(markdown())
        return
    table = list(rows())
    width = max(len(r[0]) for r in table)
    for flag, default, values, role, text in table:
        print(f"{flag:<{width}}  default {default}; {values + '; ' if values else ''}{role}\n"
              f"{'':<{width}}  {text}")


if __name__ == "__main__":
    main()
