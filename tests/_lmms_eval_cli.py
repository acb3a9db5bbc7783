"""`python -m lmms_eval ARGS` as a `main(argv)`, for a process forked from tools/ranks.py's server
(tests/theworld/test_lmms_adapter.py): what a fresh interpreter does first that a fork has not (PYTHONPATH's folders
on sys.path, where lmms-eval looks up the adapter's entry point), then lmms-eval's own command-line entry.

LMMS_TASK_INDEX=FILE: the index lmms-eval's TaskManager builds of its ~2,000 bundled task files (~7.5 s of CPU per
command, the same for every run of one installed lmms-eval) is built by lmms-eval's own code in the first process
and read from FILE by the later ones; the index of the --include_path tasks is built every time."""

from __future__ import annotations

import json
import os
import sys


def _share_bundled_task_index(path: str) -> None:
    from lmms_eval import tasks

    from theworld.core.atomic import write_text

    bundled = os.path.dirname(os.path.abspath(tasks.__file__)) + "/"  # as TaskManager.initialize_tasks names it
    build = tasks.TaskManager._get_task_and_group

    def index(self, task_dir: str) -> dict:
        if task_dir != bundled:
            return build(self, task_dir)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        found = build(self, task_dir)
        write_text(path, json.dumps(found))
        return found

    tasks.TaskManager._get_task_and_group = index


def main(argv: list[str]) -> int:
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    from lmms_eval import __main__ as entry
    from lmms_eval.cli.dispatch import main as dispatch

    if os.environ.get("LMMS_TASK_INDEX"):
        _share_bundled_task_index(os.environ["LMMS_TASK_INDEX"])
    sys.argv = [entry.__file__, *argv]
    dispatch()
    return 0  # as lmms_eval/__main__.py ends
