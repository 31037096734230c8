"""`run.notify`: a webhook told when a run starts and how it ends (completed, NaN stop, error,
interrupted), in Discord's format or as plain JSON. A call that fails or times out is one warning
line: a notification never changes how the run goes."""

from __future__ import annotations

import json
import os
import sys
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Any

from .config import Config

EXIT_OK, EXIT_INTERRUPTED = 0, 130
DISCORD_HOSTS = ("discord.com", "discordapp.com", "ptb.discord.com", "canary.discord.com")
DISCORD_LIMIT = 2000  # characters of a Discord message


def end_event(status: str, code: int) -> str:
    """The event a run's end is: `completed`, `interrupted`, `nan_stop` (non-finite loss, gradients
    or weights) or `error`."""
    if code == EXIT_OK:
        return "completed"
    if code == EXIT_INTERRUPTED:
        return "interrupted"
    return "nan_stop" if "non-finite" in status else "error"


def notify(config: Config, event: str, status: str, **fields: Any) -> None:
    """Call the configured webhook (if any) with one event; `fields` (steps, seconds, ...) go into
    the JSON body and the message."""
    settings = config.run.notify
    if settings is None:
        return
    url = settings.url or os.environ.get(settings.url_env, "")
    if not url:
        print(f"warning: run.notify: the environment variable {settings.url_env} is not set; no notification",
              file=sys.stderr)
        return
    message = describe(config, status, fields)
    host = urllib.parse.urlsplit(url).hostname or ""
    if settings.format == "discord" or (settings.format == "auto" and host in DISCORD_HOSTS):
        body = {"content": message[:DISCORD_LIMIT]}
    else:
        body = {"event": event, "run": config.run.name, "status": status, **fields, "message": message}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "sdxl-trainer"})  # Discord refuses urllib's default agent
    try:
        with urllib.request.urlopen(request, timeout=settings.timeout_seconds) as response:
            response.read()
    except (OSError, ValueError, HTTPException) as exc:  # the URL itself is never printed: it may hold a token
        print(f"warning: run.notify: the {event} notification to {host or 'the webhook'} failed "
              f"({type(exc).__name__}: {exc}); the run goes on", file=sys.stderr)


def notify_error(config: Config, exc: BaseException) -> None:
    """An error that ends the run, told once however many processes run it (by the main one)."""
    if os.environ.get("RANK", "0") == "0":
        notify(config, "error", f"failed: {type(exc).__name__}: {exc}")


def describe(config: Config, status: str, fields: dict[str, Any]) -> str:
    """One line for people: the run, what happened, and the numbers."""
    details = ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in fields.items())
    return f"sdxl-trainer run {config.run.name!r}: {status}" + (f" ({details})" if details else "")
