"""A fork server for the e2e scripts beside this file: imports torch and megatron-core once, then runs each
requested script in a child forked from that state.

    python tests/e2e/build_server.py        (started by tests/build_util.py, one per interpreter and test process)

Most of an e2e script's run is importing torch and megatron-core: one mamba_param_count.py build took 48-129 s
in a new interpreter on the loaded 2-core test machine, 1.6-2.8 s forked from here (docs/testing.md).
Each request is one line of JSON on stdin, {"argv": [script, arg, ...] or ["-c", code, arg, ...], "env": {...},
"cwd": "...", "stdout": path, "stderr": path}; the server forks, and the child runs the script as
``python script arg ...`` would (``__main__``, ``sys.argv``, ``sys.path`` from the script's directory and the
request's PYTHONPATH, the request's environment and directory, fresh seeds, its output to the two files), then
its exit handlers, and exits. The server answers two lines of JSON, {"pid": the child's} when it starts and
{"rc": its exit status} when it ends. A child starts from the server's state, a new interpreter's plus the
modules imported here, so no build sees what another one did (process groups, parallel_state, patches, seeds:
tests/test_build_server.py).

The one difference from a new interpreter: megatron.core's package (about 150 modules) is imported before a
script installs its stand-ins (the referee's shims, einops, mamba_ssm's norm). They patch attributes looked up
at call time, and the builds' parameter counts, checked by hand in the tests, are the same either way.
A server started for the Bridge tests' PEFT scripts (MEMGUARD_E2E_SERVER_PATH: the Transformer Engine stand-in,
first on its path as the scripts' PYTHONPATH puts it, so megatron-core imports with it as theirs does;
MEMGUARD_E2E_PRELOAD: megatron.bridge.recipes) has imported Bridge too; their counts and bytes, forked and in new
interpreters, are the same (tests/test_bridge_real.py).
A venv without torch or megatron-core starts the server all the same: the script then fails in the child as it
would alone (``No module named ...``).
"""
import atexit
import importlib
import json
import os
import runpy
import sys
import traceback
import types
import warnings


_FRESH_FILTERS = list(warnings.filters)
_BASE_PATH = sys.path[1:]       # (started without PYTHONPATH) what follows a request's PYTHONPATH entries


def _path(script_dir: str, pythonpath: str) -> list:
    """sys.path as the interpreter builds it for a script under PYTHONPATH: the script's directory, PYTHONPATH's
    entries made absolute (in the current directory), then the rest, each entry once (site.removeduppaths)."""
    entries = []
    for p in [os.path.abspath(e) for e in pythonpath.split(os.pathsep)] if pythonpath else []:
        if p not in entries:
            entries.append(p)
    return [script_dir, *entries, *(p for p in _BASE_PATH if p not in entries)]


def _preload() -> None:
    """torch, megatron-core and the modules MEMGUARD_E2E_PRELOAD names (comma-separated), with the directories of
    MEMGUARD_E2E_SERVER_PATH first on the path (tests/build_util.py sets both; a child's sys.path is its request's)."""
    extra = [p for p in os.environ.get("MEMGUARD_E2E_SERVER_PATH", "").split(os.pathsep) if p]
    sys.path[0:0] = extra
    # fd 1 is the answer pipe: what an import prints (Bridge's log lines) goes nowhere, while sys.stdout stays the
    # object a logging handler made now holds, which writes to a child's fd 1, its output, as in a new interpreter
    sys.stdout.flush()
    answer = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    try:
        with warnings.catch_warnings():     # (the "Transformer Engine and Apex are not installed" notes, once per run)
            warnings.simplefilter("ignore")
            for name in ["torch", "megatron.core", *(m for m in os.environ.get("MEMGUARD_E2E_PRELOAD", "").split(",") if m)]:
                try:
                    importlib.import_module(name)
                except Exception:       # (a child's own import then fails as it would alone)
                    break
    finally:
        sys.stdout.flush()
        os.dup2(answer, 1)
        os.close(answer)


def _fresh_randomness() -> None:
    """The random state a new interpreter starts with: Python's, NumPy's and torch's global generators seeded from
    the OS (torch seeds its CPU generator so at import), where forked children would all share the server's."""
    import random
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def exit_status(e: SystemExit) -> int:
    """The status the interpreter ends with on ``e``: an int code as is, None 0, anything else printed and 1."""
    if isinstance(e.code, int):
        return e.code
    if e.code is None:
        return 0
    print(e.code, file=sys.stderr)
    return 1


def _child(req: dict) -> int:
    """Run the request's script as its own program would; return its exit status."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    sys.stdin = open(os.devnull)    # (not the server's reader, which may hold the next request's bytes)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req.get("cwd") or os.getcwd())
    if req["argv"][0] == "-c":      # python -c CODE ARG...: sys.argv[0] "-c", sys.path[0] the directory
        code_text = req["argv"][1]
        sys.argv = ["-c", *req["argv"][2:]]
        sys.path[:] = _path("", req["env"].get("PYTHONPATH", ""))
    else:
        code_text = None
        script = os.path.abspath(req["argv"][0])
        sys.argv = [script, *req["argv"][1:]]
        sys.path[:] = _path(os.path.dirname(script), req["env"].get("PYTHONPATH", ""))
    warnings.filters[:] = _FRESH_FILTERS    # the filters a fresh interpreter starts with
    _fresh_randomness()
    code = 0
    try:
        if code_text is None:
            runpy.run_path(script, run_name="__main__")
        else:
            main_module = types.ModuleType("__main__")
            sys.modules["__main__"] = main_module
            exec(compile(code_text, "<string>", "exec"), main_module.__dict__)
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main() -> None:
    _preload()
    requests = sys.stdin
    answer = sys.stdout
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(req)
            finally:
                os._exit(code)
        answer.write(json.dumps({"pid": pid}) + "\n")     # (the client kills it on a timeout)
        answer.flush()
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
