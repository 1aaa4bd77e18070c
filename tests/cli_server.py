"""Runs one of fairseq's command-line tools for the tests in forked children of one process.

Starting `fairseq-train` costs ~6 s on a 2-core CPU before it reads its first argument (torch,
and scipy/scikit-learn through fairseq's criterions), and the suite starts dozens.
This server imports the module of one tool (named on its command line) once; each request
forks a child that runs the tool's console entry point (what the `fairseq-train` script calls)
with the request's argv, cwd and environment changes, stdout and stderr sent to files.
The parent only imports: it starts no torch thread pool, so a fork copies a single-threaded
process in the state a fresh interpreter has after the same imports. One server a tool, as
each tool's module sets up logging when imported. The plugin (`--user-dir`) is imported by
the child, so every run sees the code as it is on disk.

Protocol (stdin/stdout, one JSON object a line): request {"tool", "args", "cwd", "stdout",
"stderr", "env": variables to set (null: unset)}, answer {"rc": exit status}. `conftest.run_cli`
is the client; it starts a fresh process instead when a test changed a variable that torch or
fairseq may read as they load (it would not take effect in a forked child).
"""

import json
import os
import sys
import tempfile
from importlib.metadata import entry_points


def _entry_point(tool):
    (ep,) = entry_points(group="console_scripts", name=tool)
    return ep.load()  # imports the tool's module, here, before any fork


def _run_child(req, main, printed):
    """In the forked child: become the tool. Never returns to the request loop.

    Exit as the console script does (`sys.exit(main())`): its SystemExit or an uncaught
    exception reaches the interpreter, which prints what it prints for the script, runs the
    exit handlers and ends the process with the script's status.
    """
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin is the server's request pipe
    for fd, path, text in ((1, req["stdout"], printed[0]), (2, req["stderr"], printed[1])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.write(fd, text)  # what the imports printed in the server
    os.chdir(req["cwd"])
    for name, value in req.get("env", {}).items():  # the test's environment, where it differs
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    sys.argv = [req["tool"], *req["args"]]
    raise SystemExit(main())


def serve(requests, answers, tool, main, printed):
    for line in requests:
        req = json.loads(line)
        if req["tool"] != tool:
            raise ValueError(f"this server runs {tool}, not {req['tool']}")
        sys.stdout.flush()  # nothing buffered may reach a child's copy of stdout
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(req, main, printed)
        _, wait_status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(wait_status)}) + "\n")
        answers.flush()


def import_tool(tool):
    """Import the tool's module; returns its entry point and what the import wrote to stdout
    and to stderr.

    A fresh process prints that first (fairseq logs a missing tensorboardX as it imports), so
    every child replays it before running. While importing, stdout and stderr go to files;
    afterwards stdout stays on stderr: the real stdout carries the answers alone.
    """
    saved_err = os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            main = _entry_point(tool)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_err, 1)
            os.dup2(saved_err, 2)
            out.seek(0)
            err.seek(0)
            printed = out.read(), err.read()
            os.write(2, printed[1])  # the server's own log, if anything goes wrong
    return main, printed


if __name__ == "__main__":
    # As in the console scripts, the first import path is the interpreter's bin directory,
    # not this tests directory.
    sys.path[0] = os.path.dirname(sys.executable)
    answers = os.fdopen(os.dup(1), "w")
    os.set_inheritable(answers.fileno(), False)
    (tool,) = sys.argv[1:]
    serve(sys.stdin, answers, tool, *import_tool(tool))
