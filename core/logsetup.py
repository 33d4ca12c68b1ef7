"""Logging: text for people, JSON lines for log pipelines (--log-format)."""
from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per log line: ts, level, logger, msg (and exc)."""
    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line."""
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(fmt: str = "text", level: str = "info") -> None:
    """Log to standard error as text or JSON lines at `level`; quiet the chatty libraries."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("kubernetes", "urllib3", "pyroute2", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
