"""A fairseq command's output, kept whole in a log file and summed up on the console.

fairseq logs its configuration, the model and every ``--log-interval``
updates. Read from its output (``--log-format simple`` or ``json``), this
writes every line to ``--log`` and prints one line per epoch (training loss,
validation loss, words per second, time so far), this plugin's own messages
(the norm backend, a recovered checkpoint), where a resumed run starts,
and fairseq's errors::

    fairseq-train ... 2>&1 | python -m powernorm_fairseq.cli.progress --log RUN/train.log

A run that is refused before it trains (a busy --save-dir, a bad flag, a
checkpoint of other norms) writes nothing: the lines are held until training
starts (fairseq's "Start iterating over samples"), and a stream that ends
before it with an error line is dropped, its error line printed, and the
exit status is REFUSED. ``--command-file`` is written, with ``--command``, only
once the run is accepted, as the log is.

It imports neither torch nor fairseq, so it starts at once.
"""

import argparse
import datetime
import json
import os
import re
import signal
import sys

#: a fairseq log record: "DATE TIME | LEVEL | LOGGER | MESSAGE"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| (?P<level>[A-Z]+) \| (?P<logger>[\w.]+) \| (?P<message>.*)$")
DONE = re.compile(r"done training in ([\d.]+) seconds")
RESUMED = re.compile(r"Loaded checkpoint (\S+) \(epoch (\d+) @ (\d+) updates\)")
STARTED = "Start iterating over samples"  # fairseq-train's first epoch begins: the run was accepted
ERROR = re.compile(r"^[\w.-]+: error: ")  # a command's one-line refusal
REFUSED = 3  # the exit status of a run refused before it trained


def epoch_stats(tag: str, body: str):
    """{stat: value} of fairseq's end-of-epoch record (its logger is the
    ``tag`` train or valid), or None.

    simple: ``epoch 002 | loss 10.47 | ... | wall 23``;
    json: ``{"epoch": 2, "train_loss": "10.47", ...}``.
    """
    if tag not in ("train", "valid"):
        return None
    if body.startswith("{"):
        try:
            row = json.loads(body)
        except ValueError:
            return None
        stats = {key.removeprefix(f"{tag}_"): value for key, value in row.items()}
    else:
        stats = dict(item.split(" ", 1) for item in body.split(" | ") if re.fullmatch(r"\w+ \S+", item))
    return stats if "epoch" in stats else None


def clock(seconds) -> str:
    return str(datetime.timedelta(seconds=round(float(seconds))))


class Summary:
    """Turns fairseq's records into the console lines (``lines`` returns them)."""

    def __init__(self):
        self.valid = {}  # the epoch's last validation, logged before its training line

    def lines(self, line: str):
        record = RECORD.match(line)
        if record is None:
            return []
        level, source, message = record["level"], record["logger"], record["message"]
        if source.split(".")[0] == "powernorm_fairseq" or level in ("ERROR", "CRITICAL"):
            return [message]
        done, resumed = DONE.search(message), RESUMED.search(message)
        if done:
            return [f"done training in {clock(done[1])}"]
        if resumed:
            return [f"resumed from {resumed[1]} (epoch {resumed[2]}, {int(resumed[3]):,} updates)"]
        values = epoch_stats(source, message)
        if values is None:
            return []
        if source == "valid":  # an epoch validated every N updates: its last validation, at the epoch's end
            self.valid[int(values["epoch"])] = values
            return []
        epoch = int(values["epoch"])
        parts = [f"epoch {epoch:3d}", f"train loss {float(values['loss']):.3f}"]
        valid = self.valid.pop(epoch, None)
        if valid is not None and "loss" in valid:
            parts.append(f"valid loss {float(valid['loss']):.3f}")
        if "wps" in values:
            parts.append(f"{float(values['wps']):,.0f} words/s")
        if "num_updates" in values:
            parts.append(f"{int(float(values['num_updates'])):,} updates")
        if "wall" in values:
            parts.append(clock(values["wall"]))
        return [" | ".join(parts)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--log", required=True, help="the file every line is appended to")
    parser.add_argument("--prefix", default="", help="put before each console line")
    parser.add_argument("--command-file", help="written with --command once the run is accepted")
    parser.add_argument("--command", default="", help="the command line, for --command-file")
    parser.add_argument("--header", help="the log's first line once the run is accepted (the run's batch)")
    parser.add_argument("--remove-if-empty", metavar="DIR",
                        help="a directory made for the run: removed when a refused run leaves it empty")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole pipeline: fairseq saves and prints why it
    # stopped, and this reads on until it ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    summary, held, log = Summary(), [], None

    def accept():
        nonlocal log
        if args.command_file:
            with open(args.command_file, "w") as f:
                f.write(args.command + "\n")
        log = open(args.log, "a", buffering=1)
        if args.header:
            log.write(args.header + "\n")
        log.writelines(held)

    for line in sys.stdin:
        if log is None:
            held.append(line)
            if STARTED in line:
                accept()
        else:
            log.write(line)
        for shown in summary.lines(line.rstrip("\n")):
            print(f"{args.prefix}{shown}", file=sys.stderr, flush=True)
    if log is None:
        refusal = next((h.strip() for h in reversed(held) if ERROR.match(h.strip())), None)
        if refusal is not None:  # refused before training: nothing written
            print(refusal, file=sys.stderr)
            if args.remove_if_empty:
                try:
                    os.rmdir(args.remove_if_empty)
                except OSError:
                    pass
            sys.exit(REFUSED)
        accept()  # ended before training for another reason (a crash): kept, as it is evidence
    log.close()


if __name__ == "__main__":
    main()
