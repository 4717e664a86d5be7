"""The text of ``accel-ctx launch --help``: the options come from the settings table.

Examples:
    >>> from accel_ctx._launch.help import launch_help
    >>> print(launch_help())  # doctest: +ELLIPSIS
    usage: accel-ctx launch [-n N|auto] [--nnodes N] ...
    <BLANKLINE>
    Runs script.py on every process through torchrun ...
      -n, --nproc N           processes PER NODE ...
"""

from __future__ import annotations

import textwrap

from .config import precedence
from .settings import CONFIG_FLAG, SETTINGS

_CONFIG_METAVAR = "FILE"
_WIDTH = 93  # the help reads in an 80-100 column terminal; the prose below is wrapped alike

_INTRO = """\
Runs script.py on every process through torchrun (torch.distributed.run); distributed() in the
script finds the job from the variables torchrun sets.
"""

_OUTRO = """\
Any other option before the script is torchrun's and passes through unchanged (--rdzv-conf,
--log-dir, --redirects, --monitor-interval, ...; see `torchrun --help`). torchrun's own
rendezvous flags (--rdzv-endpoint, --standalone, --master-addr, ...) replace --master.
Everything after the script's name is the script's own, even an option torchrun also has
(`accel-ctx launch -n 2 train.py --log x` hands --log x to train.py).

The script is checked before anything starts: a file (or a folder with __main__.py); with
-m, a module found from here; with --no-python, a command. The exit code is the script's own
(that of the rank that caused the failure, which the last line names; 128 + N for a rank
killed by signal N); Ctrl-C stops every worker and exits with 130.
"""
_FILES = ("Write the files with `accel-ctx config`; `accel-ctx config --show` prints what is "
          "in force.")


def launch_help() -> str:
    """The whole help text: usage, what it does, one paragraph per option, then the rules."""
    prefix = "usage: accel-ctx launch "
    words = [f"[{s.flags[0]}\xa0{s.choices or s.metavar}]" for s in SETTINGS]
    words += [f"[{CONFIG_FLAG}\xa0{_CONFIG_METAVAR}]", "[torchrun\xa0flags]", "script.py",
              "[script\xa0args...]"]
    usage = _fill(" ".join(words), prefix, " " * len(prefix))
    options = [(f"  {', '.join(s.flags)} {s.metavar}", s.help) for s in SETTINGS]
    options.append((f"  {CONFIG_FLAG} {_CONFIG_METAVAR}",
                    "read the defaults from FILE instead of the project and user files."))
    column = max(len(head) for head, _ in options) + 2
    paragraphs = [_fill(text, head.ljust(column), " " * column) for head, text in options]
    rule = _fill(f"{precedence()} {_FILES}", "", "")
    return f"{usage}\n\n{_INTRO}\n" + "\n".join(paragraphs) + f"\n\n{_OUTRO}\n{rule}\n"


def _fill(text: str, first: str, indent: str) -> str:
    # A no-break space (\xa0) binds a flag to its value: textwrap splits at ASCII spaces only.
    return textwrap.fill(text, _WIDTH, initial_indent=first, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False).replace("\xa0", " ")
