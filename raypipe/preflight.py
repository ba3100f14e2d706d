"""What a config names on the machine that runs the job's driver, checked once before any work starts.

The config itself (raypipe.config) is pure: validating it reads no files,
packages or variables, so the actors and Train workers that receive it
validate it anywhere. What depends on the driver's machine is checked here,
once, by the commands and job entry points (raypipe.cli) and shown by
`raypipe doctor`: a `data.chat_template` file, the packages and variables the
trackers need, and outputs that would be lost: a relative output path in a job
that `ray job submit --working-dir` started, whose working directory is Ray's
temporary copy of that folder.
"""

from __future__ import annotations

from pathlib import Path

from raypipe.assets.templates import TEMPLATE_NAMES
from raypipe.config import RaypipeConfig
from raypipe.storage import is_url, job_package, resolve_secrets


def problems(cfg: RaypipeConfig) -> list[str]:
    """One line per setting this machine cannot serve, naming the setting and the fix; [] when all is well."""
    from raypipe.train.trackers import check_trackers

    found = []
    template = cfg.data.chat_template
    if template is not None and template not in TEMPLATE_NAMES and not Path(template).is_file():
        found.append(
            f"data.chat_template: must be one of {', '.join(TEMPLATE_NAMES)} or an existing .jinja file, got "
            f"{template!r}"
        )
    try:
        check_trackers(cfg.train.run.trackers, cfg.train.output)
    except ValueError as err:
        found.append(str(err))
    for section, options in (("data", cfg.data.storage_options), ("train", cfg.train.storage_options)):
        try:
            resolve_secrets(options, f"{section}.storage_options")
        except ValueError as err:
            found.append(f"{err}; set it where the job runs (the nodes' environment, not the job's command line)")
    relative = _relative_outputs_in_job(cfg, Path.cwd())
    if relative:
        found.append(relative)
    return found


def _relative_outputs_in_job(cfg: RaypipeConfig, cwd: Path) -> str | None:
    """The relative output paths of a job run in Ray's copy of its working dir, with the fix; None when there are
    none. Elsewhere a relative output is relative to the working directory, as for any command."""
    package = job_package(cwd)
    outputs = {
        "data.output": cfg.data.output,
        "train.output": cfg.train.output,
        "train.states.cache": cfg.train.states.cache,
        "eval.output": cfg.eval.output,
    }
    relative = {key: url for key, url in outputs.items() if url and not is_url(url) and not Path(url).is_absolute()}
    if package is None or not relative:
        return None
    given = ", ".join(f"{key}={url}" for key, url in relative.items())
    fix = " ".join(f"{key}=$PWD/{url}" for key, url in relative.items())
    return (
        f"{given}: relative outputs of a job resolve inside Ray's copy of its --working-dir, {package}, which Ray "
        "deletes with its session and names anew for every edit of the checkout: the outputs, checkpoints and "
        "finished stages would be lost to the next job. Give absolute paths or URLs after the recipe, e.g. "
        f"`{fix}` (the submitting shell expands $PWD: the checkout's own folders, on a local head), or a shared "
        "folder or an s3:// URL on a cluster"
    )


def preflight(cfg: RaypipeConfig) -> RaypipeConfig:
    """`cfg`, or a ValueError listing what this machine cannot serve."""
    found = problems(cfg)
    if found:
        raise ValueError(f"config {cfg.name!r} cannot run here:\n" + "\n".join(f"  {line}" for line in found))
    return cfg
