"""What a run prints: raypipe's `[stage]` lines on the console, the libraries' logs and native stderr in the run's
log folder, everything on the console with --verbose (raypipe.console)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# One process quieted as a job's driver or worker is: a library's INFO and warning records, a Python warning and
# what native code writes to file descriptor 2; then raypipe's line and a library's error.
PROCESS = textwrap.dedent(
    """
    import logging, os, warnings
    from raypipe.console import logger, quiet_process
    logging.getLogger("ray.data").addHandler(logging.StreamHandler())  # a library's own console handler
    logging.getLogger("ray.data").propagate = False
    logging.getLogger("ray.data").setLevel(logging.INFO)
    path = quiet_process("worker")
    logging.getLogger("ray.data").info("library info")
    logging.getLogger("vllm.engine").warning("library warning")
    warnings.warn("library future warning", FutureWarning)
    os.write(2, b"native stderr line\\n")
    logger("train").info("step 1/2")
    logging.getLogger("ray.data").error("library error")
    print("file:", path)
    """
)


def run_process(tmp_path: Path, verbose: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAYPIPE_LOG_DIR": str(tmp_path / "logs"), "RAYPIPE_VERBOSE": "1" if verbose else "0"}
    return subprocess.run([sys.executable, "-c", PROCESS], env=env, capture_output=True, text=True, timeout=120)


def test_console_keeps_raypipe_lines_and_errors_the_file_keeps_the_rest(tmp_path):
    out = run_process(tmp_path, verbose=False)
    assert out.returncode == 0, out.stderr
    console = out.stdout + out.stderr
    assert "[train] step 1/2" in out.stdout
    assert "library error" in out.stderr  # something wrong still shows
    for quiet in ("library info", "library warning", "library future warning", "native stderr line"):
        assert quiet not in console
    [path] = [line.removeprefix("file: ") for line in out.stdout.splitlines() if line.startswith("file: ")]
    assert Path(path).parent == tmp_path / "logs" and Path(path).name.startswith("worker-")
    kept = Path(path).read_text()
    for line in ("library info", "library warning", "library future warning", "native stderr line", "library error"):
        assert line in kept
    # vLLM and Ray Data configure their loggers themselves (at import, at each dataset): the folder's config files.
    assert {p.name.split("-logging-")[0] for p in (tmp_path / "logs").glob("*-logging-*.json")} == {"vllm", "ray.data"}


def test_verbose_prints_everything_and_writes_no_file(tmp_path):
    out = run_process(tmp_path, verbose=True)
    assert out.returncode == 0, out.stderr
    for line in ("library info", "library warning", "library future warning", "native stderr line", "library error"):
        assert line in out.stderr
    assert "[train] step 1/2" in out.stdout and "file: None" in out.stdout
    assert not (tmp_path / "logs").exists()


def test_bars_off_a_terminal_print_their_end_not_their_start(capsys):
    from raypipe.progress import progress

    bar = progress(3, "[prepare] shards", "shards")
    for _ in range(3):
        bar.update()
    bar.close()
    quick = progress(2, "[eval] trained drafter, temperature 0", "prompts", only_if_slow=True)
    quick.update(2)
    quick.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[prepare] shards: 3/3 shards (100%)"), lines
