"""The ``tandem`` command: the group, its error boundary, and one module per command group.

- ``generate``: ``tandem generate`` (one prompt streamed, or a prompts file; ``--compare``)
- ``serve``: ``tandem serve verifier|drafter|router``, ``tandem demo`` (``make run``)
- ``bench``: ``tandem bench``
- ``train``: ``tandem train predictor|specformer|draft-model``, ``distill-data``, ``collect-logs``
- ``replay``: ``tandem replay``
- ``info``: ``tandem info``, ``tandem trace-report``

``common`` holds what they share (options, one-line errors, the engine builder call). Engines
are assembled by the library (``tandem.speculation.build_engine``), not here. Imports sit at the
top of each module, except those of torch-backed modules (and ray, transformers, numpy-heavy
training code), which the commands that need them import when they run: ``tandem --help``,
``tandem demo`` and ``tandem trace-report`` never load torch.
"""

from __future__ import annotations

import io
import logging
import os
import sys

import click

from ..errors import ConfigError, InvalidRequestError
from . import bench, generate, info, replay, serve, train
from .common import fail


class _Group(click.Group):
    """Turns the errors a user can cause into one-line messages (exit 2) instead of tracebacks."""

    def invoke(self, ctx):
        # these two modules import torch: loaded when a command runs, not for --help
        from ..models.config import ModelLoadError
        from ..target_items import TargetUnavailable

        try:
            return super().invoke(ctx)
        except (InvalidRequestError, ModelLoadError, ConfigError, TargetUnavailable) as exc:
            fail(str(exc))
        except BrokenPipeError:  # the reader went away (`tandem generate ... | head`): stop quietly
            _quiet_stdout()
            ctx.exit(141)  # 128 + SIGPIPE: what a shell reports for a writer its pipe's reader left
        except KeyboardInterrupt:  # Ctrl-C: no message, the shell's usual status
            ctx.exit(130)
        except OSError as exc:  # e.g. a port already in use, an unreadable file
            fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError (CUDA) or the CPU allocator
            text = str(exc)
            if not isinstance(exc, MemoryError) and "out of memory" not in text and "allocate memory" not in text:
                raise
            first = next((line for line in text.splitlines() if line.strip()), type(exc).__name__)
            fail(f"out of memory: {first.strip()[:300]} (lower the batch size or the work of one call)")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of a broken pipe says nothing
    (the recipe of Python's ``signal`` documentation)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


@click.group(cls=_Group)
@click.option("-v", "--verbose", is_flag=True, help="Log engine events.")
def main(verbose: bool) -> None:
    """Tandem: lossless speculative decoding for LLM serving."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


for command in (generate.generate, info.info, bench.bench, replay.replay_cmd, train.collect_logs,
                info.trace_report_cmd, train.train, train.distill_data, serve.serve, serve.demo):
    main.add_command(command)
