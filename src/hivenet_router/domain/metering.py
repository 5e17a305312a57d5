"""Which answers the router asks for usage, and which it therefore need not read the text of
(docs/admission.md, "One meter"). Dispatch calls these for every agent and provider answer.
"""

from __future__ import annotations

from hivenet_router.domain.answer import Answer
from hivenet_router.domain.request import Job
from hivenet_router.domain.usage import USAGE_ROUTES, ask_for_usage

ANTHROPIC_ROUTE = "/v1/messages"
CHAT_ROUTE = "/v1/chat/completions"


def asking_for_usage(job: Job, honoured: bool) -> bytes | None:
    """The body to send instead of the client's so that an OpenAI-format stream reports its
    usage (`stream_options.include_usage`), when the engine honours it and the client did
    not ask; None to send the client's body."""
    if not honoured or not job.stream or job.route not in USAGE_ROUTES:
        return None
    return ask_for_usage(job.body)


def native_provider(job: Job) -> str:
    """The provider whose own API this route is, and which reports usage on it."""
    return "anthropic" if job.route == ANTHROPIC_ROUTE else "openai"


def expect_usage(answer: Answer, job: Job, reports: bool) -> None:
    """Tell a stream from an engine that reports usage at its end (asked on OpenAI routes,
    always on Anthropic's) that its text need not be counted (domain/answer.py)."""
    if not reports or not answer.streamed or answer.status >= 400:
        return
    if job.route == ANTHROPIC_ROUTE:
        answer.expect_usage(anthropic=True, framing=0)
    elif job.route in USAGE_ROUTES:
        # A chat stream opens with an event that carries the role, not a token.
        answer.expect_usage(anthropic=False, framing=int(job.route == CHAT_ROUTE))
