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
import locale
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

#: a fairseq log record: "DATE TIME | LEVEL | LOGGER | MESSAGE"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| (?P<level>[A-Z]+) \| (?P<logger>[\w.]+) \| (?P<message>.*)$")
DONE = re.compile(r"done training in ([\d.]+) seconds")
RESUMED = re.compile(r"Loaded checkpoint (\S+) \(epoch (\d+) @ (\d+) updates\)")
STARTED = "Start iterating over samples"  # fairseq-train's first epoch begins: the run was accepted
ERROR = re.compile(r"^[\w.-]+: error: ")  # a command's one-line refusal
LIMITS = re.compile(r"'max_(epoch|update)': (\d+)")  # fairseq's configuration, logged as it starts
#: fairseq's record every --log-interval updates: "epoch 002:     18 / 62 loss=9.678, ..., num_updates=80, ..."
INNER = re.compile(r"^epoch (\d+):\s+(\d+) / (\d+) (.*)$")
REFUSED = 3  # the exit status of a run refused before it trained
#: how a log's bytes are read: as open() reads text here, lines ended as universal newlines end them
ENCODING = locale.getpreferredencoding(False)
NEWLINE = re.compile(r"\r\n|\r|\n")


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
    """Turns fairseq's records into the console lines (``lines`` returns them); ``heartbeat`` says
    where a run is between them."""

    def __init__(self):
        self.valid = {}  # the epoch's last validation, logged before its training line
        self.limits = {}  # fairseq's --max-epoch and --max-update (0: none)
        self.last = None  # (epoch, update, its wall time, words/s) of the newest record
        self.inner = None  # (how far into its epoch, as text and as a fraction) of the newest interval record

    def lines(self, line: str):
        record = RECORD.match(line)
        if record is None:
            return []
        level, source, message = record["level"], record["logger"], record["message"]
        if not self.limits:
            self.limits = {key: int(value) for key, value in LIMITS.findall(message)}
        if source.split(".")[0] == "powernorm_fairseq" or level in ("ERROR", "CRITICAL"):
            return [message]
        done, resumed = DONE.search(message), RESUMED.search(message)
        if done:
            return [f"done training in {clock(done[1])}"]
        if resumed:
            return [f"resumed from {resumed[1]} (epoch {resumed[2]}, {int(resumed[3]):,} updates)"]
        if source == "train_inner":
            self.interval(message)
            return []
        values = epoch_stats(source, message)
        if values is None:
            return []
        if source == "valid":  # an epoch validated every N updates: its last validation, at the epoch's end
            self.valid[int(values["epoch"])] = values
            return []
        epoch = int(values["epoch"])
        self.remember(epoch, values)
        self.inner = None
        parts = [self.epoch(epoch), f"train loss {float(values['loss']):.3f}"]
        valid = self.valid.pop(epoch, None)
        if valid is not None and "loss" in valid:
            parts.append(f"valid loss {float(valid['loss']):.3f}")
        if "wps" in values:
            parts.append(f"{float(values['wps']):,.0f} words/s")
        if "num_updates" in values:
            parts.append(f"{self.updates(int(float(values['num_updates'])))} updates")
        if "wall" in values:
            parts.append(clock(values["wall"]))
        return [" | ".join(parts + self.eta(epoch_done=True))]

    def interval(self, message):
        """fairseq's record every --log-interval updates, simple or json: where the epoch is."""
        if message.startswith("{"):
            try:
                stats = json.loads(message)
                epoch = int(stats["epoch"])
                into = float(stats["update"]) - epoch + 1  # json's update: the epoch, with its fraction
                self.inner = (f"{into:.0%}", into)
            except (ValueError, KeyError, TypeError):
                return
        else:
            inner = INNER.match(message)
            if inner is None:
                return
            stats = dict(item.split("=", 1) for item in inner[4].split(", ") if "=" in item)
            epoch = int(inner[1])
            self.inner = (f"{inner[2]}/{inner[3]}", int(inner[2]) / int(inner[3]))
        self.remember(epoch, stats)

    def remember(self, epoch, stats):
        if "num_updates" in stats and "wall" in stats:
            self.last = (epoch, int(float(stats["num_updates"])), float(stats["wall"]),
                         float(stats["wps"]) if "wps" in stats else None)

    def epoch(self, epoch):
        return f"epoch {epoch}/{self.limits['epoch']}" if self.limits.get("epoch") else f"epoch {epoch:3d}"

    def updates(self, n):
        return f"{n:,}/{self.limits['update']:,}" if self.limits.get("update") else f"{n:,}"

    def eta(self, epoch_done=False):
        """["ETA h:mm:ss"] from the pace so far toward the nearer limit, or [] without one."""
        if self.last is None:
            return []
        epoch, updates, wall, _ = self.last
        left = []
        if self.limits.get("update") and updates:
            left.append(wall / updates * max(self.limits["update"] - updates, 0))
        if self.limits.get("epoch"):
            done = epoch if epoch_done else epoch - 1 + (self.inner[1] if self.inner else 0)
            if done > 0:
                left.append(wall / done * max(self.limits["epoch"] - done, 0))
        return [f"ETA {clock(min(left))}"] if left and min(left) > 0 else []

    def heartbeat(self, quiet_for):
        """A line saying where the run is: its newest record, how long ago, and the ETA."""
        if self.last is None:
            return f"training, no update logged yet ({clock(quiet_for)})"
        epoch, updates, wall, wps = self.last
        where = f"{self.epoch(epoch)}, update {self.updates(updates)}" + (
            f" ({self.inner[0]} of the epoch)" if self.inner else "")
        parts = [where] + ([f"{wps:,.0f} words/s"] if wps else []) + [clock(wall)] + self.eta()
        return " | ".join(parts) + f" (still training; the last record {clock(quiet_for)} ago)"


