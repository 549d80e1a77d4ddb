#!/usr/bin/env python3
"""Reads TensorBoard event files with TensorBoard's own readers and prints what they hold as one JSON
object on stdout (anything else, TensorBoard's messages included, goes to stderr):

  {"scalars": {tag: [[step, value], ...]},   # EventAccumulator, as TensorBoard shows them
   "files": [{"name", "file_version", "events", "last_step"}],   # each file on its own, event by event
   "warnings": [...]}                        # what TensorBoard's readers complained about (CRC, truncation)

Usage: read_tensorboard.py DIR (a directory of events files, merged as TensorBoard merges them)."""

import contextlib
import json
import logging
import os
import sys


class Complaints(logging.Handler):
    """Keeps the warnings and errors TensorBoard's loggers emit (a failed CRC is only logged there)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def read_files(directory, event_file_loader):
    """Each events file on its own, in name order: its first event's file_version, its event count and
    the last step of its summaries (None when it holds none)."""
    files = []
    for name in sorted(n for n in os.listdir(directory) if "tfevents" in n):
        events = list(event_file_loader.EventFileLoader(os.path.join(directory, name)).Load())
        files.append({
            "name": name,
            "file_version": events[0].file_version if events else "",
            "events": len(events),
            "last_step": max((e.step for e in events if e.HasField("summary")), default=None),
        })
    return files


def main():
    directory = sys.argv[1]
    complaints = Complaints()
    logging.getLogger("tensorboard").addHandler(complaints)
    with contextlib.redirect_stdout(sys.stderr):
        from tensorboard.backend.event_processing import event_accumulator, event_file_loader

        acc = event_accumulator.EventAccumulator(directory, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        scalars = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        files = read_files(directory, event_file_loader)
    json.dump({"scalars": scalars, "files": files, "warnings": complaints.messages}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
