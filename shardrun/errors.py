"""The project's errors. The CLI catches `ShardrunError` and prints `error: <message>`.

    ShardrunError            root; never escapes the CLI as a traceback
    ├── SpecError            the job file, a flag or an environment variable is wrong (exit 2)
    ├── InputError           the input file is missing or unreadable (exit 2)
    ├── RunDirError          a run directory is missing, or its manifest damaged (exit 2)
    ├── EndpointError        the endpoint cannot be used at all (unreachable, auth refused)
    └── RunError             the run itself cannot go on (a shard died, the disk is full)

A failed request is not an exception: it is an attempt event with its status.
"""

import errno

CONTINUE = "continue with --resume"
"""The way on where no pass has chosen one (a shard's configuration made by hand, in tests): a
run's pass names its command in full (`continue_with`, chosen once per pass by
`runner.choose_way_on`)."""
CONTINUE_RETRYING = f"{CONTINUE} --retry-failed"
"""`CONTINUE` for a stop that also dead-lettered items."""

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""A write failed for want of space: a full disk, a quota, a file size limit."""


class ShardrunError(Exception):
    """Root of every error shardrun reports to the user as one sentence."""

    exit_code = 1


class SpecError(ShardrunError):
    """The job specification (file, flags or environment) is invalid."""

    exit_code = 2


class InputError(ShardrunError):
    """The input file cannot be read."""

    exit_code = 2


class InputCut(InputError):
    """The input file became shorter than what had been read of it, while it was read: `what`
    says so; a pass's sentence goes on with its way on (`runner._said`), any other command's
    (export, validate, a run's --strict check) with "run the command again"."""

    exit_code = 1

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}; put the file back as it was (lines added at its end are "
                         "fine), then run the command again")
        self.what = what


class RunDirError(ShardrunError):
    """A run directory (given to resume, export, report...) is missing or cannot be read."""

    exit_code = 2


class EndpointError(ShardrunError):
    """The endpoint cannot be used at all."""


class RunError(ShardrunError):
    """The run cannot go on."""


def continue_with(command: str) -> str:
    """A way on that names the command to run next (a retry pass's own, with its flags)."""
    return f"continue with `{command}`"


def stopped_writing(exc: OSError, way_on: str) -> str:
    """The sentence of a pass stopped by a file it could not write or read (a full disk, a
    path in the way), ending with what continues the run (`runner.choose_way_on`)."""
    where = f"{exc.filename}: " if exc.filename else ""
    return (f"{where}{(exc.strerror or str(exc)).lower()}; the run stopped there: "
            f"{fix_for_write(exc)}, then {way_on}")


def fix_for_write(exc: OSError) -> str:
    """What to do about a file of a run that could not be written, by why it could not."""
    if exc.errno in NO_ROOM:
        return "free some space"
    return "make that path usable (a read-only or damaged run directory?)"


def run_dir_gone(path: object, way_on: str) -> str:
    """The sentence of a pass whose run directory was deleted or moved away while it ran."""
    return (f"the run directory {path} was deleted or moved away while the run ran, so what it "
            "answered from then on would be in no file there; the run stopped: put the "
            f"directory back and {way_on}, or, if it is gone, start the job again as a new run")
