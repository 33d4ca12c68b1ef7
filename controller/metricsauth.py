"""/metrics of the controller behind core/scrapeauth.py (as the agent's, netagent/http.py): a cached
verdict on the event loop, an unknown token reviewed on its own small pool only when the
authorizer admits it (429 beyond), refusals 401/403 with the reason; /healthz and /readyz stay open."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.scrapeauth import ScrapeAuthorizer, ScrapeRefused

REVIEWERS = 2  # threads for scrape reviews: apart from the agents' TokenReview pool (controller/api.py)
Handler = Callable[[web.Request], Awaitable[web.Response]]


def guarded(handler: Handler, authorizer: ScrapeAuthorizer) -> tuple[Handler, Callable[[], None]]:
    """`handler` behind the authorizer, and the function that stops its review pool."""
    pool = concurrent.futures.ThreadPoolExecutor(REVIEWERS, thread_name_prefix="metrics-review")

    async def serve(request: web.Request) -> web.Response:
        header = request.headers.get("Authorization")
        try:
            if authorizer.cached(header) is None:
                source = request.remote or ""
                if not authorizer.admit(source, header):
                    raise ScrapeRefused("busy", "too many tokens under review; retry")
                try:
                    await asyncio.get_running_loop().run_in_executor(pool, authorizer.authorize, header)
                finally:
                    authorizer.release(source)
        except ScrapeRefused as exc:
            headers = {"WWW-Authenticate": 'Bearer realm="netagent"'} if exc.status == 401 else (
                {"Retry-After": "1"} if exc.status in (429, 503) else {})
            return web.Response(status=exc.status, text=f"{exc.reason}: {exc}\n", headers=headers)
        return await handler(request)

    return serve, lambda: pool.shutdown(wait=False, cancel_futures=True)


class ScrapeAuthCollector(Collector):
    """The authorizer's own figures (the agent's twin is netagent/http.py's, under netagent_)."""

    def __init__(self, authorizer: ScrapeAuthorizer, prefix: str = "netagent_controller_"):
        self.authorizer, self.prefix = authorizer, prefix

    def collect(self):
        yield from self.authorizer.families(self.prefix, CounterMetricFamily, GaugeMetricFamily)
