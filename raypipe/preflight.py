"""What a config names on the machine that runs the job's driver, checked once before any work starts.

The config itself (raypipe.config) is pure: validating it reads no files,
packages or variables, so the actors and Train workers that receive it
validate it anywhere. What depends on the driver's machine is checked here,
once, by the commands and job entry points (raypipe.cli) and shown by
`raypipe doctor`: a `data.chat_template` file, the packages and variables the
trackers need.
"""

from __future__ import annotations

from pathlib import Path

from raypipe.assets.templates import TEMPLATE_NAMES
from raypipe.config import RaypipeConfig
from raypipe.storage import resolve_secrets


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
    return found


def preflight(cfg: RaypipeConfig) -> RaypipeConfig:
    """`cfg`, or a ValueError listing what this machine cannot serve."""
    found = problems(cfg)
    if found:
        raise ValueError(f"config {cfg.name!r} cannot run here:\n" + "\n".join(f"  {line}" for line in found))
    return cfg
