"""Per-file times of two runs of the test suite, side by side, from pytest's
JUnit XML (``bash scripts/test.sh --junitxml=FILE``).

    python bench/suite_times.py BEFORE.xml AFTER.xml [--labels before,after]

A file's time is the sum of its tests' times (setup, call and teardown, as
pytest reports them); with several workers these add up to more than the
wall-clock time of the run, which the runs' own logs give.
"""

import argparse
import collections
import xml.etree.ElementTree as ET


def per_file(path):
    """{test file: [seconds, tests, failures]} of one JUnit XML report."""
    files = collections.defaultdict(lambda: [0.0, 0, 0])
    for case in ET.parse(path).iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"  # tests.test_cli -> test_cli.py
        row = files[name]
        row[0] += float(case.get("time", 0))
        row[1] += 1
        row[2] += any(child.tag in ("failure", "error") for child in case)
    return files


def table(before, after, labels):
    a, b = per_file(before), per_file(after)
    lines = [f"| file | {labels[0]} (s) | {labels[1]} (s) | ratio | tests ({labels[0]} / {labels[1]}) |",
             "|---|---|---|---|---|"]
    for name in sorted(set(a) | set(b), key=lambda n: -a.get(n, [0])[0]):
        ta, tb = a.get(name, [0.0, 0, 0]), b.get(name, [0.0, 0, 0])
        ratio = f"{tb[0] / ta[0]:.2f}" if ta[0] and tb[0] else "–"
        lines.append(f"| {name} | {ta[0]:.0f} | {tb[0]:.0f} | {ratio} | {ta[1]} / {tb[1]} |")
    total_a, total_b = sum(r[0] for r in a.values()), sum(r[0] for r in b.values())
    lines.append(f"| **all** | {total_a:.0f} | {total_b:.0f} | {total_b / total_a:.2f} | "
                 f"{sum(r[1] for r in a.values())} / {sum(r[1] for r in b.values())} |")
    failed = {n: r[2] for n, r in b.items() if r[2]}
    if failed:
        lines.append(f"\nfailed in {labels[1]}: {failed}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--labels", default="before,after", help="the two columns' names, comma-separated")
    args = p.parse_args(argv)
    print(table(args.before, args.after, args.labels.split(",")))


if __name__ == "__main__":
    main()
