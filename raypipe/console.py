"""What a run prints on the console, and where everything else goes.

The console shows raypipe's own lines (`[stage] message`, from the `raypipe.<stage>` loggers of `logger`) and its
progress bars (raypipe.progress). The libraries' logs (Ray's, Ray Data's, Serve's, Ray Train's, vLLM's,
transformers', Python warnings) go to the run's log folder instead, one file per process
(`{RAYPIPE_LOG_DIR}/{kind}-{host}-{pid}.log`; vLLM's and Ray Data's in `vllm-{host}.log`, `ray.data-{host}.log`);
only their errors still reach the console. `--verbose` (RAYPIPE_VERBOSE=1) leaves every library as it is.

Every process of a run is quieted the same way: the driver by `quiet_process("driver")`, each Ray worker of the job
(Ray Data actors, Serve replicas, Ray Train workers, reply writers, evaluation tasks) by `quiet_worker`, Ray's
`worker_process_setup_hook` in the job's runtime env, before the worker imports any library. A worker's stdout and
stderr are forwarded to the driver's console line by line, so a library must not write there:
- vLLM and Ray Data configure their loggers themselves, at import and (Ray Data) at each dataset's execution, so
  they get a config file of their own (`VLLM_LOGGING_CONFIG_PATH`, `RAY_DATA_LOGGING_CONFIG`), which child processes
  inherit too (the service's engine core is a child of its replica);
- transformers adds its console handler at first use, so it is told to log errors only;
- what native code writes to stderr (Ray's C++ core worker, torch's C++ warnings) goes to the process's file: its
  file descriptor 2 is the file, while Python's `sys.stderr` keeps the console.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TextIO

VERBOSE = "RAYPIPE_VERBOSE"
LOG_DIR = "RAYPIPE_LOG_DIR"
# The loggers of the libraries a run uses that print on their own (their own console handlers, not propagating).
LIBRARY_LOGGERS = ("ray", "ray.data", "ray.serve", "ray.train", "ray.tune", "vllm", "transformers", "speculators")
RECORD_FORMAT = "%(asctime)s %(levelname)s %(name)s %(filename)s:%(lineno)d: %(message)s"


def verbose() -> bool:
    return os.environ.get(VERBOSE) == "1"


class _StageFormatter(logging.Formatter):
    """`[stage] message`: the stage is the logger's name after `raypipe.`."""

    def format(self, record: logging.LogRecord) -> str:
        return f"[{record.name.removeprefix('raypipe.')}] {record.getMessage()}"


class _Stdout(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a line is logged (a redirect, a test's capture), not the one it was made
    with."""

    raypipe_console = True

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def logger(stage: str) -> logging.Logger:
    """The logger of a stage's console lines, `[stage] message` on stdout in whichever process logs them."""
    root = logging.getLogger("raypipe")
    if not any(isinstance(h, _Stdout) for h in root.handlers):
        handler = _Stdout()
        handler.setFormatter(_StageFormatter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    return logging.getLogger(f"raypipe.{stage}")


def job_env(verbose: bool, log_dir: str) -> dict[str, str]:
    """Environment variables for the driver and every Ray worker of a job the CLI starts: the verbosity and the log
    folder, and unless verbose, loguru's (speculators') errors only, no Hugging Face progress bars (transformers'
    while a checkpoint is saved, in carriage returns), and Serve's logs in its files only.
    One already set (by the user, or by the runtime env of `ray job submit`) is left as it is."""
    wanted = {VERBOSE: "1" if verbose else "0", LOG_DIR: log_dir}
    if not verbose:
        wanted |= {
            "LOGURU_LEVEL": "ERROR",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "RAY_SERVE_LOG_TO_STDERR": "0",
            "TRANSFORMERS_VERBOSITY": "error",
        }
    return {k: v for k, v in wanted.items() if k not in os.environ}


def quiet_process(kind: str) -> Path | None:
    """Send this process's library logs and warnings to its file in the log folder (errors still to the console), and
    point vLLM's logging at the folder for this process and its children. Returns the file; None when verbose or
    when no log folder is set (a process outside a raypipe job)."""
    folder = os.environ.get(LOG_DIR)
    if verbose() or not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    host, pid = socket.gethostname(), os.getpid()
    path = Path(folder) / f"{kind}-{host}-{pid}.log"
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter(RECORD_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn (FutureWarnings, DeprecationWarnings) become records of py.warnings
    replaced = sys.stderr
    _native_stderr_to(path)
    quiet_console_handlers(replaced)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        if not library.propagate:
            library.addHandler(handler)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_logging_config(Path(folder), host, "vllm"))
    os.environ["RAY_DATA_LOGGING_CONFIG"] = str(_logging_config(Path(folder), host, "ray.data"))
    return path


def _native_stderr_to(path: Path) -> None:
    """What native code writes to file descriptor 2 (Ray's C++ core worker, torch's C++ warnings), and so what child
    processes write there, goes to the file; Python's `sys.stderr` (tracebacks, progress bars, errors) keeps the
    original stream."""
    sys.stderr.flush()
    original = os.dup(2)
    with open(path, "ab") as file:
        os.dup2(file.fileno(), 2)
    sys.stderr = os.fdopen(original, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")


def _logging_config(folder: Path, host: str, library: str) -> Path:
    """A dictConfig for a library that configures its own logger whenever it is first imported (vLLM, by
    VLLM_LOGGING_CONFIG_PATH) or again later (Ray Data, by RAY_DATA_LOGGING_CONFIG, on each dataset's execution): its
    records to `{library}-{host}.log` (appended to by every process of the node), its errors to stderr too."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"record": {"format": RECORD_FORMAT}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "formatter": "record",
                "filename": f"{folder}/{library}-{host}.log",
            },
            "console": {"class": "logging.StreamHandler", "formatter": "record", "level": "ERROR"},
        },
        "loggers": {library: {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
    path = folder / f"{library}-logging-{host}.json"  # JSON is YAML too, which Ray Data reads
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(config))
    temporary.replace(path)  # another process of the node may read it now
    return path


def quiet_console_handlers(replaced: TextIO | None = None) -> None:
    """The console handlers the libraries added (Ray's, Ray Data's, the root logger's in a Ray Train worker): errors
    only, and those that wrote to `replaced` (the stderr before `_native_stderr_to`) write to the console's. Ray Train
    adds its own when a worker starts, after `quiet_worker` ran, so its loop calls this again."""
    if verbose():
        return
    for name in ("", *LIBRARY_LOGGERS):
        for own in logging.getLogger(name).handlers:
            if isinstance(own, logging.StreamHandler) and not isinstance(own, logging.FileHandler):
                if not getattr(own, "raypipe_console", False):
                    own.setLevel(logging.ERROR)
                if replaced is not None and own.stream is replaced:
                    own.setStream(sys.stderr)


def quiet_worker() -> None:
    """Ray's `worker_process_setup_hook` for every worker of a raypipe job (runs before the worker's task).

    It also names the worker's own cluster in RAY_ADDRESS: Ray Train's state and placement-group actors look their
    cluster up by address, and on a machine running two Ray instances that look-up fails ("Found multiple active Ray
    instances") and their threads die with a traceback on the console."""
    import ray

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    quiet_process("worker")
