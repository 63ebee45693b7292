"""Token-in, token-out calls to the engines' OpenAI ``/v1/completions``, routed by ``ChatRouter``.

The prompt goes as token ids; the answer comes back as the engine's token ids
(``return_token_ids``) with one behaviour log-prob per token and the policy
versions the engine served (``x-disagg-policy-version-min/-max`` headers).
The real ``openai`` client is used with no client-side timeout and no retries
unless configured: a retry would re-submit a request id that may still be
running, and a long generation must not be cut off by a default 600 s timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from disagg.agent.router import ChatRouter
from disagg.errors import RolloutError
from disagg.rollout.types import VERSION_MAX_HEADER, VERSION_MIN_HEADER, SamplingSpec


@dataclass(frozen=True)
class EngineAuth:
    """How a client proves itself to the engines' OpenAI API and checks them: the key they ask off
    loopback (``rollout.api_key``; None over loopback), and the PEM an HTTPS engine is verified against."""

    key: str | None = None
    tls_ca: str | None = None

    def __repr__(self) -> str:  # never the key in a log line or a Ray error
        return f"EngineAuth(key={'set' if self.key else None}, tls_ca={self.tls_ca!r})"


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_min: int
    version_max: int
    engine_id: int


class RoutedCompletions:
    """One ``AsyncOpenAI`` client per engine; each call picks its engine with the router."""

    def __init__(self, addresses: dict[int, str], model: str, *, timeout_s: float | None = None,
                 max_retries: int = 0, router: ChatRouter | None = None, auth: EngineAuth | None = None) -> None:
        self.model = model
        self.router = router or ChatRouter(sorted(addresses))
        self._timeout_s, self._max_retries = timeout_s, max_retries
        self.auth = auth or EngineAuth()
        self.clients: dict = {}
        for e, a in addresses.items():
            self.add_engine(e, a)

    def add_engine(self, engine_id: int, address: str) -> None:
        """Route new sessions to ``engine_id`` too (an engine that joined the pool)."""
        from openai import AsyncOpenAI

        http = None
        if self.auth.tls_ca:
            import ssl

            import httpx

            http = httpx.AsyncClient(verify=ssl.create_default_context(cafile=os.path.expanduser(self.auth.tls_ca)),
                                     timeout=self._timeout_s)
        # Over loopback the engines ask no key; the client wants one all the same.
        self.clients[engine_id] = AsyncOpenAI(base_url=f"{address}/v1", api_key=self.auth.key or "none",
                                              timeout=self._timeout_s, max_retries=self._max_retries, http_client=http)
        self.router.add_engine(engine_id)

    async def remove_engine(self, engine_id: int) -> None:
        """An engine left the pool: no request goes to it again (a session pinned to it moves)."""
        self.router.set_health(engine_id, "dead")
        client = self.clients.pop(engine_id, None)
        if client is not None:
            await client.close()

    async def complete(self, session_id: str | None, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingSpec, stop_token_ids: list[int]) -> TurnOutput:
        engine = self.router.acquire(session_id)
        try:
            raw = await self.clients[engine].completions.with_raw_response.create(
                model=self.model, prompt=prompt_ids, max_tokens=max_tokens,
                temperature=0.0 if sampling.greedy else sampling.temperature,
                top_p=1.0 if sampling.greedy else sampling.top_p, logprobs=0, seed=sampling.seed,
                extra_body={"return_token_ids": True, "stop_token_ids": stop_token_ids,
                            "skip_special_tokens": False, "ignore_eos": sampling.ignore_eos},
                extra_headers={"X-Session-ID": session_id} if session_id else None,
            )
        finally:
            self.router.release(engine)
        resp = raw.parse()
        choice = resp.choices[0]
        ids = list(getattr(choice, "token_ids", None) or [])
        lps = list(choice.logprobs.token_logprobs) if choice.logprobs is not None else []
        if len(lps) != len(ids):
            raise RolloutError(f"engine {engine}: {len(ids)} tokens but {len(lps)} log-probs in the response")
        try:
            v_min, v_max = int(raw.headers[VERSION_MIN_HEADER]), int(raw.headers[VERSION_MAX_HEADER])
        except (KeyError, ValueError) as e:
            raise RolloutError(f"engine {engine}: response without disagg's policy-version headers "
                               f"({VERSION_MIN_HEADER}); is it a disagg engine?") from e
        return TurnOutput(ids, [float(x) for x in lps], str(choice.finish_reason), v_min, v_max, engine)

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()