#: the most seconds without a line while a run trains (``POWERNORM_HEARTBEAT``; 55: a line a minute at least)
HEARTBEAT = float(os.environ.get("POWERNORM_HEARTBEAT") or 55)


def where(path, read=None):
    """The heartbeat line of a run's log, from its newest records; None before its first. ``read``: a dict
    the caller keeps between calls, in which the reading of each log goes on from where the last call
    stopped (a training's log only grows: a long run's was read whole every heartbeat); a log replaced, or
    cut shorter, is read again from its start, and a line still being written is read once it is whole."""
    if not Path(path).is_file():  # a log that is not a regular file: no heartbeat of it
        return None
    try:
        stat = os.stat(path)
        known = None if read is None else read.get(str(path))
        if known is None or known[0] != (stat.st_dev, stat.st_ino) or stat.st_size < known[1]:
            known = [(stat.st_dev, stat.st_ino), 0, Summary()]  # the file, the bytes read, their summary
        with open(path, "rb") as f:
            f.seek(known[1])
            whole = f.read(stat.st_size - known[1]).rpartition(b"\n")[0]
        if whole:
            known[1] += len(whole) + 1
            for line in NEWLINE.split(whole.decode(ENCODING, errors="replace")):
                known[2].lines(line)
        if read is not None:
            read[str(path)] = known
        age = time.time() - stat.st_mtime
    except OSError:
        return None
    summary = known[2]
    return summary.heartbeat(age) if summary.last else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--log", required=True, help="the file every line is appended to")
    parser.add_argument("--prefix", default="", help="put before each console line")
    parser.add_argument("--command-file", help="written with --command once the run is accepted")
    parser.add_argument("--command", default="", help="the command line, for --command-file")
    parser.add_argument("--header", help="the log's first line once the run is accepted (the run's batch)")
    parser.add_argument("--remove-if-empty", metavar="DIR",
                        help="a directory made for the run: removed when a refused run leaves it empty")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT, metavar="S",
                        help=f"while it trains, a line at least every S seconds (default: {HEARTBEAT:g}, "
                        "POWERNORM_HEARTBEAT)")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole pipeline: fairseq saves and prints why it
    # stopped, and this reads on until it ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    summary, held, log = Summary(), [], None
    said = threading.Lock()  # the console and the log, from the reader and the heartbeat alike
    shown_at, seen_at, ended = [time.monotonic()], [time.monotonic()], threading.Event()

    def show(text):
        with said:
            print(f"{args.prefix}{text}", file=sys.stderr, flush=True)
            if log is not None:  # the console's lines in the run's log too (a SLURM job's log shows them)
                stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
                log.write(f"{stamp} | INFO | powernorm_fairseq.progress | {text}\n")
            shown_at[0] = time.monotonic()

    def beat():
        while not ended.wait(min(1.0, args.heartbeat / 4)):
            now = time.monotonic()
            if log is not None and now - shown_at[0] >= args.heartbeat:
                show(summary.heartbeat(now - seen_at[0]))

    def accept():
        nonlocal log
        if args.command_file:
            with open(args.command_file, "w") as f:
                f.write(args.command + "\n")
        log = open(args.log, "a", buffering=1)
        if args.header:
            log.write(args.header + "\n")
        log.writelines(held)

    threading.Thread(target=beat, daemon=True).start()
    for line in sys.stdin:
        with said:
            if log is None:
                held.append(line)
                if STARTED in line:
                    accept()
            else:
                log.write(line)
        shown = summary.lines(line.rstrip("\n"))
        if RECORD.match(line):
            seen_at[0] = time.monotonic()
        for text in shown:
            show(text)
    ended.set()
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
